"""TensorFlow graph-mode overhead: ``Session.run`` of a fwd+bwd step.

For each model (Keras ResNet50 and a Keras transformer block, random weights,
built in a ``tf.compat.v1`` graph with ``tf.compat.v1.gradients``) and each
configuration (vanilla, analysis-only tool, identity routines on every op), a
repeat enters the configuration's ``apply`` scope, makes one untimed run (the
scope's variable hand-over into the shadow session happens there), times
``runs`` further runs (cache warm), and leaves. Configurations are interleaved
round-robin and the report gives median-over-repeats ratios to vanilla.

Also measured: the first run of a fresh tool on the graph (lift, analysis,
lowering, copy and shadow session: the rewrite) against a cache-hit run, the
paper's Fig. 12 quantity, and the scope cost (variable hand-over in and out).

Switching (issue 14): one ``apply`` scope per step with the same
analysis-only tool on a cache hit, against plain steps, interleaved: Keras
ResNet50 in a ``Session`` (loss and gradients; and a training step, whose
updated variables go back to the user's session at each scope's end) and
in a ``tf.function`` (loss and gradients under a ``GradientTape``).
"""

from __future__ import annotations

import contextlib
import statistics
import time

from benchmarks import harness

NAME = "tf_graph"
# Identity routines written with amanda.portable lower to TF Identity ops; the
# same routines as Python callbacks (tf.numpy_function) are reported beside them.
TARGETS = {"analysis-only": 1.03, "identity-portable": 1.3}


def _keras_graph(build, input_shape):
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, input_shape, name="x")
        model = build()
        loss = tf.reduce_sum(model(x), name="loss")
        grads = tf.compat.v1.gradients(loss, model.trainable_weights)
        init = tf.compat.v1.global_variables_initializer()
    return graph, x, [loss] + grads, init


def resnet50():
    import tensorflow as tf
    return _keras_graph(lambda: tf.keras.applications.ResNet50(weights=None), [1, 224, 224, 3])


def transformer_block(seq=64, dim=128, heads=4):
    import tensorflow as tf
    layers = tf.keras.layers

    def build():
        inputs = tf.keras.Input((seq, dim))
        attended = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(inputs, inputs)
        hidden = layers.LayerNormalization()(inputs + attended)
        ff = layers.Dense(dim)(layers.Dense(4 * dim, activation="gelu")(hidden))
        return tf.keras.Model(inputs, layers.LayerNormalization()(hidden + ff))

    return _keras_graph(build, [8, seq, dim])


MODELS = (("Keras ResNet50", resnet50, 9, 3), ("Keras transformer block", transformer_block, 11, 20))


def _configs():
    import amanda
    from amanda.tools.identity import AnalysisOnlyTool, IdentityTool
    analysis, identity = AnalysisOnlyTool(), IdentityTool()
    native = IdentityTool(portable=True)
    return {"vanilla": contextlib.nullcontext,
            "analysis-only": lambda: amanda.apply(analysis),
            "identity-portable": lambda: amanda.apply(native),
            "identity": lambda: amanda.apply(identity)}


def _timed_runs(session, fetches, feed, enter, runs):
    with enter():
        session.run(fetches, feed)          # untimed: hand-over and, once, the rewrite
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(fetches, feed)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rewrite_times(session, fetches, feed):
    """(first run of a fresh tool, cache-hit run, scope cost) in seconds."""
    import amanda
    from amanda.tools.identity import IdentityTool
    tool = IdentityTool()
    with amanda.apply(tool):
        start = time.perf_counter()
        session.run(fetches, feed)
        first = time.perf_counter() - start
        start = time.perf_counter()
        session.run(fetches, feed)
        hit = time.perf_counter() - start
    start = time.perf_counter()
    with amanda.apply(tool):
        session.run(fetches, feed)
    scoped = time.perf_counter() - start
    return first, hit, max(scoped - hit, 0.0)


def benchmark_model(name, build, repeats, runs):
    import numpy as np
    import tensorflow as tf
    graph, x, fetches, init = build()
    feed = {x: np.random.default_rng(0).random(x.shape.as_list(), dtype=np.float32)}
    configs = _configs()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        first, hit, scope = _rewrite_times(session, fetches, feed)
        times = {k: [] for k in configs}
        for r in range(repeats):
            order = list(configs)[r % len(configs):] + list(configs)[:r % len(configs)]
            for key in order:
                times[key].append(_timed_runs(session, fetches, feed, configs[key], runs))
    summary = harness.summarize(times, "vanilla")
    return {"model": name, "ops": len(graph.get_operations()), "summary": summary,
            "repeats": repeats, "runs": runs, "first_run_s": first, "cache_hit_s": hit,
            "scope_s": scope}


SWITCH_TARGET = 1.05


def _switch_ratio(plain, scoped, steps):
    """Median of per-pair ratios: a plain step, then a step in a scope of its own."""
    plain(), scoped()    # warm: rewrite once, executors made
    ratios, plains = [], []
    for _ in range(steps):
        start = time.perf_counter()
        plain()
        middle = time.perf_counter()
        scoped()
        end = time.perf_counter()
        ratios.append((end - middle) / (middle - start))
        plains.append(middle - start)
    return statistics.median(ratios), statistics.median(plains)


def benchmark_switching(steps=15):
    """One scope per step on a cache hit: {row: (ratio, plain ms)}."""
    import amanda
    import numpy as np
    import tensorflow as tf
    from amanda.tools.identity import AnalysisOnlyTool
    tool = AnalysisOnlyTool()
    rows = {}
    graph, x, fetches, init = resnet50()
    with graph.as_default():
        train = tf.compat.v1.train.GradientDescentOptimizer(1e-6).minimize(fetches[0])
    feed = {x: np.random.default_rng(0).random(x.shape.as_list(), dtype=np.float32)}
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        for name, run in (("Session, loss + gradients", lambda: session.run(fetches, feed)),
                          ("Session, training step", lambda: session.run([fetches[0], train], feed))):
            def scoped(run=run):
                with amanda.apply(tool):
                    run()
            ratio, plain = _switch_ratio(run, scoped, steps)
            rows[name] = (ratio, plain * 1e3)
    model = tf.keras.applications.ResNet50(weights=None)
    image = tf.constant(feed[x])

    @tf.function
    def step(images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(images))
        return loss, tape.gradient(loss, model.trainable_weights)

    def scoped_call():
        with amanda.apply(tool):
            step(image)
    ratio, plain = _switch_ratio(lambda: step(image), scoped_call, steps)
    rows["tf.function, loss + gradients"] = (ratio, plain * 1e3)
    return rows


def render(results, machine):
    lines = ["# amanda TensorFlow graph-mode overhead", "",
             "`Session.run` of loss + `tf.compat.v1.gradients` w.r.t. all weights; each "
             "repeat enters the configuration's scope, makes one untimed run, then times "
             "`runs` runs (cache warm); medians over repeats, interleaved. Rewrite: the "
             "first run of a fresh identity tool (lift + analysis + lowering + copy) vs a "
             "cache-hit run; scope: variable hand-over in and out of the shadow session.",
             "", "| model | graph ops | vanilla ms | analysis-only × | identity, native × | "
             "identity, Python callbacks × | first run s | cache-hit run s | rewrite speedup × | scope cost s | target met? |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        met = all(s[k]["ratio"] <= t for k, t in TARGETS.items())
        lines.append(
            f"| {r['model']} | {r['ops']} | {s['vanilla']['median_s'] * 1e3:.1f} | "
            f"{s['analysis-only']['ratio']:.3f} | {s['identity-portable']['ratio']:.3f} | "
            f"{s['identity']['ratio']:.3f} | "
            f"{r['first_run_s']:.2f} | {r['cache_hit_s']:.3f} | "
            f"{r['first_run_s'] / r['cache_hit_s']:.1f} | {r['scope_s']:.3f} | "
            f"{'yes' if met else 'no'} |")
    switching = results[0].get("switching") if results else None
    if switching:
        lines += ["", "One `apply` scope per step (analysis-only tool, cache hit), Keras ResNet50 "
                  "batch 1: median of per-step ratios to the plain step before it.", "",
                  "| step | plain ms | scope per step × | target |", "|---|---|---|---|"]
        for name, (ratio, plain) in switching.items():
            lines.append(f"| {name} | {plain:.1f} | {ratio:.3f} | ≤ {SWITCH_TARGET} |")
    lines += ["", f"Targets: analysis-only ≤ {TARGETS['analysis-only']}×, identity ≤ "
              f"{TARGETS['identity-portable']}× (identity routines written with amanda.portable, "
              "lowered to TF Identity ops; the Python-callback column runs the same routines "
              "through tf.numpy_function and has no target).", "", harness.machine_markdown(machine), ""]
    return "\n".join(lines)


def run(repeats=None, quick=False, log=print):
    """Run the suite. Returns ``(markdown, raw)``."""
    import tensorflow as tf
    results = []
    for name, build, default_repeats, runs in MODELS:
        n = repeats or (2 if quick else default_repeats)
        log(f"[{NAME}] {name}: {n} repeats x 4 configs x {runs} runs ...")
        results.append(benchmark_model(name, build, n, 1 if quick else runs))
    log(f"[{NAME}] switching: one scope per step ...")
    results[0]["switching"] = benchmark_switching(3 if quick else 15)
    machine = harness.machine_info(tensorflow=tf.__version__)
    return render(results, machine), {"suite": NAME, "machine": machine, "results": results}
