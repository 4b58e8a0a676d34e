"""``amanda flops``: forward and backward FLOPs per op type and module."""

from __future__ import annotations

import os

import amanda
from amanda.cli.common import (
    Command,
    UsageError,
    _add_out_argument,
    _count,
    _jsonable,
    _model_help,
    _progress,
    _safe_name,
    _Workloads,
    _write_json,
    require,
    staged,
)
from amanda.cli.table import print_table


def _flops_chart(profiler, spec, path, top=10):
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
    types = list(profiler.by_type())[:top]
    figure, axes = plt.subplots(figsize=(7, 0.45 * len(types) + 1.2))
    positions = range(len(types))
    axes.barh(positions, [forward.get(t, 0) / 1e9 for t in types], label="forward")
    axes.barh(positions, [backward.get(t, 0) / 1e9 for t in types],
              left=[forward.get(t, 0) / 1e9 for t in types], label="backward")
    axes.set_yticks(list(positions), types)
    axes.invert_yaxis()
    axes.set_xlabel("GFLOPs per step")
    axes.set_title(f"FLOPs by op type: {spec}")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(staged(path), dpi=110)
    plt.close(figure)
    return path


def run_flops(args):
    require("flops", args.models, *(["matplotlib"] if args.chart else []))
    from amanda.tools.flops import FlopsProfiler
    workloads = _Workloads(args.models)
    results = []
    for spec in _progress(args.models, len(args.models), "counting FLOPs"):
        work = workloads(spec)
        if args.nproc > 1:
            results.append(_run_flops_processes(spec, work, args.nproc))
            continue
        profiler = FlopsProfiler(backward=not args.forward_only)
        with amanda.apply(profiler):
            work.run()
        forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
        _print_flops(profiler, spec, work.framework, args.top, args.depth)
        result = {"model": spec, "framework": work.framework,
                  "forward": profiler.total("forward"), "backward": profiler.total("backward"),
                  "by_type": {t: {"forward": forward.get(t, 0), "backward": backward.get(t, 0)}
                              for t in profiler.by_type()},
                  "by_module": profiler.by_module(), "modules": profiler.modules(),
                  "unknown": dict(profiler.unknown)}
        if args.chart:
            result["chart"] = _flops_chart(profiler, spec, os.path.join(
                args.out, f"flops-{_safe_name(spec)}.png"))
        results.append(result)
    path = _write_json(args.out, "flops.json", _jsonable(results))
    print(f"full report: {path}")
    return 0


def _run_flops_processes(spec, work, nproc):
    """``--nproc N``: FLOPs of each rank under DDP, summed and checked equal."""
    from amanda import distributed
    from amanda.tools.flops import format_count
    if work.framework != "pytorch":
        raise UsageError(f"`amanda flops --nproc` runs PyTorch models; {spec} is a "
                         f"{work.framework} model")
    report = distributed.profile_model(spec, "flops", nproc)
    forward, backward = report["total"]["forward"], report["total"]["backward"]
    rows = [[t, format_count(forward.get(t, 0)), format_count(backward.get(t, 0))]
            for t in sorted(set(forward) | set(backward),
                            key=lambda t: -(forward.get(t, 0) + backward.get(t, 0)))]
    check = ("every rank counted the same" if report["consistent"]
             else "RANKS DISAGREE: " + "; ".join(report["mismatches"]))
    print_table(["type", "forward FLOPs", "backward FLOPs"], rows, "<>>",
                 title=f"{spec}: FLOPs summed over {nproc} processes (DDP, gloo)",
                 footer=[["total", format_count(sum(forward.values())),
                          format_count(sum(backward.values()))]], notes=[check])
    print()
    return dict(report, model=spec, framework="pytorch")


def _print_flops(profiler, spec, framework, top, depth):
    """Two tables: FLOPs per module (tree, parameters, output shape) and per
    op type, in K/M/G units (exact counts are in flops.json)."""
    from amanda.tools.flops import format_count
    modules = profiler.modules(max_depth=depth)
    if modules:
        rows = [[("  " * m["depth"]) + (m["module"] or "model"), format_count(m["parameters"]),
                 "-" if m["output_shape"] is None else "x".join(map(str, m["output_shape"])),
                 format_count(m["forward"]), format_count(m["backward"])] for m in modules]
        print_table(["module", "parameters", "output shape", "forward FLOPs", "backward FLOPs"],
                     rows, "<>>>>", title=f"{spec} ({framework}): FLOPs per module")
        print()
    forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
    types = list(profiler.by_type())
    rows = [[t, format_count(forward.get(t, 0)), format_count(backward.get(t, 0))]
            for t in types[:top]]
    notes = [f"... {len(types) - top} more types"] if len(types) > top else []
    if profiler.unknown:
        notes.append("unknown op types (not counted): "
                     + ", ".join(f"{t} x{n}" for t, n in sorted(profiler.unknown.items())))
    print_table(["type", "forward FLOPs", "backward FLOPs"], rows, "<>>",
                 title=f"{spec} ({framework}): FLOPs per op type",
                 footer=[["total", format_count(profiler.total("forward")),
                          format_count(profiler.total("backward"))]], notes=notes)
    print(f"exact: forward {profiler.total('forward'):,}, backward "
          f"{profiler.total('backward'):,} FLOPs\n")


def add_flops_arguments(parser):
    parser.add_argument("models", nargs="+", metavar="MODEL", help=_model_help())
    parser.add_argument("--forward-only", action="store_true",
                        help="count forward ops only (the step still runs backward)")
    parser.add_argument("--top", type=_count(1), default=12, help="op types to show (default: 12)")
    parser.add_argument("--depth", type=_count(0), default=2,
                        help="module nesting levels in the per-module table (default: 2)")
    parser.add_argument("--nproc", type=_count(1), default=1,
                        help="PyTorch: run each model under DDP on N local processes (gloo, "
                             "127.0.0.1); FLOPs summed over ranks and checked equal")
    parser.add_argument("--chart", action="store_true",
                        help="also draw OUT/flops-MODEL.png (FLOPs by op type)")
    _add_out_argument(parser, "flops.json")


COMMAND = Command("flops",
    help="forward and backward FLOPs per op type and module",
    description="""\
Count the FLOPs of one training step with the FLOPs profiler
(amanda.tools.flops): a multiply-add is 2 FLOPs; convolutions and matrix
products also count their backward ops; op types without a formula are
listed, never silently zero. Works on PyTorch and TF (keras:...) models.
Writes OUT/flops.json (and OUT/flops-MODEL.png with --chart).""",
    example="amanda flops resnet50 keras:resnet50 --chart",
    add_arguments=add_flops_arguments, run=run_flops)
