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

The tool depends on a :class:`~amanda.tools.mapping.MappingTool` with
:data:`amanda.tools.mapping_rules.RULES` for canonical op types; it only uses
the public API.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict

import amanda
from amanda.errors import AmandaError
from amanda.tools import mapping_rules
from amanda.tools._module_path import module_path_of
from amanda.tools._shapes import dims
from amanda.tools.mapping import MappingTool

__all__ = ["ACCUMULATE_GRAD", "OpProfiler", "OpInfo", "RANGE_PREFIX", "profile_steps",
           "quiet_kineto"]

#: The type under which PyTorch's ``AccumulateGrad`` nodes (a leaf's gradient
#: added into its ``.grad``) are aggregated, apart from the forward op's type.
ACCUMULATE_GRAD = "accumulate_grad"

#: Prefix of the ``record_function`` ranges that enclose each op while
#: :meth:`OpProfiler.record_kernels` is active.
RANGE_PREFIX = "amanda.op#"

FORWARD, BACKWARD = "forward", "backward"
_PHASES = (FORWARD, BACKWARD)


class OpInfo:
    """What the profiler knows of one instrumented (forward or backward) op.

    Attributes:
        index: position in :attr:`OpProfiler.ops` (names its kernel range).
        phase: ``"forward"`` or ``"backward"``.
        name: the op's own name: the canonical type of a forward op
            (``linear``, ``conv2d``), the backward op's name for a backward
            op (``AddmmBackward0``; TF: the gradient op's type, ``Conv2DBackpropFilter``).
        type: the canonical type of the forward op (for a backward op, of the
            forward op owning it; its own type when no forward op owns it).
        op_id: the forward op's stable id (TF: the op name).
        backward_op_id: the backward op's stable id (backward only).
        module: dotted module path (PyTorch; "" for the root module), or the
            op's name scope (TF); None outside any module.
        shapes: input shapes at the op's first execution (gradient shapes for
            backward ops); None entries for non-tensors or unknown shapes.
        namespace: the context's namespace.
        producers: in graph mode, the keys of the ops this op waits for (data
            and control inputs); None in eager mode.
    """

    __slots__ = ("index", "phase", "name", "type", "op_id", "backward_op_id", "module",
                 "shapes", "namespace", "producers")

    def __init__(self, index, phase, name, op_type, op_id, backward_op_id, module, shapes,
                 namespace, producers=None):
        self.index = index
        self.phase = phase
        self.name = name
        self.type = op_type
        self.op_id = op_id
        self.backward_op_id = backward_op_id
        self.module = module
        self.shapes = shapes
        self.namespace = namespace
        self.producers = producers

    @property
    def key(self):
        """The op's id in its phase: op id (forward), backward op id (backward)."""
        return self.op_id if self.phase == FORWARD else self.backward_op_id

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self):
        return f"<OpInfo {self.phase} {self.name} id={self.key} module={self.module!r}>"


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


class OpProfiler(amanda.Tool):
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
        if context.namespace.startswith("onnx/"):
            # onnxruntime orders a routine only by dataflow: the routines hand
            # back the op's first input and output, so the op waits for the
            # start routine and its consumers for the stop routine
            inputs = context.get_inputs()
            first = [0] if inputs and inputs[0] is not None else []
            context.insert_before_op(self._onnx_start, inputs=first, info=info)
            context.insert_after_op(self._onnx_stop, outputs=[0], info=info)
            return
        context.insert_before_op(self._start, inputs=[], info=info)
        context.insert_after_op(self._stop, outputs=[], info=info)

    def _backward_analysis(self, context):
        backward_op = context.get_backward_op()
        name = _backward_name(backward_op)
        if name == "AccumulateGrad":
            # adds a gradient into a leaf's .grad: not a computation of the
            # forward op that used the leaf, so it gets a row of its own
            op_type = ACCUMULATE_GRAD
        else:
            op_type = context.get("type") or mapping_rules.canonical_type(name, {})
        info = self._new_info(BACKWARD, name, op_type, context, module_path_of(context),
                              _shapes(context.get_grad_outputs()), _producers(backward_op))
        context.insert_before_backward_op(self._start, grad_outputs=[], info=info)
        context.insert_after_backward_op(self._stop, grad_inputs=[], info=info)

    # -- instrumentation routines (observe only) ---------------------------------
    def _onnx_start(self, *tensors, info):
        self._open[(self._run(), info)] = self.clock()
        return tensors   # handed back: the op waits for this routine

    def _onnx_stop(self, *tensors, info):
        # one session may run on several threads at once: pair start and
        # stop within one run, and begin an op no earlier than the previous
        # op's end in the same run (its start routine may have run while
        # other ops still executed), so sequential events never overlap
        end = self.clock()
        run = self._run()
        start = self._open.pop((run, info), None)
        previous = self._ends.get(run)
        self._ends[run] = end
        if start is not None and start <= end:
            if previous is not None and previous > start:
                start = previous
            self.events.append((info, start, end))
        return tensors

    @staticmethod
    def _run():
        from amanda.runtime.onnx import current_run
        return current_run()

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

    # -- Chrome trace ----------------------------------------------------------------
    def chrome_trace(self, modules=True, flows=True, origin_ns=None, pid=None,
                     process_name=None):
        """The events as a Chrome trace (trace event format) dictionary.

        Forward ops are on thread 1 ("forward ops"), backward ops on thread 2
        ("backward ops"); events that overlap in time (TF's parallel
        executor) go to extra lanes of their phase (tids 1xx / 2xx); the
        blocks marked with :meth:`step` are slices ``step N`` on thread 0
        ("steps"). Timestamps are microseconds from the first event. Each op
        is a complete event (``"ph": "X"``) with ``args`` ``op_id``,
        ``backward_op_id``, ``type``, ``module`` and ``shapes``; the CPU
        events :meth:`record_kernels` saw inside an op (aten ops) are complete
        events nested in it (``cat`` ``"kernel"``).

        Args:
            modules: enclose each run of consecutive ops in a module by a
                span named by its module path, nesting as the modules do.
            flows: link each forward op execution to the backward op
                executions it owns with flow events (``"s"``/``"f"``, ``cat``
                ``"fwdbwd"``, one id per pair, the finish binding to the
                enclosing slice: ``"bp": "e"``), as ``torch.profiler`` does.
            origin_ns: the clock reading that becomes time 0 (default: the
                first event's start); :mod:`amanda.distributed` aligns ranks
                with it.
            pid: the process id of the events (default: this process's).
            process_name: the process's name (default: ``amanda <namespaces>``).

        Returns:
            ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``:
            metadata first, then the slices sorted by thread, then start, then
            longest first, so parents precede their children, then the flows.
        """
        starts = [start for _, start, _ in self.events] + [start for _, start, _ in self.steps]
        origin = min(starts, default=0) if origin_ns is None else origin_ns
        pid = os.getpid() if pid is None else pid
        namespaces = sorted({info.namespace for info, _, _ in self.events})
        meta = [_meta(pid, 0, "process_name",
                      {"name": process_name or "amanda " + ", ".join(namespaces)})]
        spans = []
        if self.steps:
            meta += _thread_meta(pid, 0, "steps")
            spans += [_complete(f"step {number}", "step", start - origin, end - start, pid, 0,
                                {"step": number}) for number, start, end in self.steps]
        placed = []   # (start, end, info, tid) of every op execution
        for base, phase in ((1, FORWARD), (2, BACKWARD)):
            lanes = _lanes(sorted(((s, e, info) for info, s, e in self.events
                                   if info.phase == phase), key=lambda x: (x[0], x[1])))
            for lane, items in enumerate(lanes):
                tid = base if lane == 0 else base * 100 + lane
                meta += _thread_meta(pid, tid, f"{phase} ops" + (f" (lane {lane})" if lane else ""))
                for start, end, info in items:
                    placed.append((start, end, info, tid))
                    spans.append(_complete(info.name, phase, start - origin, end - start, pid,
                                           tid, {"op_id": str(info.op_id),
                                                 "backward_op_id": _str(info.backward_op_id),
                                                 "type": info.type, "module": info.module,
                                                 "shapes": info.shapes}))
                if modules:
                    for path, start, end, namespace in _module_spans(items):
                        spans.append(_complete(_join(path, namespace), "module", start - origin,
                                               end - start, pid, tid,
                                               {"module": _join(path, namespace)}))
        spans += self._kernel_spans(placed, origin, pid)
        spans.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"], _RANK[e["cat"]],
                                  e["args"].get("depth", 0)))
        arrows = _flow_events(placed, origin, pid) if flows else []
        return {"traceEvents": meta + spans + arrows, "displayTimeUnit": "ms",
                "otherData": {"tool": "amanda.tools.profiler.OpProfiler",
                              "namespaces": namespaces}}

    def _kernel_spans(self, placed, origin, pid):
        tids = {(info.index, start): tid for start, _, info, tid in placed}
        spans = []
        for info, op_start, start, end, name, depth in self.kernel_events:
            tid = tids.get((info.index, op_start))
            if tid is not None:
                spans.append(_complete(name, "kernel", start - origin, end - start, pid, tid,
                                       {"op": info.name, "depth": depth}))
        return spans

    def save_chrome_trace(self, path, modules=True, **options):
        """Write :meth:`chrome_trace` (``options`` are its keyword arguments)
        as JSON to ``path``; returns the path."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(modules, **options), f)
        return path

    # -- kernels (PyTorch) -----------------------------------------------------------
    @contextlib.contextmanager
    def record_kernels(self, activities=None):
        """Capture a kernel-level breakdown per op with ``torch.profiler``.

        Inside the block, every op the profiler times runs inside a
        ``record_function`` range named ``amanda.op#<index>``; when the block
        ends, the profiler's events are grouped by the range enclosing them.
        On CPU the groups hold the aten ops each op dispatched to; with a GPU
        (``ProfilerActivity.CUDA`` is added when CUDA is available) also the
        CUDA kernels they launched, with their device time.

        Args:
            activities: ``torch.profiler.ProfilerActivity`` values to record
                (default: CPU, plus CUDA where available).

        Yields:
            The ``torch.profiler.profile`` object.
        """
        import torch
        from torch.profiler import ProfilerActivity, profile
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        first = len(self.events)
        with quiet_kineto():
            prof.__enter__()
        try:
            self._record_function = torch.autograd.profiler.record_function
            yield prof
        finally:
            self._record_function = None
            for scope in self._ranges.values():   # ops that never finished
                scope.__exit__(None, None, None)
            self._ranges.clear()
            with quiet_kineto():
                prof.__exit__(None, None, None)
        ranges = self._group_kernels(prof.events())
        self._place_kernel_events(ranges, self.events[first:])

    def _group_kernels(self, events):
        """Group the profiler's events by the op range enclosing them; returns
        ``{op index: [range events]}``."""
        ranges = defaultdict(list)
        for event in events:
            name = event.name
            if not name.startswith(RANGE_PREFIX):
                continue
            try:
                index = int(name[len(RANGE_PREFIX):])
            except ValueError:
                continue
            ranges[index].append(event)
            groups = self._kernels.setdefault(index, {"cpu": {}, "device": {}})
            for descendant, _ in _descendants(event):
                # self time: what ran in this event and not in its children,
                # so the times of an op's events add up to its CPU time
                _add(groups["cpu"], descendant.name, descendant.self_cpu_time_total)
                for kernel in getattr(descendant, "kernels", ()) or ():
                    _add(groups["device"], kernel.name, kernel.duration)
        return ranges

    def _place_kernel_events(self, ranges, window):
        """Put the CPU events inside each op's range on amanda's clock, as
        :attr:`kernel_events`. The n-th range of an op is the n-th execution
        of that op in ``window``; the profiler's clock is shifted so the range
        starts with the execution, and events are clipped to the execution
        (the range encloses amanda's own two clock reads)."""
        executions = defaultdict(list)
        for info, start, end in window:
            executions[info.index].append((start, end))
        for index, events in ranges.items():
            info = self.ops[index]
            events = sorted(events, key=lambda e: e.time_range.start)
            for event, (start, end) in zip(events, sorted(executions.get(index, ()))):
                shift = start - int(event.time_range.start * 1e3)
                for child, depth in _descendants(event):
                    child_start = max(start, int(child.time_range.start * 1e3) + shift)
                    child_end = min(end, int(child.time_range.end * 1e3) + shift)
                    if child_start <= child_end:
                        self.kernel_events.append((info, start, child_start, child_end,
                                                   child.name, depth))

    def kernels(self):
        """Per op, what ran inside it during :meth:`record_kernels`.

        Returns:
            ``{(phase, op key): {"info": OpInfo, "cpu": {name: {"calls", "us"}},
            "device": {name: {"calls", "us"}}}}``: ``cpu`` holds the profiler
            events inside the op's range (aten ops, autograd nodes) with
            their self CPU time (their children's excluded, so the times add
            up), ``device`` the GPU kernels launched from inside it (empty
            without a GPU).
        """
        result = {}
        for index, groups in self._kernels.items():
            info = self.ops[index]
            entry = result.setdefault((info.phase, info.key),
                                      {"info": info, "cpu": {}, "device": {}})
            for side in ("cpu", "device"):
                for name, (calls, us) in groups[side].items():
                    slot = entry[side].setdefault(name, {"calls": 0, "us": 0.0})
                    slot["calls"] += calls
                    slot["us"] += us
        return result

    def kernel_table(self, top=10, side="cpu"):
        """Text table of the ops with the most kernel time and their kernels.

        Args:
            top: ops to show.
            side: ``"cpu"`` (aten ops) or ``"device"`` (GPU kernels).
        """
        entries = sorted(self.kernels().values(),
                         key=lambda e: -sum(k["us"] for k in e[side].values()))
        lines = []
        for entry in entries[:top]:
            info = entry["info"]
            total = sum(k["us"] for k in entry[side].values())
            if not entry[side]:
                continue
            lines.append(f"{info.phase} {info.name} [{info.module or ''}] {total / 1e3:.3f} ms")
            for name, k in sorted(entry[side].items(), key=lambda item: -item[1]["us"]):
                lines.append(f"    {name:<48} x{k['calls']:<4} {k['us'] / 1e3:>9.3f} ms")
        return "\n".join(lines)

    # -- plotting ----------------------------------------------------------------------
    def plot_timeline(self, path, title=None, top_types=8, module_depth=4):
        """Render the recorded events as a timeline PNG with matplotlib.

        One row per module depth (forward spans) above a row of forward ops,
        then a row of backward ops; ops are coloured by type (the
        ``top_types`` types with most time; the others grey).

        Args:
            path: the image file to write.
            title: the figure title.
            top_types: how many op types get their own colour.
            module_depth: module nesting levels drawn above the forward ops.

        Returns:
            ``path``.
        """
        import matplotlib
        from matplotlib.figure import Figure   # no pyplot: the user's backend is left alone
        from matplotlib.patches import Patch

        origin = min((start for _, start, _ in self.events), default=0)
        types = list(self.by_type())[:top_types]
        palette = matplotlib.colormaps["tab10"]
        colours = {t: palette(i % 10) for i, t in enumerate(types)}
        forward = sorted(((s, e, i) for i, s, e in self.events if i.phase == FORWARD),
                         key=lambda x: x[0])
        backward = sorted(((s, e, i) for i, s, e in self.events if i.phase == BACKWARD),
                          key=lambda x: x[0])
        spans = [sp for sp in _module_spans(forward) if 0 < len(sp[0]) <= module_depth]
        depths = sorted({len(p) for p, _, _, _ in spans})
        rows = [f"modules (depth {d})" for d in depths] + ["forward ops", "backward ops"]
        fig = Figure(figsize=(14, 1.0 + 0.55 * len(rows)))
        ax = fig.subplots()
        y_of = {label: len(rows) - 1 - i for i, label in enumerate(rows)}
        span_ms = self._span_ns(origin) / 1e6
        for path_parts, start, end, _ in spans:
            y = y_of[f"modules (depth {len(path_parts)})"]
            left, width = (start - origin) / 1e6, (end - start) / 1e6
            ax.broken_barh([(left, width)], (y - 0.35, 0.7), facecolors="#d9d9d9",
                           edgecolors="#7f7f7f", linewidth=0.4)
            if width > 0.06 * span_ms:   # label the spans wide enough to read
                ax.text(left + width / 2, y, path_parts[-1], ha="center", va="center",
                        fontsize=6, clip_on=True)
        for label, items in (("forward ops", forward), ("backward ops", backward)):
            y = y_of[label]
            bars = [((s - origin) / 1e6, max((e - s) / 1e6, 1e-4)) for s, e, _ in items]
            faces = [colours.get(info.type, "#bdbdbd") for _, _, info in items]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=faces, linewidth=0)
        ax.set_yticks([y_of[r] for r in rows])
        ax.set_yticklabels(rows, fontsize=8)
        ax.set_xlabel("time (ms)")
        ax.set_xlim(0, span_ms)
        legend = [Patch(facecolor=colours[t], label=str(t)) for t in types]
        legend.append(Patch(facecolor="#bdbdbd", label="other"))
        below = -0.25 if len(rows) < 5 else -0.15
        ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, below),
                  ncol=min(len(legend), 9), fontsize=7, frameon=False)
        ax.set_title(title or "amanda OpProfiler timeline", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=150)
        return path

    def _span_ns(self, origin):
        return max((end for _, _, end in self.events), default=origin) - origin

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


# -- helpers -------------------------------------------------------------------------------

def _str(value):
    return None if value is None else str(value)


def _complete(name, category, ts_ns, dur_ns, pid, tid, args):
    return {"name": str(name), "cat": category, "ph": "X", "ts": ts_ns / 1e3,
            "dur": dur_ns / 1e3, "pid": pid, "tid": tid, "args": args}


# order of slices that start together and last as long: the enclosing first
_RANK = {"step": 0, "module": 1, FORWARD: 2, BACKWARD: 2, "kernel": 3}


def _meta(pid, tid, name, args):
    return {"ph": "M", "pid": pid, "tid": tid, "name": name, "args": args}


def _thread_meta(pid, tid, name):
    return [_meta(pid, tid, "thread_name", {"name": name}),
            _meta(pid, tid, "thread_sort_index", {"sort_index": tid})]


def _flow_events(placed, origin, pid):
    """Flow events from each forward op execution to the backward op
    executions it owns: a backward execution pairs with the latest forward
    execution of its op that started before it. Both ends sit in the middle
    of their slice, so each binds to it (or to a kernel nested in it) even
    where a module span starts at the same time. Gradient accumulation is
    not the forward op's work and gets no arrow."""
    latest, events = {}, []
    for start, end, info, tid in sorted(placed, key=lambda p: (p[0], p[1])):
        middle = (start + end) / 2 - origin
        if info.phase == FORWARD:
            latest[info.op_id] = (middle, tid)
            continue
        source = latest.get(info.op_id)
        if source is None or info.type == ACCUMULATE_GRAD:
            continue
        flow_id = len(events) // 2 + 1
        events.append({"ph": "s", "id": flow_id, "pid": pid, "tid": source[1],
                       "ts": source[0] / 1e3, "name": "fwdbwd", "cat": "fwdbwd"})
        events.append({"ph": "f", "bp": "e", "id": flow_id, "pid": pid, "tid": tid,
                       "ts": middle / 1e3, "name": "fwdbwd", "cat": "fwdbwd"})
    return events


def _parts(module, namespace):
    """Components of a module path: dotted in PyTorch, name scopes in TF."""
    if not module:
        return ()
    separator = "/" if namespace.startswith("tensorflow") else "."
    return tuple(module.split(separator))


def _join(parts, namespace):
    separator = "/" if namespace.startswith("tensorflow") else "."
    return separator.join(parts)


def _lanes(items):
    """Split ``(start, end, info)`` items (sorted by start) into lanes of
    non-overlapping items, greedily: an item goes to the first lane that is
    free at its start."""
    lanes, ends = [], []
    for item in items:
        for i, end in enumerate(ends):
            if end <= item[0]:
                lanes[i].append(item)
                ends[i] = item[1]
                break
        else:
            lanes.append([item])
            ends.append(item[1])
    return lanes


def _module_spans(items):
    """Module spans over a lane of ``(start, end, info)`` items in time order.

    Each maximal run of consecutive items whose module path starts with a
    prefix gives one span of that prefix, from the run's first start to its
    last end; spans of longer prefixes nest inside shorter ones.

    Returns:
        ``(path components, start, end, namespace)`` tuples.
    """
    spans, stack = [], []    # stack entries: [components, start, end, namespace]
    for start, end, info in items:
        parts = _parts(info.module, info.namespace)
        keep = 0
        while keep < len(stack) and keep < len(parts) and stack[keep][0] == parts[:keep + 1]:
            keep += 1
        while len(stack) > keep:
            spans.append(tuple(stack.pop()))
        for depth in range(keep, len(parts)):
            stack.append([parts[:depth + 1], start, end, info.namespace])
        for entry in stack:
            entry[2] = max(entry[2], end)
    spans.extend(tuple(entry) for entry in reversed(stack))
    return spans


def _add(table, name, us):
    slot = table.setdefault(name, [0, 0.0])
    slot[0] += 1
    slot[1] += float(us)


def _descendants(event):
    """Every profiler event below ``event``, with its depth (1: a child)."""
    stack = [(child, 1) for child in event.cpu_children]
    while stack:
        child, depth = stack.pop()
        yield child, depth
        stack.extend((grandchild, depth + 1) for grandchild in child.cpu_children)


@contextlib.contextmanager
def quiet_kineto():
    """Keep kineto's status lines (``USDT: ... profiler_start``, ``STAGE: ...``),
    which it writes straight to file descriptor 2 when ``torch.profiler``
    starts and stops, off the user's terminal; anything else written to
    stderr meanwhile is passed on when the block ends."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):   # no usable fd 2: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().splitlines(keepends=True)
                    if not line.startswith((b"USDT:", b"STAGE:"))]
            if kept:
                os.write(2, b"".join(kept))


def _render_docs_figure(path):
    """Profile one training step of a small random BERT and plot it
    (``python -m amanda.tools.profiler docs/figures/trace.png``)."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=512, vocab_size=1000)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 1000, (2, 32))
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
