"""``amanda coverage``: instrumentation points, amanda vs PyTorch module hooks."""

from __future__ import annotations

import textwrap
import time

from amanda.cli.common import (
    DEFAULT_OUT,
    Command,
    _model_help,
    _pytorch_only,
    _stderr,
    _Workloads,
    _write_json,
    require,
)
from amanda.cli.table import Table, print_table_object


DEFAULT_COVERAGE_MODELS = ("bert", "resnet50", "gpt2")


def _top(counts, n=3):
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{name} {count}" for name, count in items[:n])
    return text + (", ..." if len(items) > n else "")


def _first_sentence(message):
    return message.split(". ")[0].rstrip(".")


def _coverage_note(report):
    notes = []
    missed = report["missed_by_hooks"]
    if missed:
        notes.append(f"hooks miss {sum(missed.values())}: {_top(missed)}")
    partial = report["partially_covered"]
    if partial:
        notes.append(f"{sum(partial.values())} share a module hook: {_top(partial)}")
    if report["hooks_error"]:
        notes.append("full backward hooks raise (below)")
    return "; ".join(notes) or "-"


def coverage_table(reports):
    """The coverage reports as a :class:`~amanda.cli.table.Table` with a legend."""
    rows = []
    for r in reports:
        hooks_backward = "error" if r["hooks_backward"] is None else r["hooks_backward"]
        rows.append([r["model"],
                     f"{r['amanda_forward']} / {r['hooks_forward']} ({r['hooks_forward_leaf']})",
                     f"{r['amanda_backward']} / {hooks_backward}",
                     _coverage_note(r)])
    errors = [f"{r['model']}: full backward hooks raise {_first_sentence(r['hooks_error'])}."
              for r in reports if r["hooks_error"]]
    # the legend explains what the table shows, and only that
    parts = ["amanda: a point per op call and per autograd node (gradient accumulators "
             "included), loss included. hooks: forward hook calls on every module, "
             "containers included (leaf: on modules without children, the ones that can "
             "stand for an op); backward: full backward hook calls."]
    if any(r["missed_by_hooks"] for r in reports):
        parts.append('"hooks miss": forward ops run directly in a module with children, so '
                     "no module hook corresponds to them.")
    if any(r["partially_covered"] for r in reports):
        parts.append('"share a module hook": ops of a leaf module that runs several, so one '
                     "hook call stands for them all.")
    parts.append("See amanda/tools/coverage.py.")
    legend = textwrap.fill(" ".join(parts), width=84)
    return Table(["model", "forward points amanda / hooks (leaf)",
                  "backward points amanda / hooks", "note"], rows, "<>><",
                 notes=errors + ["", legend])


def _run_coverage(specs, workloads, log):
    from amanda.tools.coverage import compare_coverage
    reports = []
    for spec in specs:
        start = time.perf_counter()
        work = workloads(spec)
        reports.append(compare_coverage(work))
        log(f"  {spec}: done in {time.perf_counter() - start:.1f} s")
    return reports


def run_coverage(args):
    require("coverage", args.models)
    _pytorch_only(args.models, "coverage", "it compares amanda with PyTorch module hooks")
    reports = _run_coverage(args.models, _Workloads(args.models), _stderr)
    print_table_object(coverage_table(reports))
    path = _write_json(args.out, "coverage.json", reports)
    print(f"\nfull report: {path}")
    return 0


def add_coverage_arguments(parser):
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        default=list(DEFAULT_COVERAGE_MODELS),
                        help=f"{_model_help()} (default: {' '.join(DEFAULT_COVERAGE_MODELS)})")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"where to write coverage.json (default: {DEFAULT_OUT}/)")


COMMAND = Command("coverage",
    help="count instrumentation points: amanda vs PyTorch module hooks",
    description="""\
Run one training step (forward, scalar loss, backward) of each model twice:
once under amanda with a tool counting every forward and backward
instrumentation point, once with forward and full backward hooks on every
module. Prints a table (the paper's Fig. 9) and writes the full report
(points by op name, the ops module hooks miss) to OUT/coverage.json.""",
    example="amanda coverage bert resnet50 --out results/",
    add_arguments=add_coverage_arguments, run=run_coverage)
