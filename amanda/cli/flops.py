"""``amanda flops``: forward and backward FLOPs per op type and module."""

from __future__ import annotations

import collections
import os
import re

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
    """Forward and backward FLOPs of the top op types as paired bars on a log
    axis, each labelled with its count (``?``: no formula; ``-``: no backward
    ran), so that the small types stay readable beside convolutions."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from amanda.tools.flops import format_count
    forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
    unknown = {p: profiler.unknown_types(p) for p in ("forward", "backward")}
    ran = profiler.ran("backward")
    types = (list(profiler.by_type()) + sorted(set(unknown["forward"]) | set(unknown["backward"])
                                                - set(profiler.by_type())))[:top]
    figure, axes = plt.subplots(figsize=(8, 0.6 * len(types) + 1.4))
    height = 0.38
    largest = max([1, *forward.values(), *backward.values()])
    for offset, phase, counts, colour in ((-height / 2, "forward", forward, "#4c78a8"),
                                          (height / 2, "backward", backward, "#f58518")):
        values = [counts.get(t, 0) for t in types]
        positions = [i + offset for i in range(len(types))]
        axes.barh(positions, [max(v, 0.8) for v in values], height=height, color=colour,
                  label=phase, log=True)
        for y, t, v in zip(positions, types, values):
            label = _cell(v, t in unknown[phase], phase == "forward" or t in ran)
            axes.text(max(v, 0.8) * 1.15, y, label, va="center", fontsize=8)
    axes.set_yticks(range(len(types)), types)
    axes.invert_yaxis()
    axes.set_xlim(0.8, largest * 20)
    axes.set_xlabel("FLOPs per training step (log scale)")
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
        profiler = FlopsProfiler(backward=not args.forward_only, other_backward=True)
        with amanda.apply(profiler):
            work.run()
        forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
        _print_flops(profiler, spec, work.framework, args.top, args.depth, work,
                     collapse=not args.no_collapse)
        unknown = {"forward": profiler.unknown_types("forward"),
                   "backward": profiler.unknown_types("backward")}
        by_type = {t: {"forward": forward.get(t, 0), "backward": backward.get(t, 0)}
                   for t in profiler.by_type()}
        for phase, table in unknown.items():
            for t in table:     # null: not counted (no formula), never 0
                by_type.setdefault(t, {"forward": forward.get(t, 0),
                                       "backward": backward.get(t, 0)})[phase] = None
        result = {"model": spec, "framework": work.framework,
                  "forward": profiler.total("forward"), "backward": profiler.total("backward"),
                  "by_type": by_type, "by_module": profiler.by_module(),
                  "modules": _module_rows(profiler, work, None, False),
                  "unknown": unknown, "unknown_labels": dict(profiler.unknown)}
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


def _cell(value, unknown=False, ran=True):
    """A FLOPs count as printed: ``?`` where ops without a formula ran (with
    ``+?`` when others were counted), ``-`` where nothing ran in that phase,
    else the count in K/M/G units (0 only where the arithmetic is none)."""
    from amanda.tools.flops import format_count
    if unknown:
        return "?" if value == 0 else f"{format_count(value)}+?"
    if value == 0 and not ran:
        return "-"
    return format_count(value)


def _module_info(work):
    """PyTorch: module path -> (class name, parameters, trainable parameters),
    from the model itself (every parameter, read by an op or not)."""
    model = getattr(work, "model", None)
    named = getattr(model, "named_modules", None)
    if work.framework != "pytorch" or named is None:
        return {}
    info = {}
    for path, module in named():
        params = list(module.parameters())
        info[path] = (type(module).__name__, sum(p.numel() for p in params),
                      sum(p.numel() for p in params if p.requires_grad))
    return info


_INDEX = re.compile(r"^\d+$")


def _collapse_repeats(rows, info):
    """Merge repeated sibling blocks (``encoder.layer.0`` ... ``.11`` of one
    class) and their descendants into one row each (``encoder.layer.0-11``),
    summing their counts and parameters; ``count`` says how many merged."""
    children = collections.defaultdict(list)
    for row in rows:
        parent, _, last = row["module"].rpartition(".")
        if _INDEX.match(last):
            children[parent].append(row["module"])
    ranges = {}
    for parent, paths in children.items():
        kinds = {info.get(p, ("?",))[0] for p in paths}
        if len(paths) > 1 and len(kinds) == 1:
            numbers = sorted(int(p.rpartition(".")[2]) for p in paths)
            ranges[parent] = f"{numbers[0]}-{numbers[-1]}"
    if not ranges:
        return [dict(r, count=1) for r in rows]
    merged = {}
    for row in rows:
        parts = row["module"].split(".") if row["module"] else []
        for i in range(len(parts)):
            if _INDEX.match(parts[i]) and ".".join(parts[:i]) in ranges:
                parts[i] = ranges[".".join(parts[:i])]
        key = ".".join(parts)
        if key not in merged:
            merged[key] = dict(row, module=key, count=1, first=row["module"])
            continue
        into = merged[key]
        into["count"] += 1
        for field in ("forward", "backward", "parameters", "total_parameters", "trainable"):
            into[field] += row[field]
        for field in ("forward_unknown", "backward_unknown", "forward_ran", "backward_ran"):
            into[field] = into[field] or row[field]
    return list(merged.values())


def _module_rows(profiler, work, depth, collapse):
    """Rows of the per-module table (dicts), repeated blocks merged."""
    info = _module_info(work)
    rows = []
    for row in profiler.modules(max_depth=depth):
        kind, total, trainable = info.get(row["module"], ("-", row["parameters"],
                                                          row["parameters"]))
        rows.append(dict(row, type=kind, total_parameters=total, trainable=trainable))
    return _collapse_repeats(rows, info) if collapse else [dict(r, count=1) for r in rows]


def _print_flops(profiler, spec, framework, top, depth, work=None, collapse=True):
    """Two tables: FLOPs per module (tree, layer type, parameters, output
    shape, share of the total) and per op type, in K/M/G units (exact counts
    are in flops.json). Every cell is a count, ``?`` (no formula) or ``-``
    (did not run in that phase)."""
    from amanda.tools.flops import format_count
    grand = profiler.total() or 1
    rows = _module_rows(profiler, work, depth, collapse) if work is not None else []
    if rows:
        cells = []
        dash = False
        for m in rows:
            name = ("  " * m["depth"]) + (m["module"] or "model")
            kind = m["type"] + (f" x{m['count']}" if m["count"] > 1 else "")
            cells.append([name, kind, format_count(m["total_parameters"]),
                          format_count(m["trainable"]),
                          "-" if m["output_shape"] is None
                          else "x".join(map(str, m["output_shape"])),
                          _cell(m["forward"], m["forward_unknown"]),
                          _cell(m["backward"], m["backward_unknown"], m["backward_ran"]),
                          f"{100 * (m['forward'] + m['backward']) / grand:.1f}%"])
            dash = dash or cells[-1][6] == "-"
        notes = [f"depth {depth} (--depth); repeated blocks of one class are one row "
                 "(N-M, xCOUNT: their sums; --no-collapse lists them)"] if collapse and any(
                     m["count"] > 1 for m in rows) else []
        if dash:
            notes.append("- = no backward arithmetic ran (no gradient reaches it, or its "
                         "ops only move data)")
        print_table(["module", "type", "params", "trainable", "output shape",
                     "forward FLOPs", "backward FLOPs", "% FLOPs"], cells, "<<>>>>>>",
                    title=f"{spec} ({framework}): FLOPs per module (forward + backward of "
                          "one training step)", notes=notes)
        print()
    forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
    unknown_f, unknown_b = profiler.unknown_types("forward"), profiler.unknown_types("backward")
    ran_b = profiler.ran("backward")
    types = list(profiler.by_type()) + sorted((set(unknown_f) | set(unknown_b))
                                              - set(profiler.by_type()))
    cells = [[t, _cell(forward.get(t, 0), t in unknown_f),
              _cell(backward.get(t, 0), t in unknown_b, t in ran_b),
              f"{100 * (forward.get(t, 0) + backward.get(t, 0)) / grand:.1f}%"]
             for t in types]
    notes = [f"... {len(types) - top} more types (flops.json has all)"] if len(types) > top \
        else []
    if unknown_f or unknown_b:
        listed = [f"{phase}: " + ", ".join(f"{t} x{n}" for t, n in table.items())
                  for phase, table in (("forward", unknown_f), ("backward", unknown_b)) if table]
        notes.append("? = no FLOP formula, not in the totals (" + "; ".join(listed) + ")")
    if any("-" in row[1:3] for row in cells[:top]):
        notes.append("- = no backward arithmetic ran (no gradient reaches it, or its ops "
                     "only move data)")
    print_table(["type", "forward FLOPs", "backward FLOPs", "% FLOPs"], cells[:top], "<>>>",
                 title=f"{spec} ({framework}): FLOPs per op type",
                 footer=[["total", _cell(profiler.total("forward"), bool(unknown_f)),
                          _cell(profiler.total("backward"), bool(unknown_b)), "100.0%"]],
                 notes=notes)
    print(f"exact: forward {profiler.total('forward'):,}, backward "
          f"{profiler.total('backward'):,} FLOPs\n")


def add_flops_arguments(parser):
    parser.add_argument("models", nargs="+", metavar="MODEL", help=_model_help())
    parser.add_argument("--forward-only", action="store_true",
                        help="count forward ops only (the step still runs backward)")
    parser.add_argument("--top", type=_count(1), default=12, help="op types to show (default: 12)")
    parser.add_argument("--depth", type=_count(0), default=4,
                        help="module nesting levels in the per-module table (default: 4: "
                             "a transformer's blocks and their attention and MLP)")
    parser.add_argument("--no-collapse", action="store_true",
                        help="list every repeated block (default: blocks of one class "
                             "numbered 0..N under one parent are one row, summed)")
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
