"""Peak memory of an observe-everything tool (the paper's Fig. 13 quantity).

Each (backend, model, batch, configuration) runs in a fresh process: build
the model, run ``STEPS`` steps either plainly or inside ``amanda.apply`` of a
tool whose routines observe every op (they return None), and report the
process's peak resident set size (``ru_maxrss``) and its size after the model
was built. The ratio is peak over vanilla peak; the increment ("step") is
what the steps added above the built model, which isolates activations from
imports and weights.

Backends and steps:

* ``torch``: PyTorch eager training step (forward, ``.sum()`` loss,
  backward); transformers BERT (6 layers, 128 tokens) and ResNet-50;
  routines before and after every forward and backward op.
* ``tf``: ``tf.compat.v1.Session.run`` of a training step (forward, summed
  loss, ``tf.compat.v1.gradients`` w.r.t. every weight); a Keras BERT-like
  encoder (6 layers, hidden 768, 12 heads, 128 tokens) and
  ``tf.keras.applications.ResNet50``; routines at the same four points
  (backward points are gradient ops mapped to their forward ops). The
  session, the graph and the rewrite amanda makes of it are built before
  "built" is read.
* ``onnx``: ``onnxruntime.InferenceSession.run`` (forward only) of the ONNX
  export of the same transformers BERT and ResNet-50 (exported once, cached
  in the temp directory); routines before and after every node, called after
  the run on onnxruntime's output buffers when the observed tensors fit
  amanda's ``observation_budget`` (64 MiB by default; both models exceed
  it, so by default their routines run inside the run, right after each
  node, on copies), with every tensor fetched whatever its size (the budget
  lifted), or inside the run (``hosted_observation()``).

Run: ``python -m benchmarks.run --only memory`` (or ``python -m
benchmarks.memory``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

NAME = "memory"
STEPS = 3
OBSERVE = "observe (4 points)"
OBSERVE_HOSTED = "observe, hosted_observation()"
OBSERVE_FETCHED = "observe, all fetched (no observation_budget)"
CONFIGS = {"torch": ("vanilla", OBSERVE), "tf": ("vanilla", OBSERVE),
           "onnx": ("vanilla", OBSERVE, OBSERVE_FETCHED, OBSERVE_HOSTED)}
CASES = (("torch", "BERT (6 layers)", "bert", (1, 8)),
         ("torch", "ResNet-50", "resnet50", (1, 8)),
         ("tf", "BERT-like Keras encoder (6 layers)", "bert", (1, 8)),
         ("tf", "Keras ResNet50", "resnet50", (1, 8)),
         ("onnx", "BERT (6 layers)", "bert", (1, 8)),
         ("onnx", "ResNet-50", "resnet50", (1, 8)))
SEQ = 128
ONNX_CACHE = os.path.join(tempfile.gettempdir(), "amanda-benchmarks-memory")


def _build(model, batch):
    """PyTorch: (module, input) of a transformers model."""
    import torch
    if model == "bert":
        from transformers import BertConfig, BertModel
        config = BertConfig(num_hidden_layers=6)
        return BertModel(config), torch.randint(0, config.vocab_size, (batch, SEQ))
    from transformers import ResNetConfig, ResNetModel
    return ResNetModel(ResNetConfig()), torch.randn(batch, 3, 224, 224)


def _keras_bert(layers_=6, hidden=768, heads=12, vocab=30522, seq=SEQ):
    """A BERT-like encoder of Keras layers: embeddings, then post-LN blocks."""
    import tensorflow as tf
    layers = tf.keras.layers
    tokens = tf.keras.Input((seq,), dtype="int32")
    positions = layers.Embedding(seq, hidden)(tf.range(seq)[None])
    x = layers.LayerNormalization()(layers.Embedding(vocab, hidden)(tokens) + positions)
    for _ in range(layers_):
        attended = layers.MultiHeadAttention(num_heads=heads, key_dim=hidden // heads)(x, x)
        x = layers.LayerNormalization()(x + attended)
        ff = layers.Dense(hidden)(layers.Dense(4 * hidden, activation="gelu")(x))
        x = layers.LayerNormalization()(x + ff)
    return tf.keras.Model(tokens, x)


def _build_tf(model, batch):
    """TensorFlow: (graph, feed_fn(placeholder) -> array, build_fn) of a Keras model."""
    import numpy as np
    import tensorflow as tf
    if model == "bert":
        return _keras_bert, (batch, SEQ), tf.int32, \
            lambda shape: np.random.default_rng(0).integers(0, 30522, shape, dtype=np.int32)
    return (lambda: tf.keras.applications.ResNet50(weights=None), (batch, 224, 224, 3),
            tf.float32, lambda shape: np.random.default_rng(0).random(shape, dtype=np.float32))


def _observer(backward=True):
    import amanda

    class ObserveAll(amanda.Tool):
        """Routines before and after every op (and backward op), each returning None."""

        def __init__(self):
            super().__init__()
            self.calls = 0
            self.add_inst_for_op(self._forward, require_outputs=True)
            if backward:
                self.add_inst_for_op(self._backward, backward=True, require_outputs=True)

        def _forward(self, context):
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)

        def _backward(self, context):
            context.insert_before_backward_op(self.look)
            context.insert_after_backward_op(self.look)

        def look(self, *tensors):
            self.calls += 1

    return ObserveAll()


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_kib():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _built():
    """Size once the model is built; restarts the peak so the steps' own shows.

    Building may pass through a transient peak (onnxruntime's session
    creation, amanda's rewrite) above where it settles. Linux resets the
    high-water mark (``VmHWM``) when "5" is written to ``/proc/self/clear_refs``;
    where that is unavailable, the build's peak stays in (``ru_maxrss``).
    """
    try:
        # RSS first: the high-water mark read after it is at least as high
        # (reading them the other way round, a page touched in between made
        # "built" exceed the build's peak)
        built = _status_kib("VmRSS")
        build_peak = _status_kib("VmHWM")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return {"built_kib": built, "build_peak_kib": build_peak}
    except OSError:
        return {"built_kib": _peak_kib(), "build_peak_kib": _peak_kib()}


def _step_peak_kib():
    try:
        return _status_kib("VmHWM")
    except OSError:
        return _peak_kib()


def _scope(tool):
    import amanda
    return amanda.apply(tool) if tool is not None else contextlib.nullcontext()


def _one_torch(model, batch, config):
    import torch

    from benchmarks.eager import first_tensor
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    net, inputs = _build(model, batch)
    built = _built()
    tool = _observer() if config != "vanilla" else None
    with _scope(tool):
        for _ in range(STEPS):
            first_tensor(net(inputs)).sum().backward()
            net.zero_grad(set_to_none=True)
    return built, tool


def _one_tf(model, batch, config):
    import tensorflow as tf
    build, shape, dtype, make_feed = _build_tf(model, batch)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(dtype, shape, name="x")
        net = build()
        loss = tf.reduce_sum(net(x))
        # dense gradients: an embedding's IndexedSlices would be fetched as such
        grads = [tf.convert_to_tensor(g)
                 for g in tf.compat.v1.gradients(loss, net.trainable_weights)]
        init = tf.compat.v1.global_variables_initializer()
    feed = {x: make_feed(shape)}
    tool = _observer() if config != "vanilla" else None
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        with _scope(tool):
            # a first forward run: under amanda it makes the rewrite and the
            # shadow session, which belong to the build (their transient peak
            # is reported apart); vanilla makes the same run
            session.run(loss, feed)
            built = _built()
            for _ in range(STEPS):
                session.run([loss] + grads, feed)
    return built, tool


def onnx_path(model):
    """The cached ONNX export of the PyTorch model (dynamic batch, opset 17)."""
    return os.path.join(ONNX_CACHE, f"{model}.onnx")


def export_onnx(model):
    """Export ``model`` to :func:`onnx_path` (run in its own process)."""
    import onnx
    import torch

    from benchmarks.eager import first_tensor
    torch.manual_seed(0)
    net, inputs = _build(model, 1)
    net.eval()

    class FirstOutput(torch.nn.Module):
        """The model's first output (BERT's forward takes its input by keyword)."""

        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return first_tensor(self.net(x))

    path = onnx_path(model)
    os.makedirs(ONNX_CACHE, exist_ok=True)
    partial = path + ".part"
    torch.onnx.export(FirstOutput(), (inputs,), partial, dynamo=False, opset_version=17,
                      input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}})
    proto = onnx.load(partial)
    proto.ir_version = min(proto.ir_version, 10)   # what onnxruntime 1.31 loads
    onnx.save(proto, path)
    os.remove(partial)


def _onnx_feed(model, batch):
    import numpy as np
    rng = np.random.default_rng(0)
    if model == "bert":
        return {"input": rng.integers(0, 30522, (batch, SEQ), dtype=np.int64)}
    return {"input": rng.random((batch, 3, 224, 224), dtype=np.float32)}


def _one_onnx(model, batch, config):
    import onnxruntime as ort

    from amanda.runtime import onnx as amanda_onnx
    feed = _onnx_feed(model, batch)
    tool = _observer(backward=False) if config != "vanilla" else None
    hosted = amanda_onnx.hosted_observation() if config == OBSERVE_HOSTED \
        else amanda_onnx.observation_budget(1 << 62) if config == OBSERVE_FETCHED \
        else contextlib.nullcontext()
    with hosted, _scope(tool):
        session = ort.InferenceSession(onnx_path(model), providers=["CPUExecutionProvider"])
        built = _built()
        for _ in range(STEPS):
            session.run(None, feed)
    return built, tool


RUNNERS = {"torch": _one_torch, "tf": _one_tf, "onnx": _one_onnx}


def one(model, batch, config, backend="torch"):
    """Run one configuration in this process; a dict of KiB figures."""
    built, tool = RUNNERS[backend](model, batch, config)
    step_peak = _step_peak_kib()
    return dict(built, step_peak_kib=step_peak, peak_kib=max(built["build_peak_kib"], step_peak),
                routine_calls=tool.calls if tool is not None else 0)


# glibc's malloc raises its mmap threshold after a large block is freed, so
# later large tensors come from the heap, where small allocations between
# them (a routine call's Python objects) keep freed space from going back to
# the system: resident size then grows without any reference held. With a
# fixed threshold every large tensor is mapped and unmapped on its own, which
# isolates what is really kept alive.
ALLOCATORS = {"default malloc": {}, "fixed mmap threshold": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TF_CPP_MIN_LOG_LEVEL": "3"}


def _subprocess(*args, env=()):
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", *args],
                          capture_output=True, text=True, cwd=_ROOT, check=False,
                          env=dict(os.environ, **_ENV, **dict(env)))
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.memory {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _measure(backend, model, batch, config, allocator):
    out = _subprocess("--one", backend, model, str(batch), config, env=ALLOCATORS[allocator])
    return json.loads(out.strip().splitlines()[-1])


def run(repeats=None, quick=False, log=print, backends=tuple(CONFIGS)):
    """Run the suite. Returns ``(markdown, raw)``."""
    from benchmarks import harness
    results = []
    for backend, label, model, batches in CASES:
        if backend not in backends:
            continue
        if backend == "onnx" and not os.path.exists(onnx_path(model)):
            log(f"[{NAME}] exporting {model} to {onnx_path(model)} ...")
            _subprocess("--export", model)
        for allocator in ALLOCATORS:
            for batch in batches[:1] if quick else batches:
                row = {"backend": backend, "model": label, "batch": batch,
                       "allocator": allocator}
                for config in CONFIGS[backend]:
                    log(f"[{NAME}] {backend} {label} batch {batch} ({allocator}): {config} ...")
                    row[config] = _measure(backend, model, batch, config, allocator)
                results.append(row)
    machine = harness.machine_info()
    return render(results, machine), {"suite": NAME, "machine": machine, "results": results}


# ONNX observers have two points (no backward); over the observation budget
# (both models are) they run inside the run by default
LABELS = {("onnx", OBSERVE): "observe before/after every node (default: over budget, hosted)"}


def _step_kib(figures):
    """What the steps added above the built model (their own peak)."""
    return figures.get("step_peak_kib", figures["peak_kib"]) - figures["built_kib"]


def render(results, machine):
    from benchmarks import harness
    lines = ["# amanda peak memory (observe-only routines on every op)", "",
             f"{STEPS} steps per process (PyTorch eager and TF `Session` training steps, "
             "onnxruntime forward runs), MiB of resident memory. 'built': once the model "
             "(and, under amanda, its rewrite or instrumented session) was built; 'peak': "
             "the process's peak (`VmHWM`, build included); 'step': the steps' own peak "
             "above 'built' (the high-water mark is reset after the build).",
             "", "| backend | allocator | model | batch | configuration | vanilla built "
             "| observe built | vanilla peak | observe peak | × vanilla | vanilla step "
             "| observe step | × step | routine calls |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        backend = row.get("backend", "torch")
        plain = row["vanilla"]
        for config in CONFIGS[backend][1:]:
            seen = row[config]
            lines.append(
                f"| {backend} | {row['allocator']} | {row['model']} | {row['batch']} "
                f"| {LABELS.get((backend, config), config)} | {plain['built_kib'] / 1024:.0f} | {seen['built_kib'] / 1024:.0f} "
                f"| {plain['peak_kib'] / 1024:.0f} | {seen['peak_kib'] / 1024:.0f} "
                f"| {seen['peak_kib'] / plain['peak_kib']:.3f} "
                f"| {_step_kib(plain) / 1024:.0f} | {_step_kib(seen) / 1024:.0f} "
                f"| {_step_kib(seen) / max(_step_kib(plain), 1):.3f} "
                f"| {seen['routine_calls']:,} |")
    lines += ["", harness.machine_markdown(machine)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        backend, model, batch, config = sys.argv[2:6]
        print(json.dumps(one(model, int(batch), config, backend)))
    elif sys.argv[1:2] == ["--export"]:
        export_onnx(sys.argv[2])
    elif sys.argv[1:2] == ["--render"]:
        # re-render a results file (e.g. after a change of the table)
        with open(sys.argv[2]) as source:
            raw = json.load(source)
        print(render(raw["results"], raw["machine"]), end="")
    else:
        markdown, raw = run()
        print(markdown)
