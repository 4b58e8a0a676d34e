"""Inferred portable routines on ONNX: a mask routine on every Conv, hosted vs native.

Model: ``light_squeezenet`` from the onnx package's backend test data
(26 Conv nodes, 1x3x224x224 input) or ``light_resnet50`` (53 Conv), run on
CPU by onnxruntime with default session options. The tool inserts an
*unmarked* routine ``lambda``-style closure ``weight * mask`` (a random 50%
NumPy mask captured by the closure) before input 1 of every Conv.
Configurations, each one session created once inside ``amanda.apply``:

* ``vanilla``: the plain model;
* ``inferred (native)``: the routine as amanda infers it (``Mul`` nodes);
* ``marked (native)``: the same routine marked ``@portable.routine``;
* ``hosted``: the same tool under ``amanda.portable.inference(False)``, so
  every routine is a Python callback (onnxruntime-extensions).

Timed: ``session.run`` only, ``runs`` calls per sample, configurations
interleaved round-robin (rotating the first); medians over repeats and
ratios to vanilla (``harness.summarize``). Outputs of native and hosted are
compared before timing. Not part of ``make bench``; run
``python -m benchmarks.auto_portable [model] [repeats]``.
"""

from __future__ import annotations

import os
import sys
import time

from benchmarks import harness


def _tool(marked=False):
    import numpy as np

    import amanda

    def masker(mask):
        def apply(weight):
            return weight * mask
        return amanda.portable.routine(apply) if marked else apply

    class MaskConvs(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.rng = np.random.default_rng(0)
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "Conv":
                weight = amanda.evaluate(context.get_inputs()[1])
                mask = (self.rng.random(weight.shape) > 0.5).astype(weight.dtype)
                context.insert_before_op(masker(mask), inputs=[1])

    return MaskConvs()


def benchmark(name="light_squeezenet", repeats=15, runs=5, warmup=2):
    import numpy as np
    import onnx
    import onnxruntime as ort

    import amanda
    from amanda import portable
    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"{name}.onnx")
    model = onnx.load(path)
    initializers = {i.name for i in model.graph.initializer}
    data = next(v for v in model.graph.input if v.name not in initializers)
    shape = [d.dim_value or 1 for d in data.type.tensor_type.shape.dim]
    feeds = {data.name: np.random.default_rng(0).random(shape, np.float32)}
    sessions = {"vanilla": ort.InferenceSession(path, providers=["CPUExecutionProvider"])}
    with amanda.apply(_tool()):
        sessions["inferred (native)"] = ort.InferenceSession(
            path, providers=["CPUExecutionProvider"])
    with amanda.apply(_tool(marked=True)):
        sessions["marked (native)"] = ort.InferenceSession(
            path, providers=["CPUExecutionProvider"])
    with portable.inference(False), amanda.apply(_tool()):
        sessions["hosted"] = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    native, hosted = (sessions[k].run(None, feeds)[0] for k in ("inferred (native)", "hosted"))
    np.testing.assert_allclose(native, hosted, rtol=1e-5, atol=1e-6)
    names = list(sessions)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            run = sessions[n].run
            start = time.perf_counter()
            for _ in range(runs):
                run(None, feeds)
            if r >= warmup:
                times[n].append((time.perf_counter() - start) / runs)
    return {"model": name, "convs": sum(n.op_type == "Conv" for n in model.graph.node),
            "summary": harness.summarize(times, "vanilla"), "repeats": repeats, "runs": runs}


if __name__ == "__main__":
    result = benchmark(*sys.argv[1:2], *[int(a) for a in sys.argv[2:3]])
    print(f"{result['model']}: {result['convs']} Conv, {result['repeats']} repeats x "
          f"{result['runs']} runs, medians")
    for config, stats in result["summary"].items():
        print(f"  {config:18s} {stats['median_s'] * 1e3:8.2f} ms  {stats['ratio']:.2f}x  "
              f"(spread {stats['spread']:.2f})")
