"""Built-in workloads: a model, example inputs and one training step.

The CLI, the demo and the benchmarks name models by a short *spec* string and
get back a :class:`Workload`:

* a built-in name (``cnn``, ``bert``, ``gpt2``, ``gpt2-small``, ``resnet50``,
  ``vit``, ``rnn``; see :func:`available`);
* ``path/to/file.py:factory``, where ``factory()`` returns ``(model, inputs)``
  with ``inputs`` a tensor or a tuple of positional inputs.

Other kinds of spec (``keras:resnet50``, ``model.onnx``) plug in as
*resolvers* (:func:`register_resolver`): a predicate on the spec string and a
loader returning a :class:`Workload`, tried in order after the built-in names.

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
import importlib.util
import os
from typing import Any, Callable

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
        framework: the backend the model runs on (``"pytorch"``).
    """

    name: str
    model: Any
    inputs: tuple
    step: Callable[[Any, tuple], Any]
    framework: str = "pytorch"

    def run(self):
        """Run one step (forward + loss + backward) and return the loss."""
        return self.step(self.model, self.inputs)


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
    import torch
    module_name = "_amanda_user_model_" + os.path.splitext(os.path.basename(path))[0]
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
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
