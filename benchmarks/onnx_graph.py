"""ONNX overhead: onnxruntime latency of instrumented models vs the plain model.

Model: ``light_resnet50`` from the onnx package's backend test data (ResNet-50
with constant "light" weights; 1x3x224x224 input), run on CPU by onnxruntime
with default session options. Configurations, each one session created once:

* ``vanilla``: the plain model;
* ``masks (native)``: a portable weight-mask routine before every Conv and
  Gemm (random 50% masks), lowered to ONNX ``Mul`` nodes;
* ``callback (every op)``: a Python routine (it counts calls) before every op,
  hosted by onnxruntime-extensions.

Timed: ``session.run`` only, ``runs`` calls per sample, configurations
interleaved round-robin (rotating the first), medians over repeats and ratios
to vanilla (``harness.summarize``). Also reported: session creation inside
``amanda.apply`` (lift + analysis + lowering) vs a plain session.
"""

from __future__ import annotations

import os
import time

from benchmarks import harness

NAME = "onnx_graph"
TARGETS = {"masks (native)": 1.05}
MODEL = "light_resnet50"


def model_path(name=MODEL):
    import onnx
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"{name}.onnx")


def _tools():
    import numpy as np

    import amanda
    from amanda import portable

    class MaskEveryWeight(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.rng = np.random.default_rng(0)
            self.masked = 0
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() in ("Conv", "Gemm"):
                weight = amanda.evaluate(context.get_inputs()[1])
                mask = (self.rng.random(weight.shape) > 0.5).astype(weight.dtype)
                context.insert_before_op(self.mask_weight, inputs=[1], mask=mask)
                self.masked += 1

        @portable.routine
        def mask_weight(self, weight, mask):
            return weight * mask

    class CountEveryOp(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.add_inst_for_op(lambda context: context.insert_before_op(self.count))

        def count(self, *arrays):
            self.calls += 1

    return MaskEveryWeight(), CountEveryOp()


def _feeds(model):
    import numpy as np
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name not in initializers:
            shape = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
            feeds[value.name] = np.random.default_rng(0).random(shape, dtype=np.float32)
    return feeds


def _session(path, tool=None):
    import onnxruntime as ort

    import amanda
    start = time.perf_counter()
    if tool is None:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:
        with amanda.apply(tool):
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session, time.perf_counter() - start


def benchmark_model(path, repeats, runs, warmup=2):
    import numpy as np
    import onnx
    model = onnx.load(path)
    feeds = _feeds(model)
    masks, counter = _tools()
    sessions, created = {}, {}
    for name, tool in (("vanilla", None), ("masks (native)", masks),
                       ("callback (every op)", counter)):
        sessions[name], created[name] = _session(path, tool)
    reference = sessions["vanilla"].run(None, feeds)[0]
    assert np.array_equal(sessions["callback (every op)"].run(None, feeds)[0], reference)
    names = list(sessions)
    times = {name: [] for name in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            run = sessions[name].run
            start = time.perf_counter()
            for _ in range(runs):
                run(None, feeds)
            if r >= warmup:
                times[name].append((time.perf_counter() - start) / runs)
    summary = harness.summarize(times, "vanilla")
    return {"model": os.path.basename(path), "nodes": len(model.graph.node),
            "masked_weights": masks.masked, "callbacks_per_run": counter.calls // max(
                1, (warmup + repeats) * runs + 1),
            "summary": summary, "times_s": times, "repeats": repeats, "runs": runs,
            "session_creation_s": created,
            "targets_met": {k: summary[k]["ratio"] <= t for k, t in TARGETS.items()}}


def render(result, machine):
    s = result["summary"]
    created = result["session_creation_s"]
    lines = ["# amanda ONNX overhead (onnxruntime)", "",
             f"`session.run` of {result['model']} ({result['nodes']} nodes, 1x3x224x224, CPU, "
             f"default options); {result['repeats']} interleaved repeats x {result['runs']} "
             "runs, medians; ratio to the plain model.", "",
             "| configuration | median ms | ratio × | spread | session creation s |",
             "|---|---|---|---|---|"]
    for name, stats in s.items():
        lines.append(f"| {name} | {stats['median_s'] * 1e3:.1f} | {stats['ratio']:.3f} | "
                     f"{stats['spread']:.3f} | {created[name]:.2f} |")
    met = "yes" if all(result["targets_met"].values()) else "no"
    lines += ["", f"Masks on {result['masked_weights']} Conv/Gemm weights lowered to ONNX `Mul` "
              f"nodes (target ≤ {TARGETS['masks (native)']}×: {met}); the callback "
              f"configuration runs a Python routine before each of the {result['nodes']} ops "
              f"({result['callbacks_per_run']} calls per run).", "",
              harness.machine_markdown(machine), ""]
    return "\n".join(lines)


def run(repeats=None, quick=False, log=print):
    """Run the suite. Returns ``(markdown, raw)``."""
    import onnxruntime as ort
    n = repeats or (3 if quick else 9)
    runs = 2 if quick else 5
    log(f"[{NAME}] {MODEL}: {n} repeats x 3 configs x {runs} runs ...")
    start = harness.cpu_snapshot()
    result = benchmark_model(model_path(), n, runs, warmup=1 if quick else 2)
    result["other_processes_cores"] = harness.foreign_load(start, harness.cpu_snapshot())
    machine = harness.machine_info(onnxruntime=ort.__version__)
    return render(result, machine), {"suite": NAME, "machine": machine, "results": [result]}
