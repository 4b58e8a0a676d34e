"""Counting routines on every op, and switching per step (issue 14, "Measure").

Rows, each interleaved with its plain run in one process (configurations
round-robin, the first one rotating), medians over repeats:

* ONNX exports of the small BERT and GPT-2 of the ONNX sweep
  (``tests/onnx/onnx_sweep_models.py``: 2 layers, hidden 32, 8 tokens,
  batch 1), onnxruntime on CPU, default options but one intra-op thread
  (``THREADS``: a run takes ~0.1 ms, and a second pool thread only spins
  against other processes), the same for every configuration; one session per
  configuration created once (the counters' inside ``amanda.apply``):
  ``session.run`` alone is timed, ``runs`` calls per sample (31 x 50). Counters: a
  routine selecting no tensor (``insert_before_op(count, inputs=[])``)
  before every node, and one receiving the node's inputs (default
  selection) before every node.
* Keras ``MobileNetV2(weights=None)`` in a ``tf.compat.v1.Session``,
  inference (``training=False``), batch 1, 224x224: ``Session.run`` of the
  logits, the same two counters before every op. A counter's runs are timed
  inside its ``apply`` scope (entered before the timer starts), so the row
  is the cost of the routines, not of entering the scope.
* ONNX switching: one step = create an ``onnxruntime.InferenceSession``
  from the model's bytes and run it once, the instrumented step inside a new
  ``amanda.apply`` scope per step with the same tool object (a cache hit
  from the second scope on; the first scope's creation is reported apart).
  Tools: analysis-only (it inserts nothing) and the ``inputs=[]`` counter.
  Timed: the whole step, scope entry and exit included.

Every row checks its counts: each run of a counter calls it once per node
(ONNX: the top graph's nodes, no control flow in these exports) or per op
the plain run executes (TF: the fetch's ancestors in the user's graph);
a wrong count raises (the suite fails, it does not just print).
"""

from __future__ import annotations

import gc
import time

from benchmarks import harness

NAME = "counting"
GOALS = {"count": 2.0, "switch": 1.05}
ONNX_MODELS = ("bert", "gpt2")
#: onnxruntime threads for the counting rows: these models run in ~0.1 ms,
#: where a second pool thread only spins against other processes (noise)
THREADS = 1


class CountMismatch(AssertionError):
    """A counter was called a different number of times than ops ran."""


def _counter(select_none):
    import amanda

    class Count(amanda.Tool):
        """A routine before every op; it counts its calls."""

        def __init__(self):
            super().__init__()
            self.calls = 0
            self.points = 0
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            self.points += 1
            if select_none:
                context.insert_before_op(self.count, inputs=[])
            else:
                context.insert_before_op(self.count)

        def count(self, *tensors):
            self.calls += 1

    return Count()


def _analysis_only():
    import amanda

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.points = 0
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            self.points += 1

    return Look()


COUNTERS = (("count, inputs=[]", True), ("count, inputs", False))
FETCH_FLOOR = "no amanda: plain run, observed tensors fetched too"


def check_count(what, got, expected):
    if got != expected:
        raise CountMismatch(f"{what}: counter called {got} times, expected {expected}")


def interleave(steps, repeats, runs, warmup):
    """Seconds per step by name: each sample is ``runs`` calls of one step,
    steps round-robin within a repeat, the first one rotating."""
    names = list(steps)
    times = {n: [] for n in names}
    # objects alive now (the frameworks, the models) are frozen out of the
    # collector's sight, so the collection before each sample stays cheap
    gc.collect()
    gc.freeze()
    try:
        for r in range(warmup + repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                gc.collect()
                elapsed = steps[name](runs)
                if r >= warmup:
                    times[name].append(elapsed / runs)
    finally:
        gc.unfreeze()
    return times


def _row(summary, plain, config, count):
    stats = summary[config]
    base = summary[plain]["median_s"]
    per = (stats["median_s"] - base) / count * 1e6 if count else None
    return {"plain_ms": base * 1e3, "ms": stats["median_s"] * 1e3, "ratio": stats["ratio"],
            "spread": stats["spread"], "min_ratio": stats["min_s"] / base,
            "max_ratio": stats["max_s"] / base, "us_per_routine": per,
            # fastest sample over the plain run's fastest: the least disturbed
            # estimate on a shared machine
            "best_ratio": stats["min_s"] / summary[plain]["min_s"]}


# -- ONNX ----------------------------------------------------------------------------------

def onnx_export(name):
    """(model bytes, feeds) of the sweep's small export ``name``."""
    from tests.onnx import onnx_sweep_models
    case = next(c for c in onnx_sweep_models.CASES if c.name == name)
    data, feeds, _ = onnx_sweep_models.export(case)
    return data, feeds


def _ort_session(data, tool=None, threads=None):
    import onnxruntime as ort

    import amanda
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if tool is None:
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    with amanda.apply(tool):
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def onnx_counting(name, data, feeds, repeats, runs, warmup=2):
    """The two counters on every node of one ONNX model vs its plain session."""
    import numpy as np
    import onnx
    nodes = len(onnx.load_from_string(data).graph.node)
    sessions = {"plain": _ort_session(data, threads=THREADS)}
    tools = {}
    for config, none in COUNTERS:
        tools[config] = _counter(none)
        sessions[config] = _ort_session(data, tools[config], threads=THREADS)
    reference = sessions["plain"].run(None, feeds)
    outputs, extra = onnx_with_observed_outputs(data)
    floor = _ort_session(outputs, threads=THREADS)
    for config, tool in tools.items():
        check_count(f"{name} analysis ({config})", tool.points, nodes)
        got = sessions[config].run(None, feeds)
        assert all(np.array_equal(a, b) for a, b in zip(got, reference)), config
        check_count(f"{name} one run ({config})", tool.calls, nodes)
        tool.calls = 0

    def timed(session):
        run = session.run

        def step(n):
            start = time.perf_counter()
            for _ in range(n):
                run(None, feeds)
            return time.perf_counter() - start
        return step

    steps = {c: timed(s) for c, s in sessions.items()}
    steps[FETCH_FLOOR] = timed(floor)
    times = interleave(steps, repeats, runs, warmup)
    total = (warmup + repeats) * runs
    for config, tool in tools.items():
        check_count(f"{name} timed runs ({config})", tool.calls, total * nodes)
    summary = harness.summarize(times, "plain")
    rows = {c: _row(summary, "plain", c, nodes) for c in tools}
    rows[FETCH_FLOOR] = _row(summary, "plain", FETCH_FLOOR, None)
    return {"backend": "onnx", "model": name, "ops": nodes, "repeats": repeats, "runs": runs,
            "observed_tensors": extra, "python_call_us": python_call_us(),
            "rows": rows, "times_s": times}


def onnx_with_observed_outputs(data):
    """The model with every computed tensor a node reads as an extra graph
    output (what the default-selection counter fetches): plain onnxruntime's
    price for handing those tensors out, no amanda involved. Returns
    ``(model bytes, how many outputs were added)``."""
    import onnx
    model = onnx.shape_inference.infer_shapes(onnx.load_from_string(data))
    graph = model.graph
    known = {v.name: v for v in graph.value_info}
    skip = {i.name for i in graph.input} | {i.name for i in graph.initializer} | \
        {o.name for o in graph.output}
    added = 0
    for node in graph.node:
        for name in node.input:
            if name and name not in skip and name in known:
                graph.output.append(known[name])
                skip.add(name)
                added += 1
    return model.SerializeToString(), added


def python_call_us(calls=100000):
    """µs per call of an empty Python method taking ``*tensors``: the floor
    of one routine call."""
    tool = _counter(True)
    count = tool.count
    best = None
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            count()
        elapsed = (time.perf_counter() - start) / calls * 1e6
        best = elapsed if best is None else min(best, elapsed)
    return best


def onnx_switching(name, data, feeds, repeats, runs, warmup=2):
    """A session created and run once per step: plain vs inside a new scope."""
    import numpy as np

    import amanda
    tools = {"scope per step, analysis-only": _analysis_only(),
             "scope per step, count inputs=[]": _counter(True)}
    first = {}
    reference = _ort_session(data).run(None, feeds)
    for config, tool in tools.items():
        start = time.perf_counter()
        session = _ort_session(data, tool)
        first[config] = time.perf_counter() - start
        got = session.run(None, feeds)
        assert all(np.array_equal(a, b) for a, b in zip(got, reference)), config

    def plain(n):
        start = time.perf_counter()
        for _ in range(n):
            _ort_session(data).run(None, feeds)
        return time.perf_counter() - start

    def scoped(tool):
        def step(n):
            start = time.perf_counter()
            for _ in range(n):
                with amanda.apply(tool):
                    _ort_session_plain(data).run(None, feeds)
            return time.perf_counter() - start
        return step

    steps = {"plain session per step": plain}
    steps.update((c, scoped(t)) for c, t in tools.items())
    counter = tools["scope per step, count inputs=[]"]
    counter.calls = 0
    nodes = counter.points
    times = interleave(steps, repeats, runs, warmup)
    check_count(f"{name} switching", counter.calls, (warmup + repeats) * runs * nodes)
    summary = harness.summarize(times, "plain session per step")
    return {"backend": "onnx", "model": name, "repeats": repeats, "runs": runs,
            "first_scope_creation_ms": {c: s * 1e3 for c, s in first.items()},
            "amanda_work_ms": amanda_work_ms(data, tools["scope per step, analysis-only"]),
            "rows": {c: _row(summary, "plain session per step", c, None) for c in tools},
            "times_s": times}


def amanda_work_ms(data, tool, samples=21, number=20):
    """Median ms of what amanda itself adds to a step on a cache hit: entering
    and leaving the scope and finding the instrumented model (the model's
    SHA-256 and the cache lookup), without creating the session."""
    import statistics

    import amanda
    from amanda import controls
    from amanda.runtime.onnx.session import _instrumented
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(number):
            with amanda.apply(tool):
                _instrumented(controls.state.sessions[-1], data)
        times.append((time.perf_counter() - start) / number * 1e3)
    return statistics.median(times)


def _ort_session_plain(data):
    import onnxruntime as ort
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


# -- TensorFlow ----------------------------------------------------------------------------

def mobilenet_graph(size=224):
    """(graph, input placeholder, logits, feed) of Keras MobileNetV2, batch 1."""
    import numpy as np
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.random.set_seed(0)
        model = tf.keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3))
        x = tf.compat.v1.placeholder(tf.float32, [1, size, size, 3], name="images")
        logits = model(x, training=False)
        init = tf.compat.v1.global_variables_initializer()
    feed = np.random.default_rng(0).random((1, size, size, 3), dtype=np.float32)
    return graph, x, logits, init, feed


def executed_ops(fetch, fed=()):
    """Names of the ops a run of ``fetch`` executes in the user's graph: its
    ancestors through data and control edges, a fed tensor's producer cut
    off (a fed placeholder gets no point)."""
    fed = {t.name for t in fed}
    seen, stack = set(), [fetch.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs if t.name not in fed)
        stack.extend(op.control_inputs)
    return seen


def tf_counting(repeats, runs, warmup=2, size=224, build=None, model=None):
    """The two counters on every op of a ``Session`` graph (Keras
    MobileNetV2 at ``size``, or ``build()`` -> ``(graph, input, output,
    init op, fed array)`` named ``model``) vs the plain session."""
    import numpy as np
    import tensorflow as tf

    import amanda
    graph, x, logits, init, feed = build() if build is not None else mobilenet_graph(size)
    model = model or f"MobileNetV2 {size}x{size}"
    ran = executed_ops(logits, fed=[x])
    expected = len(ran)
    tools = {config: _counter(none) for config, none in COUNTERS}
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        feeds = {x: feed}
        reference = session.run(logits, feeds)
        for config, tool in tools.items():
            with amanda.apply(tool):
                got = session.run(logits, feeds)
            assert np.array_equal(got, reference), config
            check_count(f"{model} one run ({config})", tool.calls, expected)
            tool.calls = 0

        def step(tool):
            def timed(n):
                scope = amanda.apply(tool) if tool is not None else _Nothing()
                with scope:
                    start = time.perf_counter()
                    for _ in range(n):
                        session.run(logits, feeds)
                    return time.perf_counter() - start
            return timed

        observed = [t for op in graph.get_operations() if op.name in ran for t in op.inputs
                    if _crosses(t.dtype)]
        observed = list({t.ref(): t for t in observed}.values())

        def fetch_all(n):
            start = time.perf_counter()
            for _ in range(n):
                session.run([logits, *observed], feeds)
            return time.perf_counter() - start

        steps = {"plain": step(None)}
        steps.update((c, step(t)) for c, t in tools.items())
        steps[FETCH_FLOOR] = fetch_all
        times = interleave(steps, repeats, runs, warmup)
    total = (warmup + repeats) * runs
    for config, tool in tools.items():
        check_count(f"{model} timed runs ({config})", tool.calls, total * expected)
    summary = harness.summarize(times, "plain")
    rows = {c: _row(summary, "plain", c, expected) for c in tools}
    rows[FETCH_FLOOR] = _row(summary, "plain", FETCH_FLOOR, None)
    return {"backend": "tf", "model": model, "ops": expected,
            "graph_ops": len(graph.get_operations()), "repeats": repeats, "runs": runs,
            "observed_tensors": len(observed),
            "observed_mib": sum(_nbytes(t) for t in observed) / 2 ** 20,
            "python_call_us": python_call_us(), "rows": rows, "times_s": times}


def _crosses(dtype):
    from amanda.runtime.tensorflow.hosting import _crosses_to_python
    return _crosses_to_python(dtype)


def _nbytes(tensor):
    from amanda.runtime.tensorflow.observe import _nbytes
    return _nbytes(tensor)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- report --------------------------------------------------------------------------------

def render(results, machine):
    lines = ["# amanda counting routines and per-scope switching", "",
             "Medians over interleaved repeats in one process; ratio to the plain run of the "
             "same row (min–max: the fastest and slowest sample over the plain median; "
             "fastest / fastest: the fastest sample over the plain run's fastest). Goals "
             f"(issue 14): a counter before every op ≤ {GOALS['count']}×; one `apply` scope "
             f"per step on a cache hit ≤ {GOALS['switch']}×. µs per routine: (counter − "
             "plain) / routines a run.", "",
             "| backend | model | ops a run | configuration | plain ms | ms | ratio × "
             "| min–max × | fastest / fastest × | µs per routine | goal | met |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---|---|"]
    for result in results:
        switching = "first_scope_creation_ms" in result
        goal = GOALS["switch" if switching else "count"]
        for config, row in result["rows"].items():
            per = row["us_per_routine"]
            floor = config == FETCH_FLOOR
            lines.append(
                f"| {result['backend']} | {result['model']} | {result.get('ops', '')} | "
                f"{config} | {row['plain_ms']:.3f} | {row['ms']:.3f} | {row['ratio']:.2f} | "
                f"{row['min_ratio']:.2f}–{row['max_ratio']:.2f} | {row['best_ratio']:.2f} | "
                f"{'' if per is None else f'{per:.2f}'} | {'' if floor else f'≤ {goal}'} | "
                f"{'' if floor else ('yes' if row['ratio'] <= goal else 'no')} |")
    lines.append("")
    for result in results:
        if "first_scope_creation_ms" in result:
            firsts = ", ".join(f"{c}: {ms:.1f} ms" for c, ms in
                               result["first_scope_creation_ms"].items())
            lines.append(f"Switching, ONNX {result['model']}: one step = create an "
                         "`InferenceSession` from the model's bytes and run it once, the "
                         "instrumented one inside a new `apply` scope with the same tool "
                         f"(cache hit); the first scope's session creation (cache miss): "
                         f"{firsts}. amanda's own work per step on a cache hit (scope "
                         "entry and exit, the model's SHA-256, the cache lookup): "
                         f"{result['amanda_work_ms']:.3f} ms.")
            continue
        call = result["python_call_us"]
        floor = 1 + result["ops"] * call / 1e3 / result["rows"]["count, inputs=[]"]["plain_ms"]
        observed = result["observed_tensors"]
        size = f", {result['observed_mib']:.0f} MiB" if "observed_mib" in result else ""
        lines.append(f"Floors, {result['backend']} {result['model']}: an empty Python call "
                     f"costs {call:.3f} µs here, so {result['ops']} routine calls alone make "
                     f"{floor:.2f}× the plain run; \"{FETCH_FLOOR}\" fetches the "
                     f"{observed} computed tensors the ops read{size} (no budget).")
    lines += ["", "Counts checked: every counter is called once per op a run executes "
              "(a mismatch fails the suite).", "", harness.machine_markdown(machine), ""]
    return "\n".join(lines)


def run(repeats=None, quick=False, log=print):
    """Run the suite. Returns ``(markdown, raw)``."""
    import onnxruntime as ort
    start = harness.cpu_snapshot()
    warmup = 1 if quick else 2
    results = []
    for name in ONNX_MODELS:
        data, feeds = onnx_export(name)
        n = repeats or (3 if quick else 31)
        runs = 5 if quick else 50
        log(f"[{NAME}] ONNX {name}: {n} repeats x 3 configs x {runs} runs ...")
        results.append(onnx_counting(name, data, feeds, n, runs, warmup))
    name = ONNX_MODELS[0]
    data, feeds = onnx_export(name)
    n = repeats or (3 if quick else 21)
    runs = 2 if quick else 5
    log(f"[{NAME}] ONNX {name} switching: {n} repeats x 3 configs x {runs} steps ...")
    results.append(onnx_switching(name, data, feeds, n, runs, warmup))
    n = repeats or (2 if quick else 11)
    runs = 2 if quick else 5
    log(f"[{NAME}] TF MobileNetV2: {n} repeats x 3 configs x {runs} runs ...")
    results.append(tf_counting(n, runs, warmup))
    load = harness.foreign_load(start, harness.cpu_snapshot())
    import tensorflow as tf
    machine = harness.machine_info(onnxruntime=ort.__version__, tensorflow=tf.__version__)
    raw = {"suite": NAME, "machine": machine, "results": results,
           "other_processes_cores": load}
    return render(results, machine), raw
