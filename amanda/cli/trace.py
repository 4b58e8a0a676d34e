"""``amanda trace``: per-op wall time and a Chrome trace."""

from __future__ import annotations

import json
import os

from amanda.cli.common import (
    Command,
    _add_model_argument,
    _add_out_argument,
    _count,
    _jsonable,
    _load,
    _progress,
    _require,
    _write_json,
    require,
    staged,
)
from amanda.cli.table import print_table


def run_trace(args):
    require("trace", [args.model], *(["matplotlib"] if args.timeline else []))
    profiler_module = _require("amanda.tools.profiler", "trace", "the op profiler")
    if args.nproc > 1:
        return _run_trace_processes(args)
    work = _load(args.model, "trace")
    profiler = profiler_module.OpProfiler()
    kernels = args.kernels and work.framework == "pytorch"
    measured = profiler_module.profile_steps(
        profiler, work.run, args.steps, kernels,
        progress=lambda steps, total: _progress(steps, total, "profiling"))
    kernels = profiler.kernel_table(top=args.top) if kernels and args.steps > 1 else None
    print(f"{args.model}: {len(profiler.ops)} ops timed, {measured} step(s) measured, "
          f"forward {profiler.total_us('forward') / 1e3:.1f} ms, "
          f"backward {profiler.total_us('backward') / 1e3:.1f} ms\n")
    _print_profile(profiler, args.by, args.top)
    if kernels:
        print("\nkernels per op (torch.profiler):\n" + kernels)
    trace_path = os.path.join(args.out, "trace.json")
    profiler.save_chrome_trace(staged(trace_path))
    summary = {"model": args.model, "steps_measured": measured,
               "forward_us": profiler.total_us("forward"),
               "backward_us": profiler.total_us("backward"),
               "by_type": profiler.by_type(), "forward_by_type": profiler.by_type("forward"),
               "by_module": profiler.by_module(depth=3)}
    profile_path = _write_json(args.out, "profile.json", _jsonable(summary))
    written = [trace_path, profile_path]
    if args.timeline:
        timeline = os.path.join(args.out, "timeline.png")
        profiler.plot_timeline(staged(timeline), title=args.model)
        written.append(timeline)
    print(f"\nChrome trace (open in https://ui.perfetto.dev): {trace_path}")
    print("written: " + ", ".join(written[1:]))
    return 0


def _run_trace_processes(args):
    """``--nproc N``: the model under DDP on N local processes, one merged trace."""
    from amanda import distributed
    _load(args.model, "trace --nproc", ("pytorch",))
    result = distributed.profile_model(args.model, "trace", args.nproc, args.steps, args.kernels)
    rows = [[rank, s["steps_measured"], f"{s['forward_us'] / 1e3:.3f}",
             f"{s['backward_us'] / 1e3:.3f}"] for rank, s in enumerate(result["per_rank"])]
    print_table(["rank", "steps", "forward ms", "backward ms"], rows, ">>>>",
                 title=f"{args.model} on {args.nproc} processes (DDP, gloo)")
    path = os.path.join(args.out, "trace.json")
    with open(staged(path), "w") as f:
        json.dump(result["trace"], f)
    print(f"\nChrome trace, one process per rank (open in https://ui.perfetto.dev): {path}")
    return 0


def _print_profile(profiler, by, top):
    """The profiler's times by ``by`` as a table; AccumulateGrad nodes have
    their own row (``accumulate_grad``)."""
    rows = {"type": profiler.by_type, "name": profiler.by_name,
            "module": lambda: profiler.by_module(depth=3)}[by]()
    total = profiler.total_us() or 1.0
    labels = {"": "(model itself)", None: "(outside the model)"} if by == "module" else {}
    shown = [[labels.get(key, key), row["calls"], f"{row['forward_us'] / 1e3:.3f}",
              f"{row['backward_us'] / 1e3:.3f}", f"{row['total_us'] / 1e3:.3f}",
              f"{100 * row['total_us'] / total:.1f}%"] for key, row in rows.items()]
    notes = [f"... {len(shown) - top} more rows"] if len(shown) > top else []
    if by == "module":
        listed = {key for key in rows}
        notes += [text for key, text in (
            ("", "(model itself): ops run directly in the model's forward, in none of its "
                 "submodules (functional calls such as a reshape), and their backward ops"),
            (None, "(outside the model): ops run outside the model's forward (the loss "
                   "and the backward ops that start from it)")) if key in listed]
    footer = [["total", len(profiler.events), f"{profiler.total_us('forward') / 1e3:.3f}",
               f"{profiler.total_us('backward') / 1e3:.3f}", f"{total / 1e3:.3f}", "100.0%"]]
    print_table([by, "calls", "forward ms", "backward ms", "total ms", "%"], shown[:top],
                 "<>>>>>", footer=footer, notes=notes)


def add_trace_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--steps", type=_count(1), default=3,
                        help="training steps to run; the first (analysis) is not measured "
                             "when there are more (default: 3)")
    parser.add_argument("--by", choices=("type", "name", "module"), default="type",
                        help="aggregate the table by canonical op type, op name or module "
                             "path (default: type)")
    parser.add_argument("--top", type=_count(1), default=15, help="rows to show (default: 15)")
    parser.add_argument("--kernels", action="store_true",
                        help="PyTorch: run the last step under torch.profiler and list the "
                             "aten ops (CUDA kernels on a GPU) each op ran")
    parser.add_argument("--timeline", action="store_true", help="also draw OUT/timeline.png")
    parser.add_argument("--nproc", type=_count(1), default=1,
                        help="PyTorch: run the model under DDP on N local processes (gloo, "
                             "127.0.0.1) and merge their traces, one process per rank")
    _add_out_argument(parser, "trace.json (Chrome trace) and profile.json")


COMMAND = Command("trace",
    help="per-op wall time, forward and backward; Chrome trace for Perfetto",
    description="""\
Time every forward and backward op of a few training steps with the op
profiler (amanda.tools.profiler): a table aggregated by op type, op name or
module path, a Chrome trace (OUT/trace.json, opens in ui.perfetto.dev) and
OUT/profile.json. The first step runs the analysis and is not measured when
--steps > 1. --kernels (PyTorch) adds the aten ops / CUDA kernels of each op.""",
    example="amanda trace bert --by module --kernels",
    add_arguments=add_trace_arguments, run=run_trace)
