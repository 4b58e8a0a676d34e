"""Effective path on TensorFlow graphs (tf.compat.v1, ``Session.run``): the
Keras twins of the MLP and the small CNN of tests/test_effective_path.py,
with the torch weights copied in, give the same neuron, synapse and input
masks as the torch models, through the same rule table (TF's NHWC
activations and HWIO/IO weights are moved to the canonical layouts)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.errors import ToolError  # noqa: E402
from amanda.tools.effective_path import EffectivePathTool  # noqa: E402
from tests.test_effective_path import extract, mlp, small_cnn  # noqa: E402

THETAS = (0.3, 0.5, 1.0)
layers = tf.keras.layers


class Twin:
    """A Keras model in a tf.compat.v1 graph with the weights of a torch
    model: ``graph``, placeholder ``x``, logits ``y``, ``session``."""

    def __init__(self, build, input_shape, weights):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = tf.compat.v1.placeholder(tf.float32, input_shape, name="x")
            self.model = build()
            self.y = self.model(self.x)
            variables = [w.value for w in self.model.trainable_weights]
            init = tf.compat.v1.variables_initializer([w.value for w in self.model.weights])
        self.session = tf.compat.v1.Session(graph=self.graph)
        self.session.run(init)
        for variable, value in zip(variables, weights):   # fed initializers: no new op
            self.session.run(variable.initializer, {variable.initializer.inputs[1]: value})

    def run(self, x, tool):
        with amanda.apply(tool):
            return self.session.run(self.y, {self.x: x})


def nhwc(x):
    return np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))


def keras_weights(net, flatten_chw=None):
    """The torch Sequential's weights in Keras' layouts: conv OIHW -> HWIO,
    linear (out, in) -> (in, out); the linear layer right after a flatten of
    a ``flatten_chw = (C, H, W)`` map reads its rows in NHWC order."""
    weights, flattened = [], False
    for layer in net:
        if isinstance(layer, torch.nn.Flatten):
            flattened = True
        if not isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            continue
        w = layer.weight.detach().numpy()
        if w.ndim == 4:
            w = np.transpose(w, (2, 3, 1, 0))
        elif flattened and flatten_chw is not None:
            w = np.transpose(w.T.reshape(*flatten_chw, -1), (1, 2, 0, 3)).reshape(w.shape[1], -1)
            flattened = False
        else:
            w = w.T
        weights += [w, layer.bias.detach().numpy()]
    return weights


@pytest.fixture(scope="module")
def cnn_twins():
    net = small_cnn().eval()
    twin = Twin(lambda: tf.keras.Sequential([
        tf.keras.Input((10, 10, 2)), layers.Conv2D(4, 3, padding="same"), layers.ReLU(),
        layers.MaxPool2D(2), layers.Conv2D(6, 3, strides=2), layers.ReLU(), layers.Flatten(),
        layers.Dense(10), layers.ReLU(), layers.Dense(4)]),
        [3, 10, 10, 2], keras_weights(net, flatten_chw=(6, 2, 2)))
    yield net, twin
    twin.session.close()


@pytest.fixture(scope="module")
def mlp_twins():
    net = mlp().eval()
    twin = Twin(lambda: tf.keras.Sequential([
        tf.keras.Input((12,)), layers.Dense(20), layers.ReLU(), layers.Dense(16),
        layers.ReLU(), layers.Dense(5)]), [4, 12], keras_weights(net))
    yield net, twin
    twin.session.close()


def from_hwc_order(mask, chw):
    """A flattened NHWC feature mask (last axis) in torch's CHW order."""
    c, h, w = chw
    lead = mask.shape[:-1]
    return np.moveaxis(mask.reshape(*lead, h, w, c), -1, -3).reshape(*lead, c * h * w)


def assert_same_paths(net, twin, x, theta, flatten_chw=None):
    on_torch = extract(net, torch.from_numpy(x), theta)
    on_tf = EffectivePathTool(theta=theta, output=twin.y)
    logits = twin.run(nhwc(x) if x.ndim == 4 else x, on_tf)
    np.testing.assert_allclose(logits, net(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    assert len(on_tf.paths) == len(on_torch.paths) == len(x)
    for mine, theirs in zip(on_torch.paths, on_tf.paths):
        assert theirs.unknown == [] and mine.label == theirs.label
        tf_ops = [name for name, t in theirs.types.items() if t != "bias_add"]
        renamed = {"reshape": "flatten"}
        assert [renamed.get(theirs.types[n], theirs.types[n]) for n in tf_ops] == \
            list(mine.types.values())
        after_flatten = False
        for torch_op, tf_op in zip(mine.neurons, tf_ops):
            kind = mine.types[torch_op]
            neurons = theirs.neurons[tf_op]
            if kind == "flatten":
                neurons, after_flatten = from_hwc_order(neurons, flatten_chw), True
            np.testing.assert_array_equal(neurons, mine.neurons[torch_op],
                                          err_msg=f"neurons of {tf_op}, theta {theta}")
            if kind in ("conv2d", "linear"):
                synapses = theirs.synapses[tf_op]
                if kind == "linear" and after_flatten:
                    synapses, after_flatten = from_hwc_order(synapses, flatten_chw), False
                np.testing.assert_array_equal(synapses, mine.synapses[torch_op],
                                              err_msg=f"synapses of {tf_op}, theta {theta}")
        assert len(theirs.synapses) == len(mine.synapses)
        # a BiasAdd passes its neurons through: the same mask as its MatMul/Conv2D
        names = list(theirs.types)
        for before, name in zip(names, names[1:]):
            if theirs.types[name] == "bias_add":
                np.testing.assert_array_equal(theirs.neurons[name], theirs.neurons[before])
        (pixels,) = mine.inputs.values()
        np.testing.assert_array_equal(theirs.inputs["x"], pixels)
    return on_tf


@pytest.mark.parametrize("theta", THETAS)
def test_cnn_twin_gives_the_torch_masks(cnn_twins, theta):
    net, twin = cnn_twins
    x = np.random.default_rng(2).standard_normal((3, 2, 10, 10)).astype(np.float32)
    tool = assert_same_paths(net, twin, x, theta, flatten_chw=(6, 2, 2))
    path = tool.paths[0]
    conv = next(name for name, t in path.types.items() if t == "conv2d")
    assert path.neurons[conv].shape == (4, 10, 10)          # NCHW, not NHWC
    assert path.synapses[conv].shape == (4, 2, 3, 3)        # OIHW, not HWIO


@pytest.mark.parametrize("theta", THETAS)
def test_mlp_twin_gives_the_torch_masks(mlp_twins, theta):
    net, twin = mlp_twins
    x = np.random.default_rng(1).standard_normal((4, 12)).astype(np.float32)
    tool = assert_same_paths(net, twin, x, theta)
    linear = next(name for name, t in tool.paths[0].types.items() if t == "linear")
    assert tool.paths[0].synapses[linear].shape == (20, 12)   # (out, in), not Keras' (in, out)
