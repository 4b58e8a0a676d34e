"""Effective path on TensorFlow graphs (tf.compat.v1, ``Session.run``): the
Keras twins of the MLP and the small CNN of tests/tools/test_effective_path.py,
with the torch weights copied in, give the same neuron, synapse and input
masks as the torch models, through the same rule table (TF's NHWC
activations and HWIO/IO weights are moved to the canonical layouts).

Equality is exact. The two backends' activations differ in the last bits
(TF and PyTorch sum convolutions in other orders; the logits agree to 1e-5),
and a selection is decided on float64 sums of those float32 values, so a
decision could only flip at a near-tie within rounding; the fixed inputs
here meet none, and a wrong layout or padding changes many masks."""

import itertools
from collections import Counter

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import amanda
from amanda.errors import ToolError
from amanda.tools.effective_path import EffectivePathTool
from tests.tools.test_effective_path import extract, mlp, small_cnn

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
            variables = [w.value for w in self.model.weights]   # BN statistics too
            init = tf.compat.v1.variables_initializer([w.value for w in self.model.weights])
        self.session = tf.compat.v1.Session(graph=self.graph)
        self.session.run(init)
        self.variables = variables
        if weights is not None:
            self.load(weights)

    def load(self, weights):
        for variable, value in zip(self.variables, weights):   # fed initializers: no new op
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
        tf_ops = [name for name, t in theirs.types.items() if t not in ("bias_add", "identity")]
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
        for before, name in itertools.pairwise(names):
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


class FunctionTwin:
    """The same, as an eager Keras model called through a ``tf.function``."""

    def __init__(self, model, weights):
        model.set_weights(weights)
        self.function = tf.function(lambda x: model(x))
        self.y = None   # default output: the function's last (batch, classes) op

    def run(self, x, tool):
        with amanda.apply(tool):
            return self.function(tf.constant(x)).numpy()


def test_tf_function_gives_the_torch_masks():
    net = small_cnn().eval()
    twin = FunctionTwin(tf.keras.Sequential([
        tf.keras.Input((10, 10, 2)), layers.Conv2D(4, 3, padding="same"), layers.ReLU(),
        layers.MaxPool2D(2), layers.Conv2D(6, 3, strides=2), layers.ReLU(), layers.Flatten(),
        layers.Dense(10), layers.ReLU(), layers.Dense(4)]), keras_weights(net, (6, 2, 2)))
    x = np.random.default_rng(4).standard_normal((2, 2, 10, 10)).astype(np.float32)
    assert_same_paths(net, twin, x, 0.8, flatten_chw=(6, 2, 2))


def test_the_users_graph_is_left_unchanged(cnn_twins):
    _, twin = cnn_twins
    before = [(op.name, op.type, [t.name for t in op.inputs]) for op in twin.graph.get_operations()]
    version = twin.graph.version
    x = np.random.default_rng(5).standard_normal((3, 10, 10, 2)).astype(np.float32)
    plain = twin.session.run(twin.y, {twin.x: x})
    tool = EffectivePathTool(theta=0.5, output=twin.y.op.name)   # by op name
    np.testing.assert_array_equal(twin.run(x, tool), plain)      # observe-only routines
    assert len(tool.paths) == 3
    after = [(op.name, op.type, [t.name for t in op.inputs]) for op in twin.graph.get_operations()]
    assert after == before and twin.graph.version == version


# -- Keras CNN layers: batch norm, depthwise conv, global average pooling ---------------

def bn_cnn():
    """Conv (no bias) + batch norm (eval, non-trivial statistics) + ReLU +
    depthwise conv (multiplier 2) + ReLU + global average pooling + linear."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4, eps=1e-3),
        torch.nn.ReLU(), torch.nn.Conv2d(4, 8, 3, stride=2, groups=4), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    bn = net[1]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
        bn.running_mean.uniform_(-0.3, 0.3)
        bn.running_var.uniform_(0.5, 2.0)
    return net.eval()


def bn_cnn_keras_weights(net):
    """Keras order: conv kernel; gamma, beta, moving mean, moving variance;
    depthwise kernel (HWIM: torch's (C*M, 1, H, W) with out channel c*M + m),
    bias; dense kernel (in, out), bias."""
    conv, bn, depthwise, dense = net[0], net[1], net[3], net[7]
    numpy = lambda t: t.detach().numpy()
    dw = numpy(depthwise.weight)
    return [np.transpose(numpy(conv.weight), (2, 3, 1, 0)),
            numpy(bn.weight), numpy(bn.bias), numpy(bn.running_mean), numpy(bn.running_var),
            np.transpose(dw.reshape(4, 2, 3, 3), (2, 3, 0, 1)), numpy(depthwise.bias),
            numpy(dense.weight).T, numpy(dense.bias)]


@pytest.fixture(scope="module")
def bn_twins():
    net = bn_cnn()
    twin = Twin(lambda: tf.keras.Sequential([
        tf.keras.Input((9, 9, 3)), layers.Conv2D(4, 3, padding="same", use_bias=False),
        layers.BatchNormalization(epsilon=1e-3), layers.ReLU(),
        layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2), layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dense(5)]),
        [3, 9, 9, 3], bn_cnn_keras_weights(net))
    yield net, twin
    twin.session.close()


# TF op type -> the torch op it stands for; None: no torch op of its own (the
# second half of Keras' batch norm, a layer's separate BiasAdd)
KERAS_AS_TORCH = {"conv2d": "conv2d", "mul": "batch_norm", "add": None, "relu": "relu",
                  "depthwise_conv2d": "conv2d", "bias_add": None,
                  "global_avg_pool2d": "adaptive_avg_pool2d", "linear": "linear"}


def assert_same_masks(net, twin, x, theta, as_torch):
    """Both backends' paths of ``x`` (NCHW); ``as_torch``: TF type -> the
    torch type it stands for (None: no torch op of its own). TF neurons are
    compared reshaped to the torch shape (a Mean's (C,) and a pool's (C, 1, 1))."""
    on_torch = extract(net, torch.from_numpy(x), theta)
    on_tf = EffectivePathTool(theta=theta, output=twin.y)
    logits = twin.run(nhwc(x), on_tf)
    np.testing.assert_allclose(logits, net(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(on_torch.paths, on_tf.paths, strict=True):
        assert theirs.unknown == [] and mine.unknown == [] and mine.label == theirs.label
        assert set(theirs.types.values()) == set(as_torch)
        tf_ops = [n for n, t in theirs.types.items() if as_torch[t] is not None]
        torch_ops = [n for n, t in mine.types.items() if t != "flatten"]
        assert [as_torch[theirs.types[n]] for n in tf_ops] == [mine.types[n] for n in torch_ops]
        for torch_op, tf_op in zip(torch_ops, tf_ops):
            expected = mine.neurons[torch_op]
            np.testing.assert_array_equal(theirs.neurons[tf_op].reshape(expected.shape), expected,
                                          err_msg=f"neurons of {tf_op}, theta {theta}")
            if torch_op in mine.synapses:
                np.testing.assert_array_equal(theirs.synapses[tf_op], mine.synapses[torch_op],
                                              err_msg=f"synapses of {tf_op}, theta {theta}")
        assert len(theirs.synapses) == len(mine.synapses)
        (pixels,) = mine.inputs.values()
        np.testing.assert_array_equal(theirs.inputs["x"], pixels)
        assert pixels.any()
    return on_torch, on_tf


@pytest.mark.parametrize("theta", (0.5, 1.0))
def test_keras_batch_norm_depthwise_and_global_pooling_give_the_torch_masks(bn_twins, theta):
    net, twin = bn_twins
    x = np.random.default_rng(8).standard_normal((3, 3, 9, 9)).astype(np.float32)
    on_torch, on_tf = assert_same_masks(net, twin, x, theta, KERAS_AS_TORCH)
    for mine, theirs in zip(on_torch.paths, on_tf.paths, strict=True):
        # the walk did not enter the batch norm's variables (no Rsqrt/Sub on the path)
        assert "rsqrt" not in theirs.types.values() and "sub" not in theirs.types.values()
        assert len(theirs.synapses) == 3
        depthwise = next(n for n, t in theirs.types.items() if t == "depthwise_conv2d")
        assert theirs.synapses[depthwise].shape == (8, 1, 3, 3)   # torch's grouped OIHW
        # batch norm's two halves and the layers' BiasAdds pass the neurons through
        names = list(theirs.types)
        for before, name in itertools.pairwise(names):
            if theirs.types[name] in ("mul", "add", "bias_add"):
                np.testing.assert_array_equal(theirs.neurons[name], theirs.neurons[before])


class Branches(torch.nn.Module):
    """Two convolutions concatenated on channels, ReLU, asymmetric zero
    padding, strided conv, ReLU, global average pooling, linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = torch.nn.Conv2d(2, 3, 3), torch.nn.Conv2d(2, 2, 3)
        self.pad = torch.nn.ZeroPad2d((0, 1, 2, 0))          # left, right, top, bottom
        self.c = torch.nn.Conv2d(5, 4, 3, stride=2)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.pad(torch.relu(torch.cat([self.a(x), self.b(x)], dim=1)))
        h = torch.relu(self.c(h))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


@pytest.fixture(scope="module")
def branch_twins():
    net = Branches().eval()

    def build():
        x = tf.keras.Input((9, 9, 2))
        h = layers.Concatenate()([layers.Conv2D(3, 3, name="a")(x),
                                  layers.Conv2D(2, 3, name="b")(x)])
        h = layers.ZeroPadding2D(((2, 0), (0, 1)))(layers.ReLU()(h))
        h = layers.ReLU()(layers.Conv2D(4, 3, strides=2, name="c")(h))
        return tf.keras.Model(x, layers.Dense(3, name="fc")(layers.GlobalAveragePooling2D()(h)))

    def weights(model):
        found = []
        for w in model.weights:   # by layer name: "a/kernel"...
            layer, kind = w.path.split("/")[-2:]
            value = getattr(net, layer).weight if kind == "kernel" else getattr(net, layer).bias
            value = value.detach().numpy()
            found.append(np.transpose(value, (2, 3, 1, 0)) if value.ndim == 4 else value.T)
        return found

    twin = Twin(build, [2, 9, 9, 2], None)
    twin.load(weights(twin.model))
    yield net, twin
    twin.session.close()


@pytest.mark.parametrize("theta", (0.5, 1.0))
def test_keras_concatenate_and_zero_padding_give_the_torch_masks(branch_twins, theta):
    net, twin = branch_twins
    x = np.random.default_rng(10).standard_normal((2, 2, 9, 9)).astype(np.float32)
    as_torch = {"conv2d": "conv2d", "bias_add": None, "concat_v2": "cat", "relu": "relu",
                "pad": "pad", "global_avg_pool2d": "adaptive_avg_pool2d", "linear": "linear"}
    _, on_tf = assert_same_masks(net, twin, x, theta, as_torch)
    for path in on_tf.paths:
        concat, pad = (next(n for n, t in path.types.items() if t == kind)
                       for kind in ("concat_v2", "pad"))
        assert path.neurons[concat].shape == (5, 7, 7) and path.neurons[pad].shape == (5, 9, 8)
        assert not path.neurons[pad][:, :2].any() and not path.neurons[pad][:, :, -1].any()


@pytest.mark.parametrize("build", [bn_cnn, lambda: Branches().eval()], ids=["bn", "branches"])
def test_onnx_exports_of_the_twins_give_the_torch_masks(build):
    """The third backend on the same torch models: ONNX ``GlobalAveragePool``,
    ``Concat`` and ``Pad`` (pads as an input) walk like their torch ops. The
    exporter folds the batch norm into the conv (a positive scale per output
    channel keeps every selection), so torch's ``batch_norm`` has no twin."""
    pytest.importorskip("onnxruntime")
    import io
    import warnings

    import onnxruntime

    import amanda.runtime.onnx  # the ONNX graph pass
    net = build()
    channels = 3 if isinstance(net, torch.nn.Sequential) else 2
    x = torch.from_numpy(np.random.default_rng(8).standard_normal(
        (3, channels, 9, 9)).astype(np.float32))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the TorchScript exporter's deprecation notice
        torch.onnx.export(net, (x,), buffer, dynamo=False, opset_version=13,
                          input_names=["x"], output_names=["y"])
    for theta in (0.5, 1.0):
        on_torch = extract(net, x, theta)
        on_onnx = EffectivePathTool(theta=theta)
        with amanda.apply(on_onnx):
            onnxruntime.InferenceSession(buffer.getvalue()).run(None, {"x": x.numpy()})
        for mine, theirs in zip(on_torch.paths, on_onnx.paths, strict=True):
            assert theirs.unknown == [] and mine.label == theirs.label
            torch_ops = [n for n, t in mine.types.items() if t != "batch_norm"]
            renamed = {"global_avg_pool2d": "adaptive_avg_pool2d", "concat": "cat"}
            assert [renamed.get(t, t) for t in theirs.types.values()] == \
                [mine.types[n] for n in torch_ops]
            for torch_op, onnx_op in zip(torch_ops, theirs.neurons):
                np.testing.assert_array_equal(theirs.neurons[onnx_op], mine.neurons[torch_op],
                                              err_msg=f"neurons of {onnx_op}, theta {theta}")
            for a, b in zip(mine.synapses.values(), theirs.synapses.values(), strict=True):
                np.testing.assert_array_equal(a, b)
            (pixels,) = mine.inputs.values()
            np.testing.assert_array_equal(theirs.inputs["x"], pixels)


@pytest.fixture(scope="module")
def mobilenet():
    """Keras' MobileNetV2 (random weights, alpha 0.35, 32x32) in a
    tf.compat.v1 graph: batch norms, ReLU6, ZeroPadding2D, depthwise convs,
    residual adds, global average pooling, softmax."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 32, 32, 3], name="x")
        model = tf.keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3),
                                                  alpha=0.35)
        y = model(x)
        init = tf.compat.v1.variables_initializer([w.value for w in model.weights])
    session = tf.compat.v1.Session(graph=graph)
    session.run(init)
    yield graph, session, x, y
    session.close()


@pytest.mark.slow   # about 17 s: two instrumented runs of a 150-layer graph
def test_keras_mobilenet_v2_is_walked_end_to_end(mobilenet):
    """Every layer is on the path, no op lacks a rule; and the theta = 1.0
    path contains the theta = 0.5 path at every layer: per neuron, both
    keep a prefix of the same order of contributions (0.5's the shorter),
    and every rule maps more critical outputs to more critical inputs."""
    graph, session, x, y = mobilenet
    pixels = np.random.default_rng(9).random((2, 32, 32, 3)).astype(np.float32)
    paths = {}
    for theta in (0.5, 1.0):
        tool = EffectivePathTool(theta=theta)   # default output: the softmax
        with amanda.apply(tool):
            probabilities = session.run(y, {x: pixels})
        paths[theta] = tool.paths
        assert tool.unknown == Counter()
        assert [p.label for p in tool.paths] == probabilities.argmax(1).tolist()
    convolutions = {op.name for op in graph.get_operations()
                    if op.type in ("Conv2D", "DepthwiseConv2dNative", "MatMul")}
    assert len(convolutions) == 35 + 17 + 1
    for half, full in zip(paths[0.5], paths[1.0], strict=True):
        assert half.unknown == full.unknown == []
        assert half.inputs["x"].shape == (3, 32, 32) and half.inputs["x"].any()
        for path in (half, full):
            assert set(path.synapses) == convolutions           # end to end
            assert {"mul", "add", "relu6", "pad", "depthwise_conv2d", "global_avg_pool2d",
                    "softmax"} <= set(path.types.values())
            assert not {"rsqrt", "sub", "read_variable_op"} & set(path.types.values())
        assert half.neurons.keys() == full.neurons.keys()
        for name, mask in half.neurons.items():
            assert not (mask & ~full.neurons[name]).any(), name
        for name, mask in half.synapses.items():
            assert not (mask & ~full.synapses[name]).any(), name
        assert not (half.inputs["x"] & ~full.inputs["x"]).any()
        assert full.inputs["x"].sum() > half.inputs["x"].sum()


# -- TF's own attributes against loops over neurons ------------------------------------

def ref_select(contributions, theta):
    from tests.tools.test_effective_path import ref_select as select
    return select(contributions, theta)


def ref_dense(x, kernel, out_mask, theta):
    """x (N, I), Keras kernel (I, O) -> critical inputs, synapses (N, O, I)."""
    in_mask = np.zeros(x.shape, bool)
    synapses = np.zeros((len(x), kernel.shape[1], kernel.shape[0]), bool)
    for n, j in zip(*np.nonzero(out_mask)):
        chosen = ref_select([float(x[n, i]) * float(kernel[i, j]) for i in range(len(kernel))],
                            theta)
        in_mask[n, chosen] = True
        synapses[n, j, chosen] = True
    return in_mask, synapses


def same_padding(size, kernel, stride):
    """TF's SAME padding before the first element (the rest goes after)."""
    out = -(-size // stride)
    return max((out - 1) * stride + kernel - size, 0) // 2


def ref_conv_same(x, kernel, stride, out_mask, theta):
    """NHWC x, HWIO kernel, SAME padding -> critical inputs, synapses (N, O, I, H, W)."""
    n_, height, width, cin = x.shape
    kh, kw, _, cout = kernel.shape
    top, left = same_padding(height, kh, stride), same_padding(width, kw, stride)
    in_mask = np.zeros(x.shape, bool)
    synapses = np.zeros((n_, cout, cin, kh, kw), bool)
    for n, oh, ow, co in zip(*np.nonzero(out_mask)):
        taps, contributions = [], []
        for ci in range(cin):
            for a in range(kh):
                for b in range(kw):
                    ih, iw = oh * stride + a - top, ow * stride + b - left
                    inside = 0 <= ih < height and 0 <= iw < width
                    taps.append((ci, a, b, ih, iw))
                    contributions.append(float(x[n, ih, iw, ci]) * float(kernel[a, b, ci, co])
                                         if inside else 0.0)
        for k in ref_select(contributions, theta):
            ci, a, b, ih, iw = taps[k]
            in_mask[n, ih, iw, ci] = True
            synapses[n, co, ci, a, b] = True
    return in_mask, synapses


def ref_avg_pool_same(x, size, out_mask, theta):
    """NHWC average pooling, SAME padding: padded elements are not counted."""
    _, height, width, _ = x.shape
    top, left = same_padding(height, size, size), same_padding(width, size, size)
    in_mask = np.zeros(x.shape, bool)
    for n, oh, ow, c in zip(*np.nonzero(out_mask)):
        cells = [(ih, iw) for ih in range(oh * size - top, oh * size - top + size)
                 for iw in range(ow * size - left, ow * size - left + size)
                 if 0 <= ih < height and 0 <= iw < width]
        for k in ref_select([float(x[n, ih, iw, c]) / len(cells) for ih, iw in cells], theta):
            in_mask[(n,) + cells[k] + (c,)] = True
    return in_mask


@pytest.fixture(scope="module")
def same_padding_net():
    """Strided SAME convolution with asymmetric padding (10 -> 5: 0 before,
    1 after), SAME average pooling whose last window is cut (5 -> 3)."""
    twin = Twin(lambda: tf.keras.Sequential([
        tf.keras.Input((10, 10, 2)), layers.Conv2D(3, 3, strides=2, padding="same"),
        layers.ReLU(), layers.AveragePooling2D(2, padding="same"), layers.Flatten(),
        layers.Dense(4)]), [2, 10, 10, 2], [])
    yield twin
    twin.session.close()


@pytest.mark.parametrize("theta", (0.5, 1.0))
def test_same_padding_and_average_pooling_match_loops(same_padding_net, theta):
    twin = same_padding_net
    x = np.random.default_rng(7).random((2, 10, 10, 2)).astype(np.float32)
    tool = EffectivePathTool(theta=theta, output=twin.y)
    twin.run(x, tool)
    scope = twin.y.op.name.split("/")[0] + "/"
    ops = {op.type: op for op in twin.graph.get_operations() if op.name.startswith(scope)
           and (op.type != "Reshape" or "flatten" in op.name)}
    conv, relu, pool, flat, matmul = (ops[t] for t in ("Conv2D", "Relu", "AvgPool", "Reshape",
                                                        "MatMul"))
    kernels = twin.session.run([w.value for w in twin.model.trainable_weights])
    acts = twin.session.run([relu.outputs[0], pool.outputs[0], flat.outputs[0], twin.y],
                            {twin.x: x})
    relu_out, pool_out, flat_out, logits = acts
    out = np.zeros(logits.shape, bool)
    out[np.arange(len(x)), logits.argmax(1)] = True
    flat_mask, dense_synapses = ref_dense(flat_out, kernels[2], out, theta)
    pool_mask = flat_mask.reshape(pool_out.shape)
    relu_mask = ref_avg_pool_same(relu_out, 2, pool_mask, theta)
    pixels, conv_synapses = ref_conv_same(x, kernels[0], 2, relu_mask, theta)
    chw = lambda m: np.transpose(m, (0, 3, 1, 2))
    for n, path in enumerate(tool.paths):
        assert path.unknown == []
        np.testing.assert_array_equal(path.synapses[matmul.name], dense_synapses[n])
        np.testing.assert_array_equal(path.neurons[flat.name], flat_mask[n])
        np.testing.assert_array_equal(path.neurons[pool.name], chw(pool_mask)[n])
        np.testing.assert_array_equal(path.neurons[relu.name], chw(relu_mask)[n])
        np.testing.assert_array_equal(path.neurons[conv.name], chw(relu_mask)[n])
        np.testing.assert_array_equal(path.synapses[conv.name], conv_synapses[n])
        np.testing.assert_array_equal(path.inputs["x"], chw(pixels)[n])
    # asymmetric padding (0 before, 1 after) and the pool's cut last windows are on the path
    assert same_padding(10, 3, 2) == 0 and same_padding(5, 2, 2) == 0
    assert (relu_mask[:, -1].any() or relu_mask[:, :, -1].any()) and pixels.sum() > 1


# -- plain TF ops: unknown ops, variables read on the path ------------------------------

@pytest.fixture(scope="module")
def raw_graph():
    """``x @ w1 + b1`` (an ``AddV2`` reading a variable), a ``Cumsum`` (no
    rule), ``@ w2``: written with TF ops, no Keras."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4], name="x")
        rng = np.random.default_rng(0)
        w1 = tf.Variable(rng.standard_normal((4, 6)).astype(np.float32), name="w1")
        b1 = tf.Variable(rng.standard_normal(6).astype(np.float32), name="b1")
        w2 = tf.Variable(rng.standard_normal((6, 3)).astype(np.float32), name="w2")
        hidden = tf.nn.relu(tf.matmul(x, w1) + b1)
        y = tf.matmul(tf.math.cumsum(hidden, axis=1, name="odd"), w2, name="logits")
        plain = tf.matmul(hidden, w2, name="plain_logits")
        init = tf.compat.v1.global_variables_initializer()
    session = tf.compat.v1.Session(graph=graph)
    session.run(init)
    yield session, x, y, plain
    session.close()


def test_unknown_tf_ops_are_reported_or_raise(raw_graph):
    session, x, y, plain = raw_graph
    inputs = {x: np.random.default_rng(1).random((3, 4), np.float32)}
    tool = EffectivePathTool(theta=0.5, output=y)
    with amanda.apply(tool):
        session.run(y, inputs)
    with pytest.warns(UserWarning, match="cumsum"):
        path = tool.paths[0]
    assert path.unknown == [("odd", "cumsum")] and tool.unknown["cumsum"] == 1
    assert list(path.types.values()) == ["cumsum", "linear"]   # the walk stops there
    strict = EffectivePathTool(theta=0.5, output="logits:0", strict=True)   # a tensor name
    with amanda.apply(strict):
        session.run(y, inputs)
    with pytest.raises(ToolError, match="no extraction rule for op type 'cumsum'") as error:
        _ = strict.paths
    assert "odd" in str(error.value)
    # without the odd op the walk crosses the add into both operands; the
    # bias is a variable read, a weight: no unknown op, not a neuron
    clean = EffectivePathTool(theta=1.0, output=plain)
    with amanda.apply(clean):
        session.run(plain, inputs)
    path = clean.paths[0]
    assert path.unknown == []
    assert list(path.types.values()) == ["linear", "add", "relu", "linear"]
    assert path.inputs["x"].shape == (4,) and path.inputs["x"].any()


def test_a_product_of_two_activations_has_no_rule():
    """``x * c`` with ``c`` from variables passes through (batch norm); a
    gate ``h * sigmoid(h)`` has no rule: reported, or raises with strict."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4], name="x")
        rng = np.random.default_rng(0)
        w = tf.Variable(rng.standard_normal((4, 3)).astype(np.float32), name="w")
        scale = tf.Variable(rng.random(4).astype(np.float32) + 0.5, name="scale")
        scaled = tf.multiply(x, tf.math.rsqrt(scale + 1e-3), name="scaled")
        y = tf.matmul(scaled, w, name="logits")
        gated = tf.matmul(scaled * tf.sigmoid(scaled, name="gate"), w, name="gated")
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        feed = {x: rng.random((2, 4)).astype(np.float32)}
        tool, gate, strict = (EffectivePathTool(theta=1.0, output=y),
                              EffectivePathTool(theta=1.0, output=gated),
                              EffectivePathTool(theta=1.0, output=gated, strict=True))
        for t, out in ((tool, y), (gate, gated), (strict, gated)):
            with amanda.apply(t):
                session.run(out, feed)
    path = tool.paths[0]
    assert path.unknown == [] and list(path.types.values()) == ["mul", "linear"]
    np.testing.assert_array_equal(path.inputs["x"], path.neurons["scaled"])
    with pytest.warns(UserWarning, match="mul"):
        assert gate.paths[0].unknown == [("mul", "mul")]
    with pytest.raises(ToolError, match="no extraction rule for op type 'mul' in this form"):
        _ = strict.paths


def test_runs_add_paths_and_class_paths(mlp_twins):
    net, twin = mlp_twins
    rng = np.random.default_rng(3)
    tool = EffectivePathTool(theta=0.5)   # default output: the last (batch, classes) op
    batches = [rng.standard_normal((4, 12)).astype(np.float32) for _ in range(3)]
    with amanda.apply(tool):
        for batch in batches:
            twin.session.run(twin.y, {twin.x: batch})
    labels = np.concatenate([net(torch.from_numpy(b)).argmax(1).numpy() for b in batches])
    assert [p.label for p in tool.paths] == labels.tolist()
    profile = tool.class_paths()
    assert sum(p.count for p in profile.values()) == 12
    for path in tool.paths:   # a sample's path lies inside its class path
        assert path.similarity(profile[path.label]) == 1.0


def test_docs_tensorflow_example_runs():
    import contextlib
    import io

    from tests.markdown import examples
    page = "docs/tools/effective-path.md"
    (code, expected), = [e for e in examples(page) if "tf.compat.v1" in e[0]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, page, "exec"), {"__name__": "__docs__"})  # noqa: S102 (the docs example)
    assert expected is not None and out.getvalue() == expected
