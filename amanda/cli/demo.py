"""``amanda demo``: the tutorial's counting tool, coverage and more tools in one run."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import time

import amanda
from amanda.cli.common import (
    DEFAULT_OUT,
    Command,
    _jsonable,
    _model_help,
    _pytorch_only,
    _relative_error,
    _stderr,
    _Workloads,
    _write_json,
    require,
)
from amanda.cli.coverage import _run_coverage, coverage_table
from amanda.cli.nan_check import _PlantNaN
from amanda.cli.table import Table, print_table_object


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
    require("demo", [*count_models, *coverage_models])
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

    flops = FlopsProfiler(other_backward=True)   # as `amanda flops` counts
    with amanda.apply(flops):
        work.run()
    top = ", ".join(f"{t} {f / 1e6:,.1f}M" for t, f in list(flops.by_type("forward").items())[:3])
    results["flops"] = {"forward": flops.total("forward"), "backward": flops.total("backward")}
    print(f"    amanda flops {spec}:      forward {flops.total('forward') / 1e6:,.1f} MFLOPs "
          f"({top}), backward {flops.total('backward') / 1e6:,.1f} MFLOPs")

    # exactly `amanda quantize SPEC`: its default schemes and calibration batches
    from amanda.cli import quantize
    options = quantize.default_arguments(spec)
    weight, activation = quantize.schemes(options)
    quantization = QuantizationTool(weight=weight, activation=activation,
                                    observer=options.observer)
    reference = work.forward()
    quantize.calibrate(work, quantization, options.calibrate)
    quantization.freeze()
    with amanda.apply(quantization):
        quantized = work.forward()
    error = _relative_error(reference, quantized)
    results["quantize"] = {"ops": len(quantization.ops), "relative_error": error}
    print(f"    amanda quantize {spec}:   {len(quantization.ops)} ops fake-quantized to 8 bits "
          f"(per-channel weights; {options.calibrate} calibration batches), output relative "
          f"error {error:.4f}")

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


COMMAND = Command("demo",
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
    add_arguments=add_demo_arguments, run=run_demo)
