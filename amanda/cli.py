"""The ``amanda`` command line.

Subcommands live in :data:`COMMANDS`, a table of :class:`Command` entries
(name, help, description, an example, ``add_arguments(parser)`` and
``run(args)``, which returns the exit status); adding one is writing those
two functions and adding an entry. Each runs a built-in tool on a model spec
of :mod:`amanda.models` (built-in names, ``keras:NAME``, ``*.onnx``,
``file.py:factory``), prints a table (rich on a terminal, plain text
otherwise) and writes its results to ``--out`` (default ``amanda-out/``).
A subcommand whose tool module is missing fails with :class:`MissingPiece`
naming it. See ``docs/cli.md``.

Example::

    amanda flops resnet50 keras:resnet50 --chart
    amanda quantize cnn --weight-bits 4 --qat 20 --export cnn-qdq.onnx
    amanda demo
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable

import amanda
from amanda.cli_table import Table, print_table, print_table_object, use_rich

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
    return (f"a built-in PyTorch model ({names}); keras:NAME[:SIZE], a Keras model in a "
            "TF graph (keras:cnn, keras:resnet50, keras:mobilenetv2:96); "
            "path/to/model.onnx, run in onnxruntime; or path/to/file.py:factory, where "
            "factory() returns (model, inputs) of a PyTorch model (the file imports like a "
            "script: its folder is on sys.path). `amanda models` lists them")


def _count(minimum, what="an integer"):
    """An argparse type: an int >= ``minimum``, else a clear usage error."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def _fraction(text):
    """An argparse type: a float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _bits(text):
    """An argparse type: 0 (leave in float) or 2..16 bits."""
    value = _count(0)(text)
    if value == 1 or value > 16:
        raise argparse.ArgumentTypeError(f"must be 0 (float) or 2 to 16 bits, got {value}")
    return value


def _pytorch_only(specs, command, why):
    """Reject Keras and ONNX specs before anything runs."""
    for spec in specs:
        if spec.startswith("keras:") or spec.endswith(".onnx"):
            kind = "a TensorFlow" if spec.startswith("keras:") else "an ONNX"
            raise UsageError(f"{spec} is {kind} model; `amanda {command}` is PyTorch-only "
                             f"({why})")


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
    """The coverage reports as a :class:`~amanda.cli_table.Table` with a legend."""
    rows = []
    for r in reports:
        hooks_backward = "error" if r["hooks_backward"] is None else r["hooks_backward"]
        rows.append([r["model"],
                     f"{r['amanda_forward']} / {r['hooks_forward']} ({r['hooks_forward_leaf']})",
                     f"{r['amanda_backward']} / {hooks_backward}",
                     _coverage_note(r)])
    errors = [f"{r['model']}: full backward hooks raise {_first_sentence(r['hooks_error'])}."
              for r in reports if r["hooks_error"]]
    legend = textwrap.dedent("""\
        amanda: a point per op call and per autograd node (gradient accumulators
        included), loss included. hooks: forward hook calls on every module, containers
        included (leaf: on modules without children, the ones that can stand for an
        op); backward: full backward hook calls. "hooks miss": forward ops run
        directly in a module with children, so no module hook corresponds to them;
        "share a module hook": ops of a leaf module that runs several
        (see amanda/tools/coverage.py).""")
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
    return Table(headers, rows), results


def run_demo(args):
    count_models = args.models or DEMO_COUNT_MODELS
    coverage_models = args.models or DEMO_COVERAGE_MODELS
    _pytorch_only(count_models, "demo", "its coverage part compares with module hooks")
    workloads = _Workloads(count_models, coverage_models)
    start = time.perf_counter()

    print("amanda demo: one tool, every op, forward and backward\n")
    print("1. The tutorial's counting tool, applied unchanged to each model:\n")
    print(textwrap.indent(_count_tool_listing(), "    "))
    table, counts = _run_counter(count_models, workloads)
    print_table_object(table, indent=4)
    if "bert" in count_models:
        print("\n    The loss is last_hidden_state.sum(): BERT's pooler (one linear) gets no")
        print("    gradient, so 73 linear ops run forward and 72 Addmm backward.")

    print("\n2. Instrumentation points: amanda vs PyTorch module hooks (paper Fig. 9)\n")
    reports = _run_coverage(coverage_models, workloads, _stderr)
    print_table_object(coverage_table(reports), indent=4)

    tools_model = (args.models or [DEMO_TOOLS_MODEL])[0]
    print(f"\n3. More built-in tools, on {tools_model} (each is an `amanda` command):\n")
    tools = _demo_tools(tools_model, workloads)

    path = _write_json(args.out, "demo.json", {"count": counts, "coverage": reports,
                                               "tools": _jsonable(tools)})
    print(f"\nfull report: {path} ({time.perf_counter() - start:.0f} s)")
    return 0


DEMO_TOOLS_MODEL = "cnn"


def _demo_tools(spec, workloads):
    """FLOPs, 8-bit quantization and a planted NaN on one model, briefly."""
    from amanda.tools.debugging import NanDetector
    from amanda.tools.flops import FlopsProfiler
    from amanda.tools.quantization import QuantizationTool
    work = workloads(spec)
    results = {"model": spec}

    flops = FlopsProfiler()
    with amanda.apply(flops):
        work.run()
    top = ", ".join(f"{t} {f / 1e6:,.1f}M" for t, f in list(flops.by_type("forward").items())[:3])
    results["flops"] = {"forward": flops.total("forward"), "backward": flops.total("backward")}
    print(f"    amanda flops {spec}:      forward {flops.total('forward') / 1e6:,.1f} MFLOPs "
          f"({top}), backward {flops.total('backward') / 1e6:,.1f} MFLOPs")

    quantization = QuantizationTool()
    reference = work.forward()
    with amanda.apply(quantization.calibration()):
        work.forward()
    quantization.freeze()
    with amanda.apply(quantization):
        quantized = work.forward()
    error = _relative_error(reference, quantized)
    results["quantize"] = {"ops": len(quantization.ops), "relative_error": error}
    print(f"    amanda quantize {spec}:   {len(quantization.ops)} ops fake-quantized to 8 bits "
          f"(per-channel weights), output relative error {error:.4f}")

    plant, detector = _PlantNaN("conv2d", 2), NanDetector()
    with amanda.apply(plant, detector):
        work.run()
    report = detector.report
    results["nan_check"] = dataclasses.asdict(report) if report else None
    where = (f"{report.op_name} in module {report.module_path!r}" if report else "nothing")
    print(f"    amanda nan-check {spec} --plant conv2d:2:  first NaN found at {where}")
    print("\n    More: amanda trace | prune | diff | graph (amanda --help)")
    return results


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


# -- shared helpers for the tool commands ---------------------------------------------------

class MissingPiece(UsageError):
    """A subcommand needs a module that is not in this installation."""


# The extra of pyproject.toml that installs each optional top-level module;
# "" for the core dependencies (a broken install: reinstall amanda).
EXTRA_OF_MODULE = {
    "torch": "torch", "transformers": "torch",
    "tensorflow": "tensorflow", "keras": "tensorflow",
    "onnx": "onnx", "onnxruntime": "onnx", "onnxruntime_extensions": "onnx",
    "onnxscript": "onnx", "tf2onnx": "onnx",
    "matplotlib": "viz", "networkx": "viz",
    "numpy": "", "rich": "",
}


def missing_extra_message(command, error):
    """One line naming the command, the missing module and the ``pip install``
    that brings it, or None when ``error`` is not about an optional module."""
    module = (getattr(error, "name", None) or "").partition(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    target = f"'amanda[{extra}]'" if extra else "amanda"
    return (f"amanda {command}: needs {module}, which is not installed; "
            f"pip install {target}")


def _require(module, command, what):
    """Import ``module`` or fail naming the missing piece."""
    import importlib
    import importlib.util
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        raise MissingPiece(f"`amanda {command}` needs {what} ({module}), which is not "
                           "installed in this tree")
    return importlib.import_module(module)


def _load(spec, command, frameworks=("pytorch", "tensorflow", "onnx")):
    """Load one model spec, checking the command supports its framework."""
    workload = _Workloads([spec])(spec)
    if workload.framework not in frameworks:
        raise UsageError(f"`amanda {command}` works on {' and '.join(frameworks)} models; "
                         f"{spec} is a {workload.framework} model")
    return workload


# every command prints its tables through amanda.cli_table (rich on a terminal)
_print_table = print_table


def _progress(iterable, total, label):
    """Iterate with a progress bar on a terminal (rich, on stderr); plain
    iteration otherwise."""
    if total <= 1 or not use_rich(sys.stderr):
        yield from iterable
        return
    from rich.console import Console
    from rich.progress import track
    yield from track(iterable, total=total, description=label, transient=True,
                     console=Console(stderr=True))


def _safe_name(spec):
    """A file-name-safe form of a model spec (``keras:resnet50`` -> ``keras-resnet50``)."""
    base = os.path.basename(spec) if os.sep in spec else spec
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in base).strip("-") or "model"


def _add_model_argument(parser):
    parser.add_argument("model", metavar="MODEL", help=_model_help())


def _add_out_argument(parser, files):
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"where to write {files} (default: {DEFAULT_OUT}/)")


def _relative_error(reference, value):
    import numpy as np
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    norm = float(np.linalg.norm(reference))
    return float(np.linalg.norm(value - reference)) / norm if norm else float(np.abs(value).max())


def _sqnr_db(reference, value):
    import numpy as np
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    noise = float(((value - reference) ** 2).sum())
    return float("inf") if noise == 0 else 10 * float(np.log10((reference ** 2).sum() / noise))


def _jsonable(value):
    """Tuples, NumPy values and other objects as JSON-friendly values."""
    import numpy as np
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# -- trace ----------------------------------------------------------------------------------

def run_trace(args):
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
    os.makedirs(args.out, exist_ok=True)
    trace_path = os.path.join(args.out, "trace.json")
    profiler.save_chrome_trace(trace_path)
    summary = {"model": args.model, "steps_measured": measured,
               "forward_us": profiler.total_us("forward"),
               "backward_us": profiler.total_us("backward"),
               "by_type": profiler.by_type(), "forward_by_type": profiler.by_type("forward"),
               "by_module": profiler.by_module(depth=3)}
    profile_path = _write_json(args.out, "profile.json", _jsonable(summary))
    written = [trace_path, profile_path]
    if args.timeline:
        written.append(profiler.plot_timeline(os.path.join(args.out, "timeline.png"),
                                              title=args.model) or
                       os.path.join(args.out, "timeline.png"))
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
    _print_table(["rank", "steps", "forward ms", "backward ms"], rows, ">>>>",
                 title=f"{args.model} on {args.nproc} processes (DDP, gloo)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "trace.json")
    with open(path, "w") as f:
        json.dump(result["trace"], f)
    print(f"\nChrome trace, one process per rank (open in https://ui.perfetto.dev): {path}")
    return 0


def _print_profile(profiler, by, top):
    """The profiler's times by ``by`` as a table; AccumulateGrad nodes have
    their own row (``accumulate_grad``)."""
    rows = {"type": profiler.by_type, "name": profiler.by_name,
            "module": lambda: profiler.by_module(depth=3)}[by]()
    total = profiler.total_us() or 1.0
    shown = [[("(root)" if key == "" else key), row["calls"], f"{row['forward_us'] / 1e3:.3f}",
              f"{row['backward_us'] / 1e3:.3f}", f"{row['total_us'] / 1e3:.3f}",
              f"{100 * row['total_us'] / total:.1f}%"] for key, row in rows.items()]
    notes = [f"... {len(shown) - top} more rows"] if len(shown) > top else []
    footer = [["total", len(profiler.events), f"{profiler.total_us('forward') / 1e3:.3f}",
               f"{profiler.total_us('backward') / 1e3:.3f}", f"{total / 1e3:.3f}", "100.0%"]]
    _print_table([by, "calls", "forward ms", "backward ms", "total ms", "%"], shown[:top],
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


# -- flops ----------------------------------------------------------------------------------

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
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def run_flops(args):
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
            os.makedirs(args.out, exist_ok=True)
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
    _print_table(["type", "forward FLOPs", "backward FLOPs"], rows, "<>>",
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
        _print_table(["module", "parameters", "output shape", "forward FLOPs", "backward FLOPs"],
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
    _print_table(["type", "forward FLOPs", "backward FLOPs"], rows, "<>>",
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


# -- prune ----------------------------------------------------------------------------------

def run_prune(args):
    pruning = _require("amanda.tools.pruning", "prune", "the pruning tool")
    work = _load(args.model, "prune", ("pytorch", "tensorflow"))
    pruner = pruning.Pruner(args.pattern, sparsity=args.sparsity)
    dense = work.forward()
    with amanda.apply(pruner):
        work.run()
        pruned = work.forward()
    _print_pruning(pruner, args.model)
    change = _relative_error(dense, pruned)
    print(f"\noutput change (relative L2): {change:.4f}")
    report = pruner.report()
    path = _write_json(args.out, "pruning.json", _jsonable({
        "model": args.model, "pattern": pruner.pattern_name, "sparsity": args.sparsity,
        "output_relative_change": change, **report}))
    print(f"full report: {path}")
    return 0


def _print_pruning(pruner, spec):
    report = pruner.report()
    mask = ("static mask" if pruner.update_every is None
            else f"mask recomputed every {pruner.update_every} executions")
    rows = [[r["module"] or r["op_id"], r["type"], r["shape"], f"{r['pruned']:,}",
             f"{r['sparsity']:.1%}"] for r in report["layers"]]
    total = report["total"]
    print_table(["layer", "type", "shape", "pruned", "sparsity"], rows, "<<<>>",
                title=f"{spec}: pattern {pruner.pattern_name}, {mask}",
                footer=[["total", "", "", f"{total['pruned']:,}", f"{total['sparsity']:.1%}"]],
                notes=[f"skipped {s['module'] or s['op_id']}: {s['reason']}"
                       for s in report["skipped"]])


def add_prune_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--pattern", default="unstructured",
                        help="unstructured (magnitude), channel (L1 of output channels) or "
                             "N:M such as 2:4 (default: unstructured)")
    parser.add_argument("--sparsity", type=_fraction, default=0.5,
                        help="fraction of weights (channels) to prune; N:M ignores it "
                             "(default: 0.5)")
    _add_out_argument(parser, "pruning.json")


# -- quantize -------------------------------------------------------------------------------

def _calibration_batches(work, count):
    """The workload's inputs, then ``count - 1`` random variants of its
    floating-point inputs (integer inputs such as token ids are reused)."""
    import numpy as np
    rng = np.random.RandomState(1)
    batches = [work.inputs]
    for _ in range(count - 1):
        batch = []
        for value in work.inputs:
            if hasattr(value, "is_floating_point") and value.is_floating_point():
                import torch
                batch.append(torch.from_numpy(rng.rand(*value.shape).astype(np.float32))
                             .to(value.dtype))
            elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
                batch.append(rng.rand(*value.shape).astype(value.dtype))
            else:
                batch.append(value)
        batches.append(tuple(batch))
    return batches


def _qat_steps(work, tool, reference, steps, lr):
    """Fine-tune the quantized PyTorch model towards the float model's
    outputs (mean squared error): the loss QAT lowers."""
    import torch

    from amanda.models import first_tensor
    parameters = [p for p in work.model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=lr)
    target = torch.as_tensor(reference)
    losses = []
    with amanda.apply(tool):
        for _ in _progress(range(steps), steps, "QAT"):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(first_tensor(work.model(*work.inputs)), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def _export_qdq(work, tool, path, eager):
    """Export the quantized PyTorch model and check it under onnxruntime."""
    import numpy as np
    import onnxruntime
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    proto = amanda.export(work.model, work.inputs, tool, f=path)
    types = [node.op_type for node in proto.graph.node]
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(proto.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(v.detach().cpu().numpy())
             for i, v in zip(session.get_inputs(), work.inputs)}
    output = session.run(None, feeds)[0]
    return {"path": path, "quantize_linear": types.count("QuantizeLinear"),
            "dequantize_linear": types.count("DequantizeLinear"),
            "max_abs_diff_vs_eager": float(np.abs(np.asarray(output) - eager).max())}


def run_quantize(args):
    from amanda.tools.quantization import QuantizationTool, QuantScheme
    if args.export and not hasattr(amanda, "export"):
        raise MissingPiece("`amanda quantize --export` needs amanda.export (amanda/export.py), "
                           "which is not installed in this tree")
    work = _load(args.model, "quantize", ("pytorch", "tensorflow"))
    if args.export and work.framework != "pytorch":
        raise UsageError("--export writes ONNX from PyTorch models only")
    if args.qat and work.framework != "pytorch":
        raise UsageError("--qat trains PyTorch models only (TF graphs: calibrate and quantize)")
    weight = None if args.weight_bits == 0 else QuantScheme(
        args.weight_bits, symmetric=not args.asymmetric_weights, per_channel=not args.per_tensor)
    activation = None if args.activation_bits == 0 else QuantScheme(
        args.activation_bits, symmetric=args.symmetric_activations)
    tool = QuantizationTool(weight=weight, activation=activation, observer=args.observer)
    reference = work.forward()
    batches = _calibration_batches(work, max(1, args.calibrate))
    if activation is not None:
        with amanda.apply(tool.calibration()):
            for batch in _progress(batches, len(batches), "calibrating"):
                work.forward(batch)
    losses = _qat_steps(work, tool, reference, args.qat, args.lr) if args.qat else []
    tool.freeze()
    with amanda.apply(tool):
        quantized = work.forward()
    rows = []
    for row in tool.report():
        w, a = row.get("weight"), row.get("activation")
        scale = (f"{min(w['scale']):.3g}..{max(w['scale']):.3g}"
                 if w and isinstance(w["scale"], list) else (f"{w['scale']:.3g}" if w else "-"))
        rows.append([row["module"] or row["op_id"], row["type"], scale,
                     f"[{a['min']:.3g}, {a['max']:.3g}]" if a else "-"])
    _print_table(["op", "type", "weight scale", "activation range"], rows, "<<><",
                 title=f"{args.model}: weights {weight.describe() if weight else 'float'}, "
                       f"activations {activation.describe() if activation else 'float'}")
    error, sqnr = _relative_error(reference, quantized), _sqnr_db(reference, quantized)
    print(f"\n{len(rows)} ops quantized; output vs float: relative error {error:.4f}, "
          f"SQNR {sqnr:.1f} dB")
    if losses:
        print(f"QAT: {len(losses)} steps, distillation loss {losses[0]:.3g} -> {losses[-1]:.3g}")
    result = {"model": args.model, "framework": work.framework,
              "weight": weight.describe() if weight else None,
              "activation": activation.describe() if activation else None,
              "calibration_batches": len(batches) if activation else 0,
              "relative_error": error, "sqnr_db": sqnr, "qat_losses": losses,
              "ops": tool.report()}
    if args.export:
        result["export"] = _export_qdq(work, tool, args.export, quantized)
        e = result["export"]
        print(f"exported {e['path']}: {e['quantize_linear']} QuantizeLinear / "
              f"{e['dequantize_linear']} DequantizeLinear; onnxruntime vs eager fake-quant: "
              f"max |diff| {e['max_abs_diff_vs_eager']:.2g}")
    path = _write_json(args.out, "quantization.json", _jsonable(result))
    print(f"full report: {path}")
    return 0


def add_quantize_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--weight-bits", type=_bits, default=8, metavar="B",
                        help="weight bits, 0 = leave weights in float (default: 8)")
    parser.add_argument("--activation-bits", type=_bits, default=8, metavar="B",
                        help="activation bits, 0 = leave activations in float (default: 8)")
    parser.add_argument("--per-tensor", action="store_true",
                        help="one weight scale per tensor (default: per output channel)")
    parser.add_argument("--asymmetric-weights", action="store_true",
                        help="unsigned weight grid with a zero point (default: symmetric)")
    parser.add_argument("--symmetric-activations", action="store_true",
                        help="signed activation grid, zero point 0 (default: asymmetric)")
    parser.add_argument("--observer", choices=("minmax", "moving_average"), default="minmax",
                        help="how activation ranges are observed (default: minmax)")
    parser.add_argument("--calibrate", type=_count(1), default=4, metavar="N",
                        help="calibration batches: the model's inputs, then random variants "
                             "(default: 4)")
    parser.add_argument("--qat", type=_count(0), default=0, metavar="STEPS",
                        help="PyTorch: quantization-aware fine-tuning steps towards the float "
                             "model's outputs before freezing (default: 0, post-training only)")
    parser.add_argument("--lr", type=float, default=3e-5,
                        help="QAT learning rate (Adam; default: 3e-5)")
    parser.add_argument("--export", metavar="FILE.onnx",
                        help="PyTorch: write the quantized model as ONNX with "
                             "QuantizeLinear/DequantizeLinear pairs and check it in onnxruntime")
    _add_out_argument(parser, "quantization.json")


# -- nan-check ------------------------------------------------------------------------------

class _PlantNaN(amanda.Tool):
    """Turns the first output of the ``index``-th op named ``op_name`` (its
    name or TF type) into NaN, or with ``backward`` the first gradient one of
    its backward ops produces: a bug for the detector to find."""

    def __init__(self, op_name, index=0, backward=False):
        super().__init__()
        self.op_name, self.index, self.backward = op_name, index, backward
        self.seen = 0
        self.planted_at = None    # the forward op's id
        self.planted_in = None    # the backward op's name
        self.add_inst_for_op(self._forward)
        if backward:
            # before the op (not require_outputs), so its after-routine is recorded
            # ahead of the detector's and the detector sees the planted NaN
            self.add_inst_for_op(self._backward, backward=True)

    def _matches(self, context):
        return context.get_op_name() == self.op_name or (
            context.get_op() is not None and getattr(context.get_op(), "type", None) == self.op_name)

    def _forward(self, context):
        if not self._matches(context):
            return
        if self.seen == self.index:
            self.planted_at = context.get_op_id()
            if not self.backward:
                context.insert_after_op(self._poison, outputs=[0])
        self.seen += 1

    def _backward(self, context):
        if self.planted_in is not None or context.get_op_id() != self.planted_at:
            return
        op = context.get_backward_op()
        name = getattr(op, "__name__", None) or getattr(op, "name", "")
        if "AccumulateGrad" in str(name):   # produces no gradient to poison
            return
        context.insert_after_backward_op(self._poison_first)
        self.planted_in = str(name)

    @staticmethod
    def _poison(value):
        return value * float("nan")

    @staticmethod
    def _poison_first(*grads):
        for i, grad in enumerate(grads):
            if grad is not None:
                return [g * float("nan") if j == i else None for j, g in enumerate(grads)]
        return None


def run_nan_check(args):
    from amanda.tools.debugging import NanDetector, OpStatistics
    work = _load(args.model, "nan-check")
    detector = NanDetector()
    tools = []
    plant = None
    if args.plant and args.plant_backward:
        raise UsageError("--plant and --plant-backward: choose one")
    if args.plant or args.plant_backward:
        name, index = _plant_target(args.plant or args.plant_backward, args.plant_backward)
        plant = _PlantNaN(name, index, backward=bool(args.plant_backward))
        tools.append(plant)
    stats = OpStatistics() if args.stats else None
    tools += [detector] + ([stats] if stats else [])
    with amanda.apply(*tools):
        work.run()
    if plant is not None:
        _check_planted(plant, args)
    report = detector.report
    result = {"model": args.model, "ops_checked": detector.executions,
              "planted": (args.plant or args.plant_backward), "found": report is not None,
              "report": dataclasses.asdict(report) if report else None}
    if report is None:
        print(f"{args.model}: no NaN or Inf in {detector.executions} op executions "
              "(forward and backward)")
    else:
        side = "backward" if report.backward else "forward"
        print(f"{args.model}: first NaN/Inf in a {side} op\n")
        rows = [["op", f"{report.op_name} (id {report.op_id})"],
                ["module", report.module_path if report.module_path is not None else "-"],
                ["backward op", report.backward_op_name or "-"],
                ["output", (f"#{report.output_index}: nan={report.output_stats['nan']} "
                            f"inf={report.output_stats['inf']} of "
                            f"{report.output_stats['numel']}")]]
        for i, s in enumerate(report.input_stats):
            rows.append([f"input {i}", "-" if s is None else
                         f"min={s['min']:.3g} max={s['max']:.3g} mean={s['mean']:.3g} "
                         f"nan={s['nan']} inf={s['inf']}" if s["min"] is not None else
                         f"nan={s['nan']} inf={s['inf']}"])
        _print_table(["first NaN/Inf", ""], rows, "<<")
    written = [_write_json(args.out, "nan.json", _jsonable(result))]
    if stats:
        written.append(_write_json(args.out, "stats.json", _jsonable(stats.report())))
    print("\nwritten: " + ", ".join(written))
    return 1 if report is not None else 0


def _plant_target(text, backward):
    option = "--plant-backward" if backward else "--plant"
    name, _, index = text.partition(":")
    if not name or (index and not index.isdigit()):
        raise UsageError(f"{option} {text}: expected OP or OP:N with N >= 0 "
                         "(e.g. conv2d:2, the third conv2d)")
    return name, int(index or 0)


def _check_planted(plant, args):
    """A NaN that was never planted would report "no NaN": a usage error."""
    option = "--plant-backward" if plant.backward else "--plant"
    target = args.plant_backward if plant.backward else args.plant
    if plant.planted_at is None:
        seen = (f"only {plant.seen} ops named {plant.op_name!r} (N from 0 to {plant.seen - 1})"
                if plant.seen else f"no op named {plant.op_name!r}")
        raise UsageError(f"{option} {target}: one step of {args.model} runs {seen}; "
                         "nothing was planted")
    if plant.backward and plant.planted_in is None:
        raise UsageError(f"{option} {target}: that op has no backward op computing a "
                         "gradient; nothing was planted")


def add_nan_check_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--plant", metavar="OP[:N]",
                        help="plant a NaN in the output of the N-th (from 0) forward op "
                             "named OP (conv2d, linear, Conv2D...) to see the detector work")
    parser.add_argument("--plant-backward", metavar="OP[:N]",
                        help="plant it in a gradient computed by that op's backward ops")
    parser.add_argument("--stats", action="store_true",
                        help="also write per-op output statistics to OUT/stats.json")
    _add_out_argument(parser, "nan.json")


# -- diff -----------------------------------------------------------------------------------

def run_diff(args):
    diff = _require("amanda.tools.diff", "diff", "the numeric diff tool")
    work = _load(args.model, "diff", ("pytorch", "tensorflow"))
    if work.framework == "tensorflow":
        return _run_diff_tf(args, diff, work)
    import io

    import onnx
    import torch
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(work.model, work.inputs, buffer, dynamo=False, opset_version=17)
    exported = onnx.load_from_string(buffer.getvalue())
    if args.perturb:
        module = dict(work.model.named_modules()).get(args.perturb)
        if module is None:
            raise UsageError(f"--perturb: {args.model} has no module {args.perturb!r}")
        with torch.no_grad():
            for parameter in module.parameters(recurse=False):
                parameter.add_(args.perturb_by)
    atol = 1e-5 if args.atol is None else args.atol
    report = diff.diff_torch_onnx(work.model, work.inputs, onnx_model=exported,
                                  rtol=args.rtol, atol=atol)
    print(f"{args.model}: PyTorch vs its ONNX export (rtol {args.rtol}, atol {atol})\n")
    print(report.describe())
    result = {"model": args.model, "framework": "pytorch", "perturbed": args.perturb,
              "first": dataclasses.asdict(report.first) if report.first else None,
              "compared": report.compared, "fused": report.fused,
              "unmatched": report.unmatched, "output_error": report.output_error}
    path = _write_json(args.out, "diff.json", _jsonable(result))
    print(f"\nfull report: {path}")
    return 1 if report.first else 0


def _keras_layer(model, selector):
    """The Keras layer named ``selector``, or ``CLASS:K``: the K-th (from 0)
    layer whose class is CLASS (``conv2d:2``, case-insensitive)."""
    def walk(layer):
        for inner in getattr(layer, "layers", ()):
            yield inner
            yield from walk(inner)

    layers = [layer for layer in walk(model.keras_model) if layer.weights]
    for layer in layers:
        if layer.name == selector:
            return layer
    kind, _, index = selector.rpartition(":")
    if kind and index.isdigit():
        same = [layer for layer in layers if type(layer).__name__.lower() == kind.lower()]
        if int(index) < len(same):
            return same[int(index)]
    raise UsageError(f"--perturb: no layer {selector!r} with weights; layers: "
                     f"{', '.join(layer.name for layer in layers)} (or CLASS:K, e.g. conv2d:2)")


def _run_diff_tf(args, diff, work):
    """TF graph (keras: specs) vs its tf2onnx conversion, op by op."""
    model = work.model
    feeds = {model.x: work.inputs[0]}
    converted = diff.tf_to_onnx(model.session, [model.x], [model.y])
    perturbed_ops, layer = [], None
    if args.perturb:
        layer = _keras_layer(model, args.perturb)
        for weight in layer.weights:
            variable = weight.value
            value = model.session.run(variable)
            # through the variable's own initializer op (fed): no op is added to the graph
            model.session.run(variable.initializer,
                              {variable.initializer.inputs[1]: value + args.perturb_by})
            perturbed_ops += [reader.name for read in variable.op.outputs[0].consumers()
                              for out in read.outputs for reader in out.consumers()
                              if not reader.name.startswith("gradients")]
    atol = 0.0 if args.atol is None else args.atol
    report = diff.diff_tf_onnx(model.session, feeds, model.y, onnx_model=converted,
                               rtol=args.rtol, atol=atol)
    print(f"{args.model}: TensorFlow vs its ONNX conversion (tf2onnx; rtol {args.rtol}, "
          f"atol {atol})\n")
    print(report.describe())
    result = {"model": args.model, "framework": "tensorflow", "perturbed": args.perturb,
              "perturbed_layer": layer.name if layer is not None else None,
              "perturbed_ops": perturbed_ops,
              "first": dataclasses.asdict(report.first) if report.first else None,
              "compared": [dataclasses.asdict(m) for m in report.compared],
              "unmatched": report.unmatched, "incomparable": report.incomparable,
              "onnx_only": report.onnx_only, "output_error": report.output_error}
    path = _write_json(args.out, "diff.json", _jsonable(result))
    print(f"\nfull report: {path}")
    return 1 if report.first else 0


def add_diff_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance (default 1e-5 for PyTorch; 0 for TF, whose "
                             "tolerance is relative to each tensor's largest value)")
    parser.add_argument("--perturb", metavar="MODULE",
                        help="after exporting, add --perturb-by to this module's parameters "
                             "(e.g. conv_layer3; for keras: models a layer name or CLASS:K, "
                             "e.g. conv2d:2) to plant a mismatch")
    parser.add_argument("--perturb-by", type=float, default=1e-2, metavar="X")
    _add_out_argument(parser, "diff.json")


# -- graph ----------------------------------------------------------------------------------

GRAPH_FORMATS = ("json", "dot", "svg", "html", "png")


def run_graph(args):
    from amanda.tools.graph import GraphTracingTool
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(GRAPH_FORMATS))
    if unknown:
        raise UsageError(f"--formats: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(GRAPH_FORMATS)}")
    work = _load(args.model, "graph")
    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        work.run()
    graph = tracer.graph if tracer.graph is not None else _lift(work)
    ops = list(graph.ops)
    counts = collections.Counter(op.type for op in ops)
    _print_table(["op type", "ops"], [[t, n] for t, n in counts.most_common(args.top)], "<>",
                 title=f"{args.model}: {len(ops)} ops, {len(graph.inputs)} inputs, "
                       f"{len(graph.outputs)} outputs ({graph.namespace})")
    os.makedirs(args.out, exist_ok=True)
    from amanda.tools import graph_view
    if work.framework == "pytorch":
        graph_view.name_parameters(graph, work.model)
    view = graph_view.build_view(graph, show_init=args.show_init,
                                 collapse=not args.no_collapse,
                                 forward_only=args.forward_only)
    written = _write_graph(args, tracer, graph, view, formats, graph_view)
    print(f"\ndrawing: {len(view.nodes)} boxes for {len(ops)} ops"
          + (f" ({view.hidden} initialiser/constant ops hidden; --show-init shows them)"
             if view.hidden else ""))
    print("written: " + ", ".join(written))
    return 0


def _write_graph(args, tracer, graph, view, formats, graph_view):
    written = []

    def path(name):
        written.append(os.path.join(args.out, name))
        return written[-1]

    if "json" in formats:
        tracer.to_json(graph, path=path("graph.json"))
    if "dot" in formats:
        with open(path("graph.dot"), "w") as f:
            f.write(graph_view.to_dot(view, title=args.model))
    if "svg" in formats:
        svg = os.path.join(args.out, "graph.svg")
        if graph_view.to_svg(view, svg, title=args.model) is not None:
            written.append(svg)
        elif "html" not in formats:   # no Graphviz: the drawing that needs nothing
            formats = formats + ["html"]
            _stderr("amanda graph: Graphviz's `dot` is not installed (Debian: apt-get "
                    "install graphviz); writing graph.html instead of graph.svg")
    if "html" in formats:
        with open(path("graph.html"), "w") as f:
            f.write(graph_view.to_html(view, title=args.model))
    if "png" in formats:
        tracer.render_png(path("graph.png"), graph, forward_only=args.forward_only,
                          title=args.model)
    return written


def _lift(work):
    """The IR graph of a graph-mode workload, lifted by its frontend."""
    if work.framework == "tensorflow":
        from amanda.frontends.tensorflow import lift_graph
        return lift_graph(work.model.graph)
    if work.framework == "onnx":
        from amanda.frontends.onnx import lift
        return lift(work.model)
    raise UsageError(f"no graph was traced for {work.name}")


def add_graph_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--formats", default="json,dot,svg",
                        help="comma-separated: json (IR), dot (readable Graphviz source), svg "
                             "(drawn by Graphviz's dot; graph.html when dot is missing), html "
                             "(self-contained page with pan and zoom), png (networkx and "
                             "matplotlib: the viz extra) (default: json,dot,svg)")
    parser.add_argument("--forward-only", action="store_true",
                        help="leave backward ops out of the drawings")
    parser.add_argument("--show-init", action="store_true",
                        help="TF: also draw variable initialisers and constants")
    parser.add_argument("--no-collapse", action="store_true",
                        help="draw every repeated block and backward op (default: a block "
                             "repeating its sibling, e.g. layer.1..11, is one box)")
    parser.add_argument("--top", type=_count(1), default=10, help="op types to list (default: 10)")
    _add_out_argument(parser, "graph.json, graph.dot, graph.svg (or graph.html)")


# -- models --------------------------------------------------------------------------------

OTHER_SPECS = [
    ("keras:cnn", "the tutorial CNN in Keras, tf.compat.v1 graph; input (1, 32, 32, 3)"),
    ("keras:NAME[:SIZE]", ("a tf.keras.applications model (keras:resnet50, "
                           "keras:mobilenetv2:96), weights=None, input (1, SIZE, SIZE, 3), "
                           "SIZE 224 by default")),
    ("path/to/model.onnx", "an ONNX model, run with onnxruntime (random inputs)"),
    ("path/to/file.py:factory", "factory() returns (model, inputs) for a PyTorch model"),
]


def run_models(args):
    from amanda import models
    rows = [[name, description] for name, description in models.available().items()]
    rows += [list(entry) for entry in OTHER_SPECS]
    print_table(["model", "description"], rows, "<<")
    return 0


COMMANDS = {c.name: c for c in [
    Command("trace",
            help="per-op wall time, forward and backward; Chrome trace for Perfetto",
            description="""\
Time every forward and backward op of a few training steps with the op
profiler (amanda.tools.profiler): a table aggregated by op type, op name or
module path, a Chrome trace (OUT/trace.json, opens in ui.perfetto.dev) and
OUT/profile.json. The first step runs the analysis and is not measured when
--steps > 1. --kernels (PyTorch) adds the aten ops / CUDA kernels of each op.""",
            example="amanda trace bert --by module --kernels",
            add_arguments=add_trace_arguments, run=run_trace),
    Command("flops",
            help="forward and backward FLOPs per op type and module",
            description="""\
Count the FLOPs of one training step with the FLOPs profiler
(amanda.tools.flops): a multiply-add is 2 FLOPs; convolutions and matrix
products also count their backward ops; op types without a formula are
listed, never silently zero. Works on PyTorch and TF (keras:...) models.
Writes OUT/flops.json (and OUT/flops-MODEL.png with --chart).""",
            example="amanda flops resnet50 keras:resnet50 --chart",
            add_arguments=add_flops_arguments, run=run_flops),
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
    Command("prune",
            help="mask weights (magnitude, channel, N:M) and report the sparsity",
            description="""\
Prune the weights of every convolution and linear layer with the pruning tool
(amanda.tools.pruning): forward weight masks and gradient masks, applied by
amanda while one training step runs, without touching the model. Prints the
sparsity per layer and how much the output changed; writes OUT/pruning.json.""",
            example="amanda prune resnet50 --pattern 2:4",
            add_arguments=add_prune_arguments, run=run_prune),
    Command("quantize",
            help="fake-quantize weights and activations; calibrate, QAT, QDQ ONNX export",
            description="""\
Quantize the weights and activations of every convolution and linear layer
with the QAT tool (amanda.tools.quantization): calibrate activation ranges on
a few batches (observe only), optionally fine-tune with quantization in the
loop (--qat, straight-through gradients), then run the fake-quantized model
and compare it with the float one (relative error, SQNR). --export writes an
ONNX model with QuantizeLinear/DequantizeLinear pairs and checks it in
onnxruntime. Writes OUT/quantization.json with every op's scales.""",
            example="amanda quantize cnn --weight-bits 4 --qat 20 --export cnn-qdq.onnx",
            add_arguments=add_quantize_arguments, run=run_quantize),
    Command("nan-check",
            help="name the first op (forward or backward) producing NaN/Inf",
            description="""\
Run one training step under the NaN/Inf detector (amanda.tools.debugging):
it names the first op, forward or backward, whose outputs hold a NaN or an
Inf, with its module path and its inputs' statistics. --plant puts a NaN
into an op's output (--plant-backward into a gradient) to see it work.
Exit status 1 when a NaN/Inf was found. Writes OUT/nan.json.""",
            example="amanda nan-check cnn --plant conv2d:2",
            add_arguments=add_nan_check_arguments, run=run_nan_check),
    Command("diff",
            help="a model vs its ONNX export: the first module/op whose outputs diverge",
            description="""\
Export a PyTorch model to ONNX, run both, and match every module's output
with the ONNX node of its scope (amanda.tools.diff); reports the first
module whose output diverges beyond the tolerance. A keras: model is
converted with tf2onnx and compared op by op (TF ops matched with ONNX
nodes by tensor name and op type). --perturb MODULE changes that module's
(Keras layer's) parameters after the export to plant a mismatch. Exit
status 1 when a divergence was found. Writes OUT/diff.json.""",
            example="amanda diff cnn --perturb conv_layer3",
            add_arguments=add_diff_arguments, run=run_diff),
    Command("graph",
            help="trace one step into amanda's IR: JSON, and a drawing (SVG or HTML)",
            description="""\
Trace one training step (forward and backward ops) into an amanda IR graph
with the graph tracing tool (amanda.tools.graph) and write it as IR JSON and
a readable drawing (amanda.tools.graph_view): op types, module paths,
parameter names and tensor shapes; forward ops blue, backward orange; ops in
module clusters, repeated blocks as one box; TF initialisers hidden. SVG
when Graphviz's dot is installed, else one self-contained HTML page.""",
            example="amanda graph cnn --forward-only",
            add_arguments=add_graph_arguments, run=run_graph),
    Command("demo",
            help="showcase: the tutorial's counting tool, coverage vs module hooks, more tools",
            description="""\
1. Apply the tutorial's CountOPTool (count conv2d / linear forward calls and
   Convolution / Addmm backward calls by op name, on any model, without
   touching its source) to the tutorial CNN and BERT.
2. Compare the instrumentation points amanda offers with those of PyTorch
   module hooks on BERT and ResNet-50 (as `amanda coverage`).
3. Count FLOPs, quantize to 8 bits and find a planted NaN on the tutorial
   CNN (as `amanda flops`, `amanda quantize`, `amanda nan-check`).
Writes OUT/demo.json. --models runs every part on other models.""",
            example="amanda demo --models cnn gpt2-small",
            add_arguments=add_demo_arguments, run=run_demo),
    Command("models",
            help="list the built-in models",
            description="""\
List the built-in models every subcommand accepts, and the other kinds of
model spec: keras:NAME[:SIZE], path/to/model.onnx, path/to/file.py:factory.""",
            example="amanda models",
            add_arguments=lambda parser: None, run=run_models),
]}
"""Subcommands by name, in ``--help`` order."""


# -- entry point ---------------------------------------------------------------------------

def _stderr(message):
    sys.stdout.flush()  # keep progress lines in order with the output
    print(message, file=sys.stderr, flush=True)


def _quiet_backends():
    """Keep backend start-up chatter off the terminal (before any backend loads):
    TensorFlow's C++ logs (absl, oneDNN, CPU features; 3 = fatal only, its
    errors reach the CLI as Python exceptions), its Python logger, and
    transformers' warnings. A user's own setting wins."""
    import logging
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


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
    _quiet_backends()
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
    except amanda.AmandaError as exc:
        print(f"amanda {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        message = missing_extra_message(args.command, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
