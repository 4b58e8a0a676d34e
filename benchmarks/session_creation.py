"""ONNX session creation, plain vs observe-only inside ``apply`` (issue 29).

The workload: create an ``onnxruntime.InferenceSession`` from the bytes of
the small BERT export of the ONNX sweep (``tests/onnx/onnx_sweep_models.py``:
2 layers, hidden 32, 8 tokens, random weights from a transformers config,
exported with ``torch.onnx``), CPU provider, default options but one
intra-op thread (the same for every configuration). Configurations,
interleaved in one process (round-robin, the first one rotating), each
sample ``CREATIONS`` creations:

* plain: the session outside any scope;
* observe-only, cache miss: each creation inside ``amanda.apply`` of a new
  counting tool (routines returning None before and after every node), so
  amanda analyses and instruments the model every time;
* observe-only, cache hit: each creation inside a new ``apply`` scope of one
  tool that already made a session of this model.

Entering and leaving the scope is timed. Goal (issue 29): the observe-only
creation within ``GOAL`` times plain onnxruntime's. The report also gives
the fastest-over-fastest ratio (least disturbed on a shared machine) and
where a miss's time goes (``cProfile`` of a few creations: the functions of
largest cumulative time). Every instrumented session is checked once: its
outputs equal the plain session's, each node's routines called once a run.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from benchmarks import harness
from benchmarks.counting import interleave, onnx_export

NAME = "session_creation"
GOAL = 2.0
MODEL = "bert"
THREADS = 1
CREATIONS = 5


def _observer():
    import amanda

    class Observe(amanda.Tool):
        """Routines returning None before and after every node; counts calls."""

        def __init__(self):
            super().__init__()
            self.calls = 0
            self.nodes = 0
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            self.nodes += 1
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)

        def look(self, *tensors):
            self.calls += 1

    return Observe()


def _create(data):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _scoped(data, tool):
    import amanda
    with amanda.apply(tool):
        return _create(data)


def check(data, feeds):
    """One observe-only session: outputs equal plain, two calls per node."""
    import numpy as np
    want = _create(data).run(None, feeds)
    tool = _observer()
    got = _scoped(data, tool).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(want, got)), "outputs differ"
    assert tool.nodes and tool.calls == 2 * tool.nodes, (tool.nodes, tool.calls)
    return tool.nodes


def profile(data, creations=5, top=12):
    """``cProfile`` of ``creations`` cache-missing creations: the rows of
    largest cumulative time, as text, and the total seconds."""
    profiler = cProfile.Profile()
    tools = [_observer() for _ in range(creations)]
    start = time.perf_counter()
    profiler.enable()
    for tool in tools:
        _scoped(data, tool)
    profiler.disable()
    total = time.perf_counter() - start
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue(), total / creations


def measure(data, repeats, creations, warmup=2):
    """Seconds per creation by configuration."""
    warm = _observer()
    _scoped(data, warm)

    def plain(n):
        start = time.perf_counter()
        for _ in range(n):
            _create(data)
        return time.perf_counter() - start

    def miss(n):
        tools = [_observer() for _ in range(n)]
        start = time.perf_counter()
        for tool in tools:
            _scoped(data, tool)
        return time.perf_counter() - start

    def hit(n):
        start = time.perf_counter()
        for _ in range(n):
            _scoped(data, warm)
        return time.perf_counter() - start

    steps = {"plain": plain, "observe-only, cache miss": miss, "observe-only, cache hit": hit}
    return interleave(steps, repeats, creations, warmup)


def render(result, machine):
    lines = ["# ONNX session creation: plain vs observe-only inside `apply`", "",
             f"Small BERT export ({result['nodes']} nodes), `InferenceSession` from its bytes, "
             f"CPU, {THREADS} intra-op thread; {result['repeats']} interleaved samples of "
             f"{result['creations']} creations each, medians. Goal (issue 29): observe-only "
             f"creation ≤ {GOAL}× plain.", "",
             "| configuration | median ms | ratio × | fastest ms | fastest / fastest × "
             "| goal | met |",
             "|---|---:|---:|---:|---:|---|---|"]
    for config, row in result["rows"].items():
        plain = config == "plain"
        lines.append(f"| {config} | {row['ms']:.2f} | {row['ratio']:.2f} | "
                     f"{row['min_ms']:.2f} | {row['min_ratio']:.2f} | "
                     f"{'' if plain else f'≤ {GOAL}'} | "
                     f"{'' if plain else ('yes' if row['ratio'] <= GOAL else 'no')} |")
    lines += ["", f"cProfile of cache-missing creations ({result['profiled_ms']:.1f} ms each "
              "under the profiler), largest cumulative time:", "", "```",
              result["profile"].strip(), "```", "", harness.machine_markdown(machine), ""]
    return "\n".join(lines)


def run(repeats=None, quick=False, log=print):
    """Run the suite. Returns ``(markdown, raw)``."""
    import onnxruntime as ort
    data, feeds = onnx_export(MODEL)
    nodes = check(data, feeds)
    n = repeats or (3 if quick else 31)
    log(f"[{NAME}] ONNX {MODEL}: {n} repeats x 3 configs x {CREATIONS} creations ...")
    times = measure(data, n, CREATIONS, warmup=1 if quick else 2)
    summary = harness.summarize(times, "plain")
    fastest = summary["plain"]["min_s"]
    rows = {c: {"ms": s["median_s"] * 1e3, "ratio": s["ratio"], "min_ms": s["min_s"] * 1e3,
                "min_ratio": s["min_s"] / fastest, "spread": s["spread"]}
            for c, s in summary.items()}
    text, per = profile(data)
    machine = harness.machine_info(onnxruntime=ort.__version__)
    result = {"model": MODEL, "nodes": nodes, "repeats": n, "creations": CREATIONS,
              "rows": rows, "profile": text, "profiled_ms": per * 1e3, "times_s": times}
    return render(result, machine), {"suite": NAME, "machine": machine, "result": result}
