"""Quantization on TensorFlow graphs: the Keras CNN gives the fake-quant output
of the same CNN in PyTorch (same weights, same tool settings)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import amanda
from amanda.tools.quantization import QuantizationTool, QuantScheme

F = torch.nn.functional


def _torch_twin(weights):
    """The conftest's Keras CNN (Conv2D(8, 3, relu), Conv2D(8, 3), Flatten,
    Dense(10) on NHWC 16x16x3) in PyTorch with the Keras weights."""
    k1, b1, k2, b2, dense, bias = weights

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, 3)
            self.conv2 = torch.nn.Conv2d(8, 8, 3)
            self.dense = torch.nn.Linear(12 * 12 * 8, 10)
            with torch.no_grad():
                for conv, kernel, b in ((self.conv1, k1, b1), (self.conv2, k2, b2)):
                    conv.weight.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1)))  # HWIO -> OIHW
                    conv.bias.copy_(torch.from_numpy(b))
                self.dense.weight.copy_(torch.from_numpy(dense.T))                   # (in, out) -> (out, in)
                self.dense.bias.copy_(torch.from_numpy(bias))

        def forward(self, x):                     # x: NHWC, as Keras
            out = torch.relu(self.conv1(x.permute(0, 3, 1, 2)))
            out = self.conv2(out)
            return self.dense(out.permute(0, 2, 3, 1).flatten(1))

    return Twin().eval()


@pytest.fixture
def keras_cnn(keras_cnn_graph):
    built = keras_cnn_graph(batch=2)
    session = tf.compat.v1.Session(graph=built.graph)
    session.run(built.init)
    images = np.random.RandomState(0).rand(2, 16, 16, 3).astype(np.float32)
    yield built, session, images
    session.close()


@pytest.mark.parametrize("weight, activation", [
    (QuantScheme(8, symmetric=True, per_channel=True), QuantScheme(8, symmetric=False)),
    (QuantScheme(4, symmetric=False, per_channel=False), QuantScheme(4, symmetric=True)),
])
def test_keras_cnn_matches_the_pytorch_twin(keras_cnn, weight, activation):
    built, session, images = keras_cnn
    twin = _torch_twin(session.run(built.variables))
    feed = {built.x: images}
    with torch.no_grad():
        np.testing.assert_allclose(twin(torch.from_numpy(images)).numpy(),
                                   session.run(built.y, feed), rtol=1e-4, atol=1e-4)

    tf_tool = QuantizationTool(weight=weight, activation=activation, observer="minmax")
    with amanda.apply(tf_tool.calibration()):
        calibrated = session.run(built.y, feed)
    with amanda.apply(tf_tool):
        tf_quantized = session.run(built.y, feed)
    reference = session.run(built.y, feed)
    np.testing.assert_array_equal(calibrated, reference)        # calibration only observes

    torch_tool = QuantizationTool(weight=weight, activation=activation, observer="minmax")
    x = torch.from_numpy(images)
    with torch.no_grad():
        with amanda.apply(torch_tool.calibration()):
            twin(x)
        torch_tool.freeze()
        with amanda.apply(torch_tool):
            torch_quantized = twin(x).numpy()

    assert len(tf_tool.ops) == len(torch_tool.ops) == 3
    assert sorted(i["type"] for i in tf_tool.ops.values()) == ["conv2d", "conv2d", "linear"]
    for tf_row, torch_row in zip(tf_tool.report(), torch_tool.report()):
        np.testing.assert_allclose(tf_row["weight"]["scale"], torch_row["weight"]["scale"],
                                   rtol=1e-6)
        np.testing.assert_allclose(tf_row["activation"]["scale"],
                                   torch_row["activation"]["scale"], rtol=1e-5)
    error = np.abs(tf_quantized - reference).max()
    assert error > 1e-4                                          # it quantized
    # float32 sums in different orders may flip a rounding on a borderline
    # value: a difference of at most a step or two of the output grid
    np.testing.assert_allclose(tf_quantized, torch_quantized, rtol=0, atol=0.05 * error + 1e-5)


def test_per_channel_axis_is_the_output_channel_in_tf_layouts(keras_cnn):
    built, session, images = keras_cnn
    tool = QuantizationTool(weight=QuantScheme(8, per_channel=True), activation=None)
    with amanda.apply(tool):
        session.run(built.y, {built.x: images})
    kernel1, _, kernel2, _, dense, _ = session.run(built.variables)
    rows = {row["op_id"]: row["weight"] for row in tool.report()}
    assert len(rows) == 3
    convs = sorted((w for name, w in rows.items() if name.endswith("convolution")),
                   key=lambda w: w["max"])   # conv1's kernel has 27 inputs, conv2's 72: larger
    [linear] = [w for name, w in rows.items() if name.endswith("MatMul")]
    assert [(w["axis"], len(w["scale"])) for w in convs + [linear]] == [(3, 8), (3, 8), (1, 10)]
    expected = [np.abs(k).reshape(-1, 8).max(0) / 127 for k in (kernel2, kernel1)]
    expected.sort(key=lambda scale: list(scale))
    got = sorted((np.array(w["scale"]) for w in convs), key=lambda scale: list(scale))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6)
    np.testing.assert_allclose(linear["scale"], np.abs(dense).max(0) / 127, rtol=1e-6)


def test_graph_mode_needs_calibrated_activations(keras_cnn):
    built, session, images = keras_cnn
    before = session.run(built.y, {built.x: images})
    tool = QuantizationTool()
    with pytest.raises(amanda.ToolError, match="calibration") as info, amanda.apply(tool):
        session.run(built.y, {built.x: images})
    assert "Conv2D" in str(info.value) and "tensorflow" in str(info.value)
    np.testing.assert_array_equal(session.run(built.y, {built.x: images}), before)


def test_qat_training_in_a_tf_graph_decreases_the_loss():
    graph = tf.Graph()
    with graph.as_default():
        tf.keras.utils.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 3])
        labels = tf.compat.v1.placeholder(tf.int32, [8])
        model = tf.keras.Sequential([tf.keras.Input((16, 16, 3)),
                                     tf.keras.layers.Conv2D(8, 3, activation="relu"),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=model(x)))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, var_list=[w.value for w in model.trainable_weights])
        init = tf.compat.v1.variables_initializer([w.value for w in model.weights])
    rng = np.random.RandomState(0)
    feed = {x: rng.rand(8, 16, 16, 3).astype(np.float32), labels: rng.randint(0, 10, 8)}
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        tool = QuantizationTool(weight=QuantScheme(8, per_channel=True))
        with amanda.apply(tool.calibration()):
            session.run(loss, feed)
        losses = []
        with amanda.apply(tool):
            for _ in range(15):
                losses.append(session.run([loss, train], feed)[0])
        trained = session.run(loss, feed)      # plain run: the trained weights are back
    assert len(tool.ops) == 2
    assert losses[-1] < 0.8 * losses[0], losses
    assert trained < losses[0]
