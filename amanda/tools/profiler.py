"""Op profiler and tracer: wall time of every forward and backward op.

:class:`OpProfiler` puts an observe-only routine before and after every op
(forward: ``insert_before_op`` / ``insert_after_op``; backward:
``insert_before_backward_op`` / ``insert_after_backward_op``). The first
reads a nanosecond clock, the second reads it again and records one *event*
``(op, start, end)``. From the events it builds

* aggregates by op type (forward and backward time side by side), by op
  name, by op and by module path (:meth:`OpProfiler.by_type`,
  :meth:`~OpProfiler.by_module`, :meth:`~OpProfiler.table`);
* a Chrome trace (trace event format, ``"X"`` complete events) that opens
  in Perfetto or ``chrome://tracing``, with module spans nesting the ops
  (:meth:`~OpProfiler.chrome_trace`, :meth:`~OpProfiler.save_chrome_trace`);
* in PyTorch, a kernel-level breakdown per op: inside
  :meth:`~OpProfiler.record_kernels`, each op runs inside a
  ``torch.profiler`` ``record_function`` range named after it, and the
  profiler's events (aten ops on CPU; CUDA kernels with a GPU) are grouped by
  the range that encloses them (:meth:`~OpProfiler.kernels`).

What a duration measures (see docs/tools/profiler.md):

* PyTorch eager: host wall time from just before the op is called to just
  after it returned (plus a little of amanda's own bookkeeping between the two
  routines). CUDA ops are asynchronous: without synchronisation their host
  time is the launch, use :meth:`~OpProfiler.record_kernels` for device time.
  Backward ops are timed in the autograd node's pre- and post-hooks.
* TensorFlow graph mode: routines are ``tf.numpy_function`` callbacks that
  the executor orders around the op: the before-callback is a control input
  of the op (it has no data input, so it runs as soon as the step starts),
  the after-callback waits on the op and the op's consumers wait on it. An
  event therefore starts at the later of the before-callback and the
  after-callbacks of the ops it waits for (its data and control inputs: when
  its last input was ready) and ends at its after-callback: the op's kernel
  plus the executor's scheduling and the callbacks' latency. Other ops may
  run meanwhile on the inter-op thread pool, so events can overlap (the
  trace puts overlapping events on separate lanes; :meth:`OpProfiler.busy_us`
  is the union of the intervals).

The routines are recorded inside
:func:`amanda.runtime.observation.hosted_observation`: graph backends keep
them inside the run, next to their ops, rather than calling observe-only
routines after it (which they do for other tools).

The tool depends on a :class:`~amanda.tools.mapping.MappingTool` with
:data:`amanda.tools.mapping_rules.RULES` for canonical op types; it only uses
the public API.

The tool collects events and aggregates them here; the Chrome trace and the
timeline are in :mod:`amanda.tools.profiler_trace`, the ``torch.profiler``
kernel breakdown in :mod:`amanda.tools.profiler_kernels`, :class:`OpInfo`
and the constants in :mod:`amanda.tools.profiler_events` (all importable
from here).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict

import amanda
from amanda.errors import AmandaError
from amanda.runtime.observation import hosted_observation
from amanda.runtime.tool_support import provider, support_for
from amanda.tools import mapping_rules
from amanda.tools._module_path import module_path_of
from amanda.tools._shapes import dims
from amanda.tools.mapping import MappingTool
from amanda.tools.profiler_events import (
    _PHASES,
    ACCUMULATE_GRAD,
    BACKWARD,
    FORWARD,
    RANGE_PREFIX,
    OpInfo,
)
from amanda.tools.profiler_kernels import KernelRecording, quiet_kineto
from amanda.tools.profiler_trace import (  # _lanes, _module_spans: importable from here
    TraceExport,
    _join,
    _lanes,
    _module_spans,
    _parts,
)

__all__ = ["ACCUMULATE_GRAD", "OpProfiler", "OpInfo", "RANGE_PREFIX", "profile_steps",
           "quiet_kineto"]


def _shapes(values):
    return [dims(v) for v in values or ()]


def _producers(op):
    """Keys of the ops a graph op waits for (``tf.Operation``: the ops of its
    inputs and its control inputs); None for eager ops, which run in program
    order."""
    inputs = getattr(op, "inputs", None)
    control = getattr(op, "control_inputs", None)
    if inputs is None or control is None or not hasattr(op, "graph"):
        return None
    return tuple(sorted({t.op.name for t in inputs} | {c.name for c in control}))


def _backward_name(op):
    kind = getattr(op, "type", None)          # tf.Operation
    if isinstance(kind, str):
        return kind
    return getattr(op, "__name__", None) or type(op).__name__


class OpProfiler(TraceExport, KernelRecording, amanda.Tool):
    """Time every forward and backward op; aggregate, trace and break down.

    Args:
        forward: time forward ops.
        backward: time backward ops.
        clock: a function returning nanoseconds (default ``time.perf_counter_ns``).

    Attributes:
        ops: every :class:`OpInfo` instrumented so far, by index.
        events: ``(OpInfo, start_ns, end_ns)`` for every op execution, in the
            order the executions finished.

    Example::

        profiler = OpProfiler()
        with amanda.apply(profiler):
            model(x).sum().backward()
        print(profiler.table())
        profiler.save_chrome_trace("trace.json")   # open in ui.perfetto.dev
    """

    def __init__(self, forward=True, backward=True, clock=time.perf_counter_ns):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.clock = clock
        self.ops = []
        self.events = []
        self._open = {}          # OpInfo -> start ns of its running execution
        self._ends = {}          # graph mode: op key -> end ns of its last execution
        self._ranges = {}        # OpInfo -> open record_function (kernel capture)
        self._record_function = None   # set while record_kernels() is active
        self._kernels = {}       # OpInfo index -> {"cpu"|"device": {kernel: [calls, us]}}
        self.kernel_events = []  # (OpInfo, op start, start_ns, end_ns, name, depth)
        self.steps = []          # (step number, start_ns, end_ns)
        self._step_number = 0
        self._lock = threading.Lock()
        if forward:
            self.add_inst_for_op(self._forward_analysis)
        if backward:
            self.add_inst_for_op(self._backward_analysis, backward=True)

    # -- analysis ----------------------------------------------------------------
    def _new_info(self, phase, name, op_type, context, module, shapes, producers):
        with self._lock:
            info = OpInfo(len(self.ops), phase, name, op_type, context.get_op_id(),
                          context.get_backward_op_id(), module, shapes, context.namespace,
                          producers)
            self.ops.append(info)
        return info

    def _forward_analysis(self, context):
        op_type = context.get("type") or context.get_op_name()
        info = self._new_info(FORWARD, op_type, op_type, context, module_path_of(context),
                              _shapes(context.get_inputs()), _producers(context.get_op()))
        support = support_for(context.namespace)
        if support is not None and support.ROUTINES_ORDERED_BY_DATAFLOW:
            # onnxruntime orders a routine only by dataflow: the routines hand
            # back the op's first input and output, so the op waits for the
            # start routine and its consumers for the stop routine
            inputs = context.get_inputs()
            first = [0] if inputs and inputs[0] is not None else []
            with hosted_observation():   # timers: inside the run, next to the op
                self._current_run = support.current_run   # which run a routine is in
                context.insert_before_op(self._onnx_start, inputs=first, info=info)
                context.insert_after_op(self._onnx_stop, outputs=[0], info=info)
            return
        with hosted_observation():
            context.insert_before_op(self._start, inputs=[], info=info)
            context.insert_after_op(self._stop, outputs=[], info=info)

    def _backward_analysis(self, context):
        backward_op = context.get_backward_op()
        name = _backward_name(backward_op)
        support = support_for(context.namespace)
        if support is not None and support.accumulates_gradient(backward_op):
            # adds a gradient into a leaf's .grad: not a computation of the
            # forward op that used the leaf, so it gets a row of its own
            op_type = ACCUMULATE_GRAD
        else:
            op_type = context.get("type") or mapping_rules.canonical_type(name, {})
        info = self._new_info(BACKWARD, name, op_type, context, module_path_of(context),
                              _shapes(context.get_grad_outputs()), _producers(backward_op))
        with hosted_observation():
            context.insert_before_backward_op(self._start, grad_outputs=[], info=info)
            context.insert_after_backward_op(self._stop, grad_inputs=[], info=info)

    # -- instrumentation routines (observe only) ---------------------------------
    def _onnx_start(self, *tensors, info):
        self._open[(self._current_run(), info)] = self.clock()
        return tensors   # handed back: the op waits for this routine

    def _onnx_stop(self, *tensors, info):
        # one session may run on several threads at once: pair start and
        # stop within one run, and begin an op no earlier than the previous
        # op's end in the same run (its start routine may have run while
        # other ops still executed), so sequential events never overlap
        end = self.clock()
        run = self._current_run()
        start = self._open.pop((run, info), None)
        previous = self._ends.get(run)
        self._ends[run] = end
        if start is not None and start <= end:
            if previous is not None and previous > start:
                start = previous
            self.events.append((info, start, end))
        return tensors

    def _start(self, *unused, info):
        record_function = self._record_function
        if record_function is not None:
            if info.phase == FORWARD:
                self._close_stale_ranges()
            scope = record_function(f"{RANGE_PREFIX}{info.index}")
            scope.__enter__()
            self._ranges[info] = scope
        self._open[info] = self.clock()

    def _stop(self, *unused, info):
        end = self.clock()
        start = self._open.pop(info, None)
        if info.producers is not None:
            # graph mode: the op could not start before its last input was ready
            ends = self._ends
            ends[info.key] = end
            for key in info.producers:
                ready = ends.get(key)
                if ready is not None and start is not None and start < ready <= end:
                    start = ready
        if start is not None:
            self.events.append((info, start, end))
        scope = self._ranges.pop(info, None)
        if scope is not None:
            scope.__exit__(None, None, None)

    def _close_stale_ranges(self):
        """Eager forward ops run one at a time: a forward range still open
        when the next forward op starts belongs to an op that returned no
        tensor (no after point); close it there so ranges stay nested."""
        for stale in [i for i in self._ranges if i.phase == FORWARD]:
            self._ranges.pop(stale).__exit__(None, None, None)

    # -- aggregates --------------------------------------------------------------
    @staticmethod
    def _phases(phase):
        if phase == "all":
            return _PHASES
        if phase not in _PHASES:
            raise AmandaError(f"OpProfiler: phase must be 'forward', 'backward' or 'all', "
                              f"got {phase!r}")
        return (phase,)

    def _aggregate(self, key, phase):
        phases = self._phases(phase)
        table = defaultdict(lambda: {"calls": 0, "forward_us": 0.0, "backward_us": 0.0})
        for info, start, end in self.events:
            if info.phase not in phases:
                continue
            row = table[key(info)]
            row["calls"] += 1
            row[f"{info.phase}_us"] += (end - start) / 1e3
        rows = {}
        for name, row in table.items():
            row["total_us"] = row["forward_us"] + row["backward_us"]
            row["mean_us"] = row["total_us"] / row["calls"]
            rows[name] = row
        return dict(sorted(rows.items(), key=lambda item: -item[1]["total_us"]))

    def by_type(self, phase="all"):
        """Canonical op type -> ``{"calls", "forward_us", "backward_us",
        "total_us", "mean_us"}``, largest total first. Backward ops count
        under the type of the forward op that owns them."""
        return self._aggregate(lambda info: info.type, phase)

    def by_name(self, phase="all"):
        """Like :meth:`by_type`, keyed by the op's own name (backward ops:
        ``AddmmBackward0``, ``Conv2DBackpropFilter``...)."""
        return self._aggregate(lambda info: info.name, phase)

    def by_module(self, phase="all", depth=None):
        """Module path (PyTorch; TF: name scope) -> times, as :meth:`by_type`.

        Args:
            phase: "forward", "backward" or "all".
            depth: keep only the first ``depth`` components of each path
                (``encoder.layer.0`` for depth 3), summing the rest into it.
        """
        def key(info):
            module = info.module
            if module is None or depth is None:
                return module
            return _join(_parts(module, info.namespace)[:depth], info.namespace)
        return self._aggregate(key, phase)

    def by_op(self, phase="all"):
        """``(phase, op key)`` -> times plus ``info`` (the :class:`OpInfo`)."""
        rows = self._aggregate(lambda info: info, phase)
        return {(info.phase, info.key): dict(row, info=info) for info, row in rows.items()}

    def total_us(self, phase="all"):
        """Sum of the durations of the recorded events, in microseconds."""
        phases = self._phases(phase)
        return sum(end - start for info, start, end in self.events if info.phase in phases) / 1e3

    def busy_us(self, phase="all"):
        """Length of the union of the events' intervals, in microseconds: the
        time during which at least one op ran (eager ops never overlap, so
        there it equals :meth:`total_us`)."""
        phases = self._phases(phase)
        intervals = sorted((s, e) for info, s, e in self.events if info.phase in phases)
        busy, reach = 0, None
        for start, end in intervals:
            if reach is None or start > reach:
                busy += end - start
                reach = end
            elif end > reach:
                busy += end - reach
                reach = end
        return busy / 1e3

    def reset(self):
        """Forget the events, steps and kernels (the analysis stays cached;
        step numbers keep counting)."""
        self.events.clear()
        self._open.clear()
        self._ends.clear()
        self._kernels.clear()
        self.kernel_events.clear()
        self.steps.clear()

    @contextlib.contextmanager
    def step(self):
        """Mark the block as one training step: the Chrome trace shows it as
        a slice ``step N`` on a ``steps`` track above the ops.

        Steps are numbered from 0 in the order they start, across
        :meth:`reset` (a warm-up step keeps number 0 although its events were
        dropped).

        Yields:
            The step's number.
        """
        number = self._step_number
        self._step_number += 1
        start = self.clock()
        try:
            yield number
        finally:
            self.steps.append((number, start, self.clock()))

    def table(self, by="type", top=20, phase="all", depth=None):
        """A readable text table of the times.

        Args:
            by: ``"type"``, ``"name"``, ``"module"`` or ``"op"``.
            top: rows to show (largest total first); None for all.
            phase: "forward", "backward" or "all".
            depth: module path depth for ``by="module"``.
        """
        if by == "type":
            rows = self.by_type(phase)
        elif by == "name":
            rows = self.by_name(phase)
        elif by == "module":
            rows = self.by_module(phase, depth)
        elif by == "op":
            rows = {f"{row['info'].name} [{row['info'].module or ''}] #{row['info'].index}": row
                    for row in self.by_op(phase).values()}
        else:
            raise AmandaError(f"OpProfiler.table: by must be 'type', 'name', 'module' or "
                              f"'op', got {by!r}")
        total = self.total_us(phase) or 1.0
        shown = list(rows.items())[:top] if top is not None else list(rows.items())
        labels = ["(none)" if k is None else ("(root)" if k == "" else str(k)) for k, _ in shown]
        width = max([len(by)] + [len(label) for label in labels])
        lines = [f"{by:<{width}}  {'calls':>7}  {'forward ms':>11}  {'backward ms':>11}  "
                 f"{'total ms':>10}  {'%':>6}",
                 f"{'-' * width}  {'-' * 7}  {'-' * 11}  {'-' * 11}  {'-' * 10}  {'-' * 6}"]
        for label, (_, row) in zip(labels, shown):
            lines.append(f"{label:<{width}}  {row['calls']:>7}  {row['forward_us'] / 1e3:>11.3f}  "
                         f"{row['backward_us'] / 1e3:>11.3f}  {row['total_us'] / 1e3:>10.3f}  "
                         f"{100 * row['total_us'] / total:>5.1f}%")
        if top is not None and len(rows) > top:
            lines.append(f"... {len(rows) - top} more")
        lines.append(f"{'-' * width}  {'-' * 7}  {'-' * 11}  {'-' * 11}  {'-' * 10}  {'-' * 6}")
        lines.append(f"{'total':<{width}}  {len(self.events):>7}  "
                     f"{self.total_us('forward') / 1e3 if phase != 'backward' else 0:>11.3f}  "
                     f"{self.total_us('backward') / 1e3 if phase != 'forward' else 0:>11.3f}  "
                     f"{self.total_us(phase) / 1e3:>10.3f}  {100.0:>5.1f}%")
        return "\n".join(lines)

    def __repr__(self):
        return (f"OpProfiler({len(self.events)} events, "
                f"forward {self.total_us('forward') / 1e3:.3f} "
                f"ms, backward {self.total_us('backward') / 1e3:.3f} ms)")


def profile_steps(profiler, run, steps=3, kernels=False, progress=None):
    """Run training steps under ``profiler``, each marked with :meth:`OpProfiler.step`.

    The first step runs the analysis; when there are more it is not
    measured (:meth:`OpProfiler.reset` after it). With ``kernels`` the last
    step runs under :meth:`OpProfiler.record_kernels`.

    Args:
        profiler: the :class:`OpProfiler`.
        run: a function running one step (forward, loss, backward).
        steps: steps to run, at least 1.
        kernels: PyTorch only: record the last step's aten ops.
        progress: ``progress(iterable, total)`` wrapping the measured steps
            (a progress bar), or None.

    Returns:
        The number of steps measured.
    """
    steps = max(1, steps)
    with amanda.apply(profiler):
        with profiler.step():
            run()
        if steps == 1:
            return 1
        profiler.reset()
        measured = range(steps - 1)
        for number in (progress(measured, steps - 1) if progress else measured):
            recording = profiler.record_kernels() if kernels and number == steps - 2 \
                else contextlib.nullcontext()
            with recording, profiler.step():
                run()
    return steps - 1


def _render_docs_figure(path):
    """Profile one training step of a small random BERT and plot it
    (``python -m amanda.tools.profiler docs/figures/trace.png``)."""
    model, ids = provider("random_bert").random_bert(
        hidden_size=128, layers=2, heads=2, intermediate_size=512, vocab_size=1000, batch=2,
        tokens=32)
    profiler = OpProfiler()
    for _ in range(3):   # warm up: analysis runs at the first step
        profiler.reset()
        with amanda.apply(profiler):
            model(ids).last_hidden_state.sum().backward()
    profiler.plot_timeline(path, title="One training step of a 2-layer BERT (hidden 128, "
                                       "batch 2 x 32 tokens), PyTorch eager, CPU")
    return profiler


if __name__ == "__main__":   # pragma: no cover - renders the docs figure
    import sys
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(_render_docs_figure(sys.argv[1] if len(sys.argv) > 1 else "trace.png").table(top=12))
