"""Reports of several processes (``torch.distributed`` ranks) merged into one.

PyTorch only (process groups and DDP are ``torch.distributed``'s); the
torch side lives in :mod:`amanda.runtime.pytorch.distributed`.

amanda's tools run unchanged inside ``DistributedDataParallel``; each rank
has its own profiler with its own results. The helpers here are collective
(every rank calls them) and hand the merged report to one rank:

* :func:`gather_chrome_trace`: one Chrome/Perfetto trace, a process (track
  group) per rank, the ranks' clocks aligned at a barrier;
* :func:`gather_flops` / :func:`gather_coverage`: counts summed over the
  ranks and checked equal across them (data-parallel ranks run the same
  ops); a rank that disagrees is reported loudly (a
  :class:`RankMismatchWarning`, or an error with ``strict=True``).

:func:`merge_chrome_traces` and :func:`merge_counts` do the merging without
a process group. :func:`run_local` runs a function on N local processes in
a gloo group on 127.0.0.1; :func:`profile_model` runs a built-in model that
way under DDP (``amanda trace MODEL --nproc N``, ``amanda flops MODEL --nproc N``).

Example::

    # in every rank, after init_process_group
    profiler = OpProfiler()
    with amanda.apply(profiler), profiler.step():
        ddp_model(x).sum().backward()
    trace = amanda.distributed.gather_chrome_trace(profiler, "trace.json")  # rank 0: the merged trace
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import tempfile
import warnings

from amanda.errors import AmandaError

__all__ = ["RankMismatchWarning", "gather_chrome_trace", "gather_coverage", "gather_flops",
           "merge_chrome_traces", "merge_counts", "profile_model", "run_local"]


class RankMismatchWarning(UserWarning):
    """Ranks that should have counted the same did not."""


# -- merging (no process group needed) ------------------------------------------------------

def merge_chrome_traces(traces):
    """One trace from the traces of several ranks (rank = position).

    Each rank's events get ``pid`` = its rank, a ``process_name`` ``rank N``
    (its own process name after it) and a ``process_sort_index``, so a viewer
    shows one track group per rank in rank order; flow ids are renumbered so
    they stay unique.

    Args:
        traces: :meth:`~amanda.tools.profiler.OpProfiler.chrome_trace` dicts,
            one per rank, on a common time origin.

    Returns:
        The merged trace dict.
    """
    merged, next_id = [], 1
    for rank, trace in enumerate(traces):
        events = trace["traceEvents"]
        own = next((e["args"]["name"] for e in events
                    if e["ph"] == "M" and e["name"] == "process_name"), "amanda")
        renumber = {}
        merged.append({"ph": "M", "pid": rank, "tid": 0, "name": "process_name",
                       "args": {"name": f"rank {rank}" + ("" if own.startswith("rank ")
                                                          else f" ({own})")}})
        merged.append({"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index",
                       "args": {"sort_index": rank}})
        for event in events:
            if event["ph"] == "M" and event["name"] in ("process_name", "process_sort_index"):
                continue
            event = dict(event, pid=rank)
            if event["ph"] in ("s", "t", "f"):
                if event["id"] not in renumber:
                    renumber[event["id"]] = next_id
                    next_id += 1
                event["id"] = renumber[event["id"]]
            merged.append(event)
    return {"traceEvents": merged, "displayTimeUnit": "ms",
            "otherData": {"tool": "amanda.distributed", "ranks": len(traces)}}


def merge_counts(reports, what="counts", strict=False):
    """Sum per-rank count tables and check the ranks agree.

    Args:
        reports: one ``{table name: {key: number}}`` per rank (rank = position).
        what: what is counted, for the messages.
        strict: raise instead of warning when a rank disagrees.

    Returns:
        ``{"ranks", "total": {table: {key: sum}}, "per_rank": reports,
        "consistent", "mismatches": [message, ...]}``.

    Raises:
        AmandaError: with ``strict``, when a rank's tables differ from rank 0's.
    """
    total, mismatches = {}, []
    for rank, report in enumerate(reports):
        for table, counts in report.items():
            summed = total.setdefault(table, {})
            for key, value in counts.items():
                summed[key] = summed.get(key, 0) + value
            reference = reports[0].get(table, {})
            if rank and counts != reference:
                keys = sorted({*counts, *reference}, key=str)
                diff = [f"{k}: {reference.get(k, 0)} vs {counts.get(k, 0)}" for k in keys
                        if reference.get(k, 0) != counts.get(k, 0)]
                mismatches.append(f"rank {rank} {what} ({table}) differ from rank 0's: "
                                  + ", ".join(diff[:5]) + (" ..." if len(diff) > 5 else ""))
    for message in mismatches:
        if strict:
            raise AmandaError(f"amanda.distributed: {message}")
        warnings.warn(f"amanda.distributed: {message}", RankMismatchWarning, stacklevel=3)
    return {"ranks": len(reports), "total": total, "per_rank": list(reports),
            "consistent": not mismatches, "mismatches": mismatches}


# -- collectives -------------------------------------------------------------------------------

def _dist():
    from amanda.runtime.pytorch.distributed import process_group
    return process_group()


def _gather(value, dst, group):
    dist = _dist()
    gathered = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(value, gathered, dst=dst, group=group)
    return gathered


def gather_chrome_trace(profiler, path=None, dst=0, group=None, **options):
    """Collective: every rank's :class:`~amanda.tools.profiler.OpProfiler`
    events in one trace on rank ``dst``.

    The ranks' clocks are aligned at a barrier: each reads its clock when
    the barrier returns, and time 0 is that moment minus the longest time any
    rank profiled before it, so every rank's first event is at time >= 0 and
    simultaneous moments line up (to the barrier's skew).

    Args:
        profiler: this rank's profiler.
        path: where rank ``dst`` writes the merged JSON (None: not written).
        dst: the rank that receives the trace.
        group: the process group (default: the world).
        options: more :meth:`~amanda.tools.profiler.OpProfiler.chrome_trace` arguments.

    Returns:
        The merged trace dict on rank ``dst``, None on the others.
    """
    dist = _dist()
    dist.barrier(group=group)
    now = profiler.clock()
    starts = [s for _, s, _ in profiler.events] + [s for _, s, _ in profiler.steps]
    lead = now - min(starts, default=now)
    leads = [None] * dist.get_world_size(group)
    dist.all_gather_object(leads, lead, group=group)
    rank = dist.get_rank(group)
    trace = profiler.chrome_trace(origin_ns=now - max(leads), pid=rank,
                                  process_name=f"rank {rank}", **options)
    traces = _gather(trace, dst, group)
    if traces is None:
        return None
    merged = merge_chrome_traces(traces)
    if path is not None:
        with open(path, "w") as f:
            json.dump(merged, f)
    return merged


def gather_flops(profiler, dst=0, group=None, strict=False):
    """Collective: a :class:`~amanda.tools.flops.FlopsProfiler`'s FLOPs by op
    type (forward, backward) summed over the ranks on rank ``dst``, checked
    equal across ranks (see :func:`merge_counts`); None on other ranks."""
    report = {"forward": profiler.by_type("forward"), "backward": profiler.by_type("backward")}
    reports = _gather(report, dst, group)
    return None if reports is None else merge_counts(reports, "FLOPs", strict)


def gather_coverage(tool, dst=0, group=None, strict=False):
    """Collective: a :class:`~amanda.tools.coverage.CoverageTool`'s points by
    op name (forward, backward) summed over the ranks on rank ``dst``,
    checked equal across ranks; None on other ranks."""
    report = {"forward": dict(tool.forward), "backward": dict(tool.backward)}
    reports = _gather(report, dst, group)
    return None if reports is None else merge_counts(reports, "instrumentation points", strict)


# -- local multi-process runs ------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(worker, nproc, *args):
    """Run ``worker(rank, nproc, *args)`` on ``nproc`` new local processes
    joined in a gloo process group on 127.0.0.1.

    Args:
        worker: a picklable (module-level) function.
        nproc: the number of processes (ranks).
        args: picklable arguments.

    Returns:
        The workers' return values, by rank.
    """
    from amanda.runtime.pytorch.distributed import run_workers
    if nproc < 1:
        raise AmandaError(f"amanda.distributed.run_local: nproc must be at least 1, got {nproc}")
    with tempfile.TemporaryDirectory() as folder:
        run_workers(worker, nproc, _free_port(), folder, args)
        results = []
        for rank in range(nproc):
            with open(os.path.join(folder, f"rank{rank}.pickle"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _profile_worker(rank, nproc, spec, what, steps, kernels):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import amanda
    from amanda import models
    from amanda.runtime.pytorch.distributed import wrap_ddp
    work = models.load(spec)
    if work.framework != "pytorch":
        raise AmandaError(f"amanda.distributed: {spec} is a {work.framework} model; "
                          "several processes run PyTorch models under DDP")
    work.model = wrap_ddp(work.model)   # one thread each: N processes share the cores
    if what == "trace":
        from amanda.tools.profiler import OpProfiler, profile_steps
        profiler = OpProfiler()
        measured = profile_steps(profiler, work.run, steps, kernels)
        summary = {"forward_us": profiler.total_us("forward"),
                   "backward_us": profiler.total_us("backward"),
                   "by_type": profiler.by_type(), "steps_measured": measured}
        summaries = _gather(summary, 0, None)
        trace = gather_chrome_trace(profiler)
        return None if trace is None else {"trace": trace, "per_rank": summaries}
    from amanda.tools.flops import FlopsProfiler
    profiler = FlopsProfiler()
    with amanda.apply(profiler):
        work.run()
    return gather_flops(profiler)


def profile_model(spec, what, nproc, steps=3, kernels=False):
    """Run a PyTorch model spec (:mod:`amanda.models`) wrapped in
    ``DistributedDataParallel`` on ``nproc`` local processes (gloo,
    127.0.0.1), each rank under its own tool, and merge the reports.

    Args:
        spec: the model spec (``cnn``, ``file.py:factory``...).
        what: ``"trace"`` (an :class:`~amanda.tools.profiler.OpProfiler` over
            ``steps`` steps) or ``"flops"`` (a
            :class:`~amanda.tools.flops.FlopsProfiler` over one step).
        nproc: the number of processes.
        steps: training steps (trace).
        kernels: record the last step's aten ops (trace).

    Returns:
        trace: ``{"trace": merged trace, "per_rank": [per-rank summaries]}``;
        flops: :func:`merge_counts`'s report.
    """
    if what not in ("trace", "flops"):
        raise AmandaError(f"amanda.distributed.profile_model: what must be 'trace' or "
                          f"'flops', got {what!r}")
    return run_local(_profile_worker, nproc, spec, what, steps, kernels)[0]
