"""Chrome trace and timeline of the op profiler's events.

:class:`TraceExport` holds the :class:`~amanda.tools.profiler.OpProfiler`
methods that turn recorded events into a Chrome trace (trace event format,
opens in Perfetto) and a matplotlib timeline; the functions below place
events on lanes, nest them in module spans and link forward ops to their
backward ops with flow events.
"""

from __future__ import annotations

import json
import os

from amanda.runtime.tool_support import support_for
from amanda.tools.profiler_events import ACCUMULATE_GRAD, BACKWARD, FORWARD

__all__ = ["TraceExport"]


class TraceExport:
    """Trace output of :class:`~amanda.tools.profiler.OpProfiler` (a mixin:
    it reads the profiler's ``events``, ``steps`` and ``kernel_events``)."""

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
    return tuple(module.split(_separator(namespace)))


def _join(parts, namespace):
    return _separator(namespace).join(parts)


def _separator(namespace):
    """How the backend joins module paths (``.``; TF name scopes: ``/``)."""
    support = support_for(namespace)
    return "." if support is None else support.MODULE_PATH_SEPARATOR


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
