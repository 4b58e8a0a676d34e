"""The ``amanda`` command line.

Subcommands live in :data:`COMMANDS`, a table of :class:`Command` entries
(name, help, description, an example, ``add_arguments(parser)`` and
``run(args)``, which returns the exit status); adding one (``trace``,
``flops``, ``prune``...) is writing those two functions and adding an entry.

Example::

    amanda coverage bert resnet50 --out results/
    amanda demo
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import textwrap
import time
from typing import Callable

import amanda

DEFAULT_OUT = "amanda-out"


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        name: what the user types (``amanda <name>``).
        help: one line for ``amanda --help``.
        description: what it does, shown by ``amanda <name> --help``.
        example: an example command line, shown by both helps.
        add_arguments: ``add_arguments(parser)`` declares its arguments.
        run: ``run(args)`` does the work and returns the exit status.
    """

    name: str
    help: str
    description: str
    example: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A bad command line the parser could not catch (e.g. an unknown model)."""


# -- shared helpers ---------------------------------------------------------------------

def _model_help():
    from amanda import models
    names = ", ".join(models.available())
    return (f"built-in models: {names}; or path/to/file.py:factory where factory() "
            "returns (model, inputs)")


class _Workloads:
    """Loads each model spec once per command; checks them all up front so a
    typo fails before any model runs."""

    def __init__(self, *spec_lists):
        from amanda import models
        self._loaded = {}
        for specs in spec_lists:
            for spec in specs:
                try:
                    models.check(spec)
                except models.ModelSpecError as exc:
                    raise UsageError(str(exc)) from None

    def __call__(self, spec):
        from amanda import models
        if spec not in self._loaded:
            try:
                self._loaded[spec] = models.load(spec)
            except models.ModelSpecError as exc:
                raise UsageError(str(exc)) from None
        return self._loaded[spec]


def _write_json(out_dir, filename, data):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    return path


def _table(headers, rows, align):
    """Rows of cells as a ``|``-separated text table; ``align`` is one of
    ``<``/``>`` per column."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells):
        return " | ".join(f"{str(c):{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(row) for row in rows])


# -- coverage -----------------------------------------------------------------------------

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
    """The coverage reports as a text table with a legend."""
    rows = []
    for r in reports:
        hooks_backward = "error" if r["hooks_backward"] is None else r["hooks_backward"]
        rows.append([r["model"],
                     f"{r['amanda_forward']} / {r['hooks_forward']} ({r['hooks_forward_leaf']})",
                     f"{r['amanda_backward']} / {hooks_backward}",
                     _coverage_note(r)])
    table = _table(["model", "forward points amanda / hooks (leaf)",
                    "backward points amanda / hooks", "note"], rows, "<>><")
    errors = "".join(f"\n{r['model']}: full backward hooks raise "
                     f"{_first_sentence(r['hooks_error'])}." for r in reports if r["hooks_error"])
    legend = textwrap.dedent("""\
        amanda: a point per op call and per autograd node (gradient accumulators
        included), loss included. hooks: forward hook calls on every module, containers
        included (leaf: on modules without children, the ones that can stand for an
        op); backward: full backward hook calls. "hooks miss": forward ops run
        directly in a module with children, so no module hook corresponds to them;
        "share a module hook": ops of a leaf module that runs several
        (see amanda/tools/coverage.py).""")
    return table + errors + "\n\n" + legend


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
    reports = _run_coverage(args.models, _Workloads(args.models), _stderr)
    print(coverage_table(reports))
    path = _write_json(args.out, "coverage.json", reports)
    print(f"\nfull report: {path}")
    return 0


def add_coverage_arguments(parser):
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        default=list(DEFAULT_COVERAGE_MODELS),
                        help=f"{_model_help()} (default: {' '.join(DEFAULT_COVERAGE_MODELS)})")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"where to write coverage.json (default: {DEFAULT_OUT}/)")


# -- demo ----------------------------------------------------------------------------------

class CountOPTool(amanda.Tool):
    """The tutorial's counting tool: count calls of forward ops whose name
    contains one of ``op_names`` and of backward ops whose name contains one
    of ``backward_op_names``."""

    def __init__(self, op_names, backward_op_names):
        super().__init__()
        self.counters = dict.fromkeys(op_names, 0)
        self.backward_counters = dict.fromkeys(backward_op_names, 0)
        self.add_inst_for_op(self.callback)
        self.add_inst_for_op(self.backward_callback, backward=True, require_outputs=True)

    # analysis routines: pick the ops, insert a counting routine
    def callback(self, context):
        for name in self.counters:
            if name in context.get_op().__name__:
                context.insert_before_op(self.counter_op, name=name)

    def backward_callback(self, context):
        for name in self.backward_counters:
            if name in context.get_backward_op().__name__:
                context.insert_after_backward_op(self.counter_backward_op, name=name)

    # instrumentation routines: run every time the op runs
    def counter_op(self, *inputs, name):
        self.counters[name] += 1

    def counter_backward_op(self, *grads, name):
        self.backward_counters[name] += 1


DEMO_COUNT_MODELS = ("cnn", "bert")
DEMO_COVERAGE_MODELS = ("bert", "resnet50")
DEMO_OPS = ("conv2d", "linear")
DEMO_BACKWARD_OPS = ("Convolution", "Addmm")


def _run_counter(specs, workloads):
    rows, results = [], []
    for spec in specs:
        work = workloads(spec)
        tool = CountOPTool(DEMO_OPS, DEMO_BACKWARD_OPS)
        with amanda.apply(tool):
            work.run()
        results.append({"model": spec, "forward": tool.counters,
                        "backward": tool.backward_counters})
        rows.append([spec, *tool.counters.values(), *tool.backward_counters.values()])
    headers = ["model", *DEMO_OPS, *(f"{n}*Backward" for n in DEMO_BACKWARD_OPS)]
    return _table(headers, rows, "<" + ">" * (len(headers) - 1)), results


def run_demo(args):
    count_models = args.models or DEMO_COUNT_MODELS
    coverage_models = args.models or DEMO_COVERAGE_MODELS
    workloads = _Workloads(count_models, coverage_models)
    start = time.perf_counter()

    print("amanda demo: one tool, every op, forward and backward\n")
    print("1. The tutorial's counting tool, applied unchanged to each model:\n")
    print(textwrap.indent(_count_tool_listing(), "    "))
    table, counts = _run_counter(count_models, workloads)
    print(textwrap.indent(table, "    "))
    if "bert" in count_models:
        print("\n    The loss is last_hidden_state.sum(): BERT's pooler (one linear) gets no")
        print("    gradient, so 73 linear ops run forward and 72 Addmm backward.")

    print("\n2. Instrumentation points: amanda vs PyTorch module hooks (paper Fig. 9)\n")
    reports = _run_coverage(coverage_models, workloads, _stderr)
    print(textwrap.indent(coverage_table(reports), "    "))

    path = _write_json(args.out, "demo.json", {"count": counts, "coverage": reports})
    print(f"\nfull report: {path} ({time.perf_counter() - start:.0f} s)")
    return 0


def add_demo_arguments(parser):
    parser.add_argument("--models", nargs="+", metavar="MODEL",
                        help=f"run both parts on these models instead "
                             f"(default: count on {' '.join(DEMO_COUNT_MODELS)}, coverage "
                             f"on {' '.join(DEMO_COVERAGE_MODELS)}); {_model_help()}")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"where to write demo.json (default: {DEFAULT_OUT}/)")


def _count_tool_listing():
    return (inspect.getsource(CountOPTool) + "\n"
            + f"with amanda.apply(CountOPTool({list(DEMO_OPS)}, {list(DEMO_BACKWARD_OPS)})):\n"
            + "    model(x).sum().backward()\n")


# -- models --------------------------------------------------------------------------------

def run_models(args):
    from amanda import models
    rows = [[name, description] for name, description in models.available().items()]
    print(_table(["model", "description"], rows, "<<"))
    return 0


COMMANDS = {c.name: c for c in [
    Command("coverage",
            help="count instrumentation points: amanda vs PyTorch module hooks",
            description="""\
Run one training step (forward, scalar loss, backward) of each model twice:
once under amanda with a tool counting every forward and backward
instrumentation point, once with forward and full backward hooks on every
module. Prints a table (the paper's Fig. 9) and writes the full report
(points by op name, the ops module hooks miss) to OUT/coverage.json.""",
            example="amanda coverage bert resnet50 --out results/",
            add_arguments=add_coverage_arguments, run=run_coverage),
    Command("demo",
            help="showcase: the tutorial's counting tool, then coverage vs module hooks",
            description="""\
1. Apply the tutorial's CountOPTool (count conv2d / linear forward calls and
   Convolution / Addmm backward calls by op name, on any model, without
   touching its source) to the tutorial CNN and BERT.
2. Compare the instrumentation points amanda offers with those of PyTorch
   module hooks on BERT and ResNet-50 (as `amanda coverage`).
Writes OUT/demo.json. --models runs both parts on other models.""",
            example="amanda demo --models cnn gpt2-small",
            add_arguments=add_demo_arguments, run=run_demo),
    Command("models",
            help="list the built-in models",
            description="""\
List the built-in models every subcommand accepts. Subcommands also take
path/to/file.py:factory, where factory() returns (model, inputs).""",
            example="amanda models",
            add_arguments=lambda parser: None, run=run_models),
]}
"""Subcommands by name, in ``--help`` order."""


# -- entry point ---------------------------------------------------------------------------

def _stderr(message):
    sys.stdout.flush()  # keep progress lines in order with the output
    print(message, file=sys.stderr, flush=True)


def build_parser():
    """The argument parser with every registered subcommand."""
    examples = "\n".join(f"  {c.example}" for c in COMMANDS.values())
    parser = argparse.ArgumentParser(
        prog="amanda",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            amanda instruments deep neural networks at every op: write a tool once
            (analysis routines that pick ops, instrumentation routines that run there)
            and apply it to any model, forward and backward, with
            `with amanda.apply(tool): ...`. This command runs ready-made tools on
            built-in or your own models."""),
        epilog="examples:\n" + examples
               + "\n\nrun `amanda COMMAND --help` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"amanda {amanda.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.help, description=c.description,
                           epilog=f"example:\n  {c.example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_arguments(p)
        p.set_defaults(run=c.run)
    return parser


def main(argv=None):
    """Run the ``amanda`` command line; returns the exit status.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"amanda {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
