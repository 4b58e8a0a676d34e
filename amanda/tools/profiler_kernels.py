"""Kernel-level breakdown of the op profiler (PyTorch, ``torch.profiler``).

:class:`KernelRecording` holds the :class:`~amanda.tools.profiler.OpProfiler`
methods that run ops inside ``record_function`` ranges, group the profiler's
events (aten ops; CUDA kernels on a GPU) by the op enclosing them and report
them. torch is imported only when recording starts, by
:func:`amanda.runtime.pytorch.tools.kernel_profiler`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections import defaultdict

from amanda.runtime.tool_support import provider
from amanda.tools.profiler_events import RANGE_PREFIX

__all__ = ["KernelRecording", "quiet_kineto"]


class KernelRecording:
    """Kernel capture of :class:`~amanda.tools.profiler.OpProfiler` (a mixin:
    it uses the profiler's ``events``, ``ops``, ``_ranges``, ``_kernels`` and
    ``kernel_events``)."""

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
        prof, record_function = provider("kernel_profiler").kernel_profiler(activities)
        first = len(self.events)
        with quiet_kineto():
            prof.__enter__()
        try:
            self._record_function = record_function
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
