"""Built-in workloads: a model, example inputs and one training step.

The CLI, the demo and the benchmarks name models by a short *spec* string and
get back a :class:`Workload`:

* a built-in name (``cnn``, ``bert``, ``gpt2``, ``gpt2-small``, ``resnet50``,
  ``vit``, ``rnn``; see :func:`available`);
* ``path/to/file.py:factory``, where ``factory()`` returns ``(model, inputs)``
  with ``inputs`` a tensor or a tuple of positional inputs.

* ``keras:NAME[:SIZE]``: a Keras application (``keras:resnet50``,
  ``keras:mobilenetv2:96``; ``weights=None``, input ``(1, SIZE, SIZE, 3)``,
  SIZE 224 by default) or ``keras:cnn`` (the tutorial CNN in Keras), built in
  a ``tf.compat.v1`` graph with its loss and weight gradients;
* ``path/to/model.onnx``: an ONNX model (needs :mod:`amanda.runtime.onnx`).

Kinds of spec other than built-in names plug in as *resolvers*
(:func:`register_resolver`): a predicate on the spec string and a loader
returning a :class:`Workload`, tried in order after the built-in names.

Every workload is built under ``torch.manual_seed(0)`` and put in ``eval()``
mode, so two loads give the same weights and inputs and no dropout noise.
Importing this module imports no framework; torch and transformers load when a
workload is built.

Example::

    from amanda import models
    work = models.load("cnn")
    loss = work.run()          # forward, scalar loss, backward
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from amanda.runtime import backends

SEED = 0


@dataclasses.dataclass
class Workload:
    """A model ready to run one step.

    Attributes:
        name: the spec it was loaded from.
        model: the model object (a ``torch.nn.Module`` for PyTorch workloads).
        inputs: tuple of positional inputs for ``model``.
        step: ``step(model, inputs)`` runs forward, a scalar loss and backward,
            and returns the loss.
        framework: the backend the model runs on (``"pytorch"``,
            ``"tensorflow"``, ``"onnx"``).
        forward_fn: ``forward_fn(model, inputs)`` runs the forward pass only
            and returns the first output as a NumPy array (None: the PyTorch
            default, :func:`default_forward`).
    """

    name: str
    model: Any
    inputs: tuple
    step: Callable[[Any, tuple], Any]
    framework: str = "pytorch"
    forward_fn: Callable[[Any, tuple], Any] = None

    def run(self):
        """Run one step (forward + loss + backward) and return the loss."""
        return self.step(self.model, self.inputs)

    def forward(self, inputs=None):
        """Run the forward pass on ``inputs`` (default: the workload's) and
        return the first floating-point output as a NumPy array."""
        inputs = self.inputs if inputs is None else tuple(inputs)
        return (self.forward_fn or default_forward)(self.model, inputs)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A built-in model: how to build it, its inputs and its step.

    Attributes:
        name: the spec name (``"bert"``).
        description: one line for ``amanda models`` and ``--help``.
        build_model: ``build_model()`` returns the model.
        build_inputs: ``build_inputs()`` returns a tuple of positional inputs.
        step: ``step(model, inputs)``; :func:`default_step` unless the model
            needs another loss.
    """

    name: str
    description: str
    build_model: Callable[[], Any]
    build_inputs: Callable[[], tuple]
    step: Callable[[Any, tuple], Any] = None

    def load(self):
        """Build the workload: seeded, model in ``eval()`` mode."""
        import torch
        torch.manual_seed(SEED)
        model = self.build_model()
        model.eval()
        inputs = self.build_inputs()
        return Workload(self.name, model, tuple(inputs), self.step or default_step)


# -- steps ---------------------------------------------------------------------

def first_tensor(output):
    """The first floating-point tensor in a model output: the tensor itself, the
    first of a tuple/list, or the first value of a dict (e.g. a transformers
    ``ModelOutput``, whose first value is ``last_hidden_state``).

    Raises:
        ValueError: the output holds no floating-point tensor.
    """
    import torch
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            return output
    elif isinstance(output, dict):
        for value in output.values():
            try:
                return first_tensor(value)
            except ValueError:
                continue
    elif isinstance(output, (tuple, list)):
        for value in output:
            try:
                return first_tensor(value)
            except ValueError:
                continue
    raise ValueError(f"model output holds no floating-point tensor: {type(output).__name__}")


def default_forward(model, inputs):
    """Forward without autograd; the first floating-point output as NumPy."""
    import torch
    with torch.no_grad():
        return first_tensor(model(*inputs)).detach().cpu().numpy()


def default_step(model, inputs):
    """Forward, loss = ``first_tensor(output).sum()``, backward. Returns the loss."""
    loss = first_tensor(model(*inputs)).sum()
    loss.backward()
    return loss


# -- built-in models ---------------------------------------------------------------

def tutorial_cnn(functional_relu=False):
    """The CNN of the amanda tutorial (``ConvNeuralNet(num_classes=10)``).

    With ``functional_relu`` its ReLU is a ``torch.relu`` call in ``forward``
    instead of an ``nn.ReLU`` module (invisible to module hooks).
    """
    import torch
    from torch import nn

    class ConvNeuralNet(nn.Module):
        def __init__(self, num_classes=10):
            super().__init__()
            self.conv_layer1 = nn.Conv2d(in_channels=3, out_channels=32, kernel_size=3)
            self.conv_layer2 = nn.Conv2d(in_channels=32, out_channels=32, kernel_size=3)
            self.max_pool1 = nn.MaxPool2d(kernel_size=2, stride=2)
            self.conv_layer3 = nn.Conv2d(in_channels=32, out_channels=64, kernel_size=3)
            self.conv_layer4 = nn.Conv2d(in_channels=64, out_channels=64, kernel_size=3)
            self.max_pool2 = nn.MaxPool2d(kernel_size=2, stride=2)
            self.fc1 = nn.Linear(1600, 128)
            if not functional_relu:
                self.relu1 = nn.ReLU()
            self.fc2 = nn.Linear(128, num_classes)

        def forward(self, x):
            out = self.conv_layer1(x)
            out = self.conv_layer2(out)
            out = self.max_pool1(out)
            out = self.conv_layer3(out)
            out = self.conv_layer4(out)
            out = self.max_pool2(out)
            out = out.reshape(out.size(0), -1)
            out = self.fc1(out)
            out = torch.relu(out) if functional_relu else self.relu1(out)
            return self.fc2(out)

    return ConvNeuralNet()


def _rand(*shape):
    def build():
        import torch
        return (torch.rand(shape),)
    return build


def _token_ids(length, vocab_size):
    def build():
        import torch
        return (torch.randint(0, vocab_size, (1, length)),)
    return build


def _hf(model_class, config_class, **config):
    """A transformers model built from its config: random weights, no hub."""
    def build():
        import transformers
        cfg = getattr(transformers, config_class)(**config)
        return getattr(transformers, model_class)(cfg)
    return build


def _rnn():
    from torch import nn
    return nn.RNN(128, 128, 4)


BERT_VOCAB = 30522
GPT2_VOCAB = 50257

BUILTIN = {spec.name: spec for spec in [
    ModelSpec("cnn", "the tutorial CNN: 4 conv, 2 max-pool, 2 linear; input (1, 3, 32, 32)",
              tutorial_cnn, _rand(1, 3, 32, 32)),
    ModelSpec("bert", "BertModel(BertConfig()), random weights; token ids (1, 8)",
              _hf("BertModel", "BertConfig"), _token_ids(8, BERT_VOCAB)),
    ModelSpec("gpt2", "GPT2Model(GPT2Config()), full size, random weights; token ids (1, 8)",
              _hf("GPT2Model", "GPT2Config"), _token_ids(8, GPT2_VOCAB)),
    ModelSpec("gpt2-small", "GPT2Model with 2 layers, n_embd 128, 4 heads; token ids (1, 16)",
              _hf("GPT2Model", "GPT2Config", n_layer=2, n_embd=128, n_head=4),
              _token_ids(16, GPT2_VOCAB)),
    ModelSpec("resnet50", "ResNetModel(ResNetConfig()), random weights; input (1, 3, 224, 224)",
              _hf("ResNetModel", "ResNetConfig"), _rand(1, 3, 224, 224)),
    ModelSpec("vit", "ViTModel(ViTConfig()), random weights; input (1, 3, 224, 224)",
              _hf("ViTModel", "ViTConfig"), _rand(1, 3, 224, 224)),
    ModelSpec("rnn", "nn.RNN(128, 128, num_layers=4); input (16, 2, 128)",
              _rnn, _rand(16, 2, 128)),
]}


# -- resolvers ---------------------------------------------------------------------

class ModelSpecError(ValueError):
    """A spec string names no model this module can load."""


_RESOLVERS = []  # (name, matches(spec) -> bool, load(spec) -> Workload)


def register_resolver(name, matches, load):
    """Add a kind of spec, tried after the built-in names in registration order.

    Args:
        name: shown in error messages (``"python factory"``).
        matches: ``matches(spec)`` says whether this resolver handles ``spec``.
        load: ``load(spec)`` returns a :class:`Workload` or raises
            :class:`ModelSpecError`.
    """
    _RESOLVERS.append((name, matches, load))


def _is_python_factory(spec):
    path, sep, func = spec.rpartition(":")
    return bool(sep) and path.endswith(".py") and func.isidentifier()


def _load_python_factory(spec):
    path, _, func = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ModelSpecError(f"model file not found: {path}")
    import sys

    import torch
    # imported as `python file.py` would run it: its folder first on sys.path,
    # so it can import its sibling modules (kept there: the model may import
    # more of them lazily), and registered in sys.modules (dataclasses, pickle)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = "_amanda_user_model_" + os.path.splitext(os.path.basename(path))[0]
    module = backends.load_source(module_name, path)
    factory = getattr(module, func, None)
    if not callable(factory):
        raise ModelSpecError(f"{path} has no callable {func!r}")
    torch.manual_seed(SEED)
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ModelSpecError(f"{spec}: {func}() must return (model, inputs), "
                             f"got {type(result).__name__}")
    model, inputs = result
    if isinstance(model, torch.nn.Module):
        model.eval()
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return Workload(spec, model, tuple(inputs), default_step)


register_resolver("python factory (path/to/file.py:factory)", _is_python_factory,
                  _load_python_factory)


# -- Keras applications in tf.compat.v1 graphs -----------------------------------

KERAS_DEFAULT_SIZE = 224


def _is_keras(spec):
    return spec.startswith("keras:") and bool(spec[len("keras:"):])


def _keras_cnn(size):
    """The tutorial CNN in Keras (channels last)."""
    import tensorflow as tf
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((size, size, 3)),
        layers.Conv2D(32, 3), layers.Conv2D(32, 3), layers.MaxPooling2D(2),
        layers.Conv2D(64, 3), layers.Conv2D(64, 3), layers.MaxPooling2D(2),
        layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(10)])


def keras_applications():
    """Lower-case name -> constructor of every ``tf.keras.applications`` model."""
    import tensorflow as tf
    apps = tf.keras.applications
    return {name.lower(): getattr(apps, name) for name in dir(apps)
            if name[:1].isupper() and callable(getattr(apps, name))}


class KerasGraphModel:
    """A Keras model called on a placeholder in its own ``tf.compat.v1`` graph.

    Attributes:
        graph, session: the graph and a session with initialised variables.
        keras_model: the Keras model.
        x, y: input placeholder and output tensor.
        loss: ``reduce_sum(y)``; grads: its gradients w.r.t. the trainable weights.
        variables: the ``tf.Variable`` objects behind those weights.
    """

    def __init__(self, build, input_shape):
        import tensorflow as tf
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.keras.utils.set_random_seed(SEED)
            self.x = tf.compat.v1.placeholder(tf.float32, input_shape, name="x")
            self.keras_model = build()
            self.y = self.keras_model(self.x)
            self.loss = tf.reduce_sum(self.y, name="loss")
            weights = self.keras_model.trainable_weights
            self.grads = tf.compat.v1.gradients(self.loss, weights)
            self.variables = [w.value for w in weights]
            init = tf.compat.v1.variables_initializer([w.value for w in self.keras_model.weights])
        self.session = tf.compat.v1.Session(graph=self.graph)
        self.session.run(init)


def _keras_step(model, inputs):
    values = model.session.run([model.loss] + list(model.grads), {model.x: inputs[0]})
    return values[0]


def _keras_forward(model, inputs):
    return model.session.run(model.y, {model.x: inputs[0]})


def _load_keras(spec):
    name, _, size = spec[len("keras:"):].partition(":")
    name = name.lower()
    if size and not size.isdigit():
        raise ModelSpecError(f"{spec}: the size after the name must be an int (keras:NAME:SIZE)")
    size = int(size) if size else (32 if name == "cnn" else KERAS_DEFAULT_SIZE)
    import tensorflow  # noqa: F401  (a missing one is reported by the caller: an extra)
    if name == "cnn":
        build = lambda: _keras_cnn(size)
    else:
        apps = keras_applications()
        if name not in apps:
            raise ModelSpecError(f"{spec}: no Keras application {name!r}; choose cnn or one "
                                 f"of {', '.join(sorted(apps))}")
        build = lambda: apps[name](weights=None, input_shape=(size, size, 3))
    import numpy as np
    model = KerasGraphModel(build, [1, size, size, 3])
    inputs = (np.random.RandomState(SEED).rand(1, size, size, 3).astype(np.float32),)
    return Workload(spec, model, inputs, _keras_step, framework="tensorflow",
                    forward_fn=_keras_forward)


register_resolver("Keras model (keras:resnet50, keras:cnn, keras:NAME:SIZE)", _is_keras,
                  _load_keras)


# -- ONNX files ----------------------------------------------------------------------

_ONNX_RUNTIME = "amanda.runtime.onnx"


def _is_onnx(spec):
    return spec.endswith(".onnx")


def onnx_runtime_available():
    """Whether amanda's ONNX runtime (:mod:`amanda.runtime.onnx`) is installed."""
    return backends.installed(_ONNX_RUNTIME)


def _onnx_feeds(model):
    """Random inputs for an ONNX model's graph inputs (unknown dims: 1)."""
    import numpy as np
    from onnx import helper
    rng = np.random.RandomState(SEED)
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor_type.shape.dim]
        if dtype.kind == "f":
            feeds[value.name] = rng.rand(*shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[value.name] = rng.randint(0, 2, size=shape).astype(dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype)
    return feeds


def _onnx_forward(model, inputs):
    import numpy as np
    import onnxruntime
    # created here so an enclosing amanda.apply(...) instruments it
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    outputs = session.run(None, inputs[0])
    for value in outputs:
        if np.asarray(value).dtype.kind == "f":
            return np.asarray(value)
    return np.asarray(outputs[0])


def _load_onnx(spec):
    if not os.path.isfile(spec):
        raise ModelSpecError(f"ONNX file not found: {spec}")
    if not onnx_runtime_available():
        raise ModelSpecError(f"{spec}: running ONNX models needs amanda's ONNX runtime "
                             f"({_ONNX_RUNTIME}), which is not installed in this tree yet")
    import onnx
    import onnxruntime  # noqa: F401  (imported now so amanda.apply instruments its sessions)
    model = onnx.load(spec)
    # ONNX has no backward: a step is one inference
    return Workload(spec, model, (_onnx_feeds(model),), _onnx_forward, framework="onnx",
                    forward_fn=_onnx_forward)


register_resolver("ONNX file (path/to/model.onnx)", _is_onnx, _load_onnx)


def spec_kinds():
    """The names of the registered kinds of spec besides built-in names."""
    return [name for name, _, _ in _RESOLVERS]


def available():
    """The built-in model names with their one-line descriptions."""
    return {name: spec.description for name, spec in BUILTIN.items()}


def check(spec):
    """Raise :class:`ModelSpecError` unless a built-in name or a resolver
    matches ``spec`` (without building anything)."""
    if spec in BUILTIN or any(matches(spec) for _, matches, _ in _RESOLVERS):
        return
    kinds = ", ".join(name for name, _, _ in _RESOLVERS)
    raise ModelSpecError(f"unknown model {spec!r}: choose a built-in model "
                         f"({', '.join(BUILTIN)}) or a {kinds}")


def load(spec):
    """Build the workload a spec string names.

    Args:
        spec: a built-in name or a string some registered resolver matches.

    Returns:
        A :class:`Workload`.

    Raises:
        ModelSpecError: no built-in name or resolver matches ``spec``.
    """
    check(spec)
    builtin = BUILTIN.get(spec)
    if builtin is not None:
        return builtin.load()
    loader = next(load for _, matches, load in _RESOLVERS if matches(spec))
    return loader(spec)
