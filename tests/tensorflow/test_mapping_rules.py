"""One tool, two backends: the tutorial's counter and pruning tools written once
with mapping rules give the same answers on a Keras CNN (TF graph mode) and on
the equivalent PyTorch CNN."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.runtime import tensorflow as tf_runtime  # noqa: E402
from amanda.tools import mapping_rules  # noqa: E402
from amanda.tools.mapping import MappingTool  # noqa: E402

BATCH = 2


class ConvCounter(amanda.Tool):
    """Counts convolutions, and backward ops computing a convolution's weight
    gradient, whatever the backend calls them."""

    def __init__(self):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.counter = self.backward_counter = 0
        self.add_inst_for_op(self.callback)
        self.add_inst_for_op(self.backward_callback, backward=True, require_outputs=True)

    def callback(self, context):
        if context["type"] == "conv2d":
            context.insert_before_op(self.counter_op)

    def backward_callback(self, context):
        if context["backward_type"] == "conv2d_backward" and context["weight_grad"] is not None:
            context.insert_after_backward_op(self.counter_backward_op)

    def counter_op(self, *inputs):
        self.counter += 1

    def counter_backward_op(self, *grads):
        self.backward_counter += 1


def magnitude_mask(weight, sparsity=0.5):
    """1 for the largest ``1 - sparsity`` of ``|weight|``, 0 elsewhere (NumPy)."""
    flat = np.abs(weight).reshape(-1)
    mask = np.ones(flat.size, weight.dtype)
    mask[np.argsort(flat, kind="stable")[: int(flat.size * sparsity)]] = 0
    return mask.reshape(weight.shape)


class PruningTool(amanda.Tool):
    """The tutorial's pruning tool, backend-neutral: masks the weights of
    convolutions and linear layers by magnitude, and their gradients."""

    def __init__(self):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.WEIGHT_RULES))
        self.masks = []   # (type, NumPy mask), in analysis order
        self.add_inst_for_op(self.forward_analysis)
        self.add_inst_for_op(self.backward_analysis, backward=True, require_outputs=True)

    def forward_analysis(self, context):
        if context["type"] not in ("conv2d", "linear"):
            return
        mask = magnitude_mask(context["weight"])
        self.masks.append((context["type"], mask))
        context["mask"] = context["as_tensor"](mask)
        context.insert_before_op(self.mask_weight, inputs=[context["weight_input"]],
                                 mask=context["mask"])

    def backward_analysis(self, context):
        if "mask" in context and context["weight_grad"] is not None:
            context.insert_after_backward_op(self.mask_grad, grad_inputs=[context["weight_grad"]],
                                             mask=context["mask"])

    def mask_weight(self, weight, mask):
        return weight * mask

    def mask_grad(self, grad, mask):
        return grad * mask


class TorchCNN(torch.nn.Module):
    """The PyTorch twin of the Keras CNN of conftest (NCHW)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8 * 12 * 12, 10)

    def forward(self, x):
        x = self.conv2(torch.relu(self.conv1(x)))
        return self.fc(torch.flatten(x, 1))


def dense_rows_from_torch(weight):
    """Torch ``Linear`` weight ``(out, C*H*W)`` -> Keras ``Dense`` kernel
    ``(H*W*C, out)``: Flatten reads NCHW and NHWC in different orders."""
    return np.transpose(weight.T.reshape(8, 12, 12, -1), (1, 2, 0, 3)).reshape(8 * 12 * 12, -1)


def keras_weights_from_torch(net):
    """Torch parameters in the Keras variables' order and layouts."""
    conv = lambda w: np.transpose(w, (2, 3, 1, 0))   # OIHW -> HWIO
    p = {name: t.detach().numpy() for name, t in net.named_parameters()}
    return [conv(p["conv1.weight"]), p["conv1.bias"], conv(p["conv2.weight"]), p["conv2.bias"],
            dense_rows_from_torch(p["fc.weight"]), p["fc.bias"]]


def load(session, variables, values):
    """Set variables through their (fed) initializers: no op is added."""
    for variable, value in zip(variables, values):
        session.run(variable.initializer, {variable.initializer.inputs[1]: value})


@pytest.fixture
def twins(keras_cnn_graph):
    """(torch net, Keras graph with a training op, its session, NCHW input)."""
    torch.manual_seed(0)
    net = TorchCNN()
    model = keras_cnn_graph(batch=BATCH)
    with model.graph.as_default():
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients(
            zip(model.grads, model.variables))
    session = tf.compat.v1.Session(graph=model.graph)
    session.run(model.init)
    load(session, model.variables, keras_weights_from_torch(net))
    image = np.random.default_rng(0).random((BATCH, 3, 16, 16), np.float32)
    yield net, model, train, session, image
    session.close()


def nhwc(image):
    return np.ascontiguousarray(np.transpose(image, (0, 2, 3, 1)))


def test_the_twins_compute_the_same_function(twins):
    net, model, _, session, image = twins
    expected = net(torch.from_numpy(image)).detach().numpy()
    np.testing.assert_allclose(session.run(model.y, {model.x: nhwc(image)}), expected,
                               rtol=1e-4, atol=1e-4)


def test_counter_counts_the_same_convolutions_on_both_backends(twins):
    net, model, _, session, image = twins
    torch_counter, tf_counter = ConvCounter(), ConvCounter()
    for _ in range(2):
        with amanda.apply(torch_counter):
            net(torch.from_numpy(image)).sum().backward()
        with amanda.apply(tf_counter):
            session.run(model.grads, {model.x: nhwc(image)})
    assert (torch_counter.counter, torch_counter.backward_counter) == (4, 4)
    assert (tf_counter.counter, tf_counter.backward_counter) == (4, 4)


def test_pruning_gives_the_same_masks_and_outputs_on_both_backends(twins):
    net, model, _, session, image = twins
    torch_tool, tf_tool = PruningTool(), PruningTool()
    with amanda.apply(torch_tool):
        torch_y = net(torch.from_numpy(image)).detach().numpy()
    with amanda.apply(tf_tool):
        tf_y = session.run(model.y, {model.x: nhwc(image)})
    assert [t for t, _ in torch_tool.masks] == [t for t, _ in tf_tool.masks] \
        == ["conv2d", "conv2d", "linear"]
    for (_, a), (_, b) in zip(torch_tool.masks, tf_tool.masks):
        assert int((a == 0).sum()) == int((b == 0).sum()) == a.size // 2
    (_, c1), (_, c2), (_, fc) = torch_tool.masks
    to_tf = [np.transpose(c1, (2, 3, 1, 0)), np.transpose(c2, (2, 3, 1, 0)), dense_rows_from_torch(fc)]
    for expected, (_, actual) in zip(to_tf, tf_tool.masks):
        np.testing.assert_array_equal(actual, expected)
    np.testing.assert_allclose(tf_y, torch_y, rtol=1e-4, atol=1e-4)
    # pruning changes the function
    assert not np.allclose(tf_y, session.run(model.y, {model.x: nhwc(image)}), atol=1e-4)


def test_pruned_weights_get_no_update_while_training_in_tf_graph_mode(twins):
    _, model, train, session, image = twins
    kernels = [model.variables[0], model.variables[2], model.variables[4]]
    before = session.run(kernels)
    tool = PruningTool()
    with amanda.apply(tool):
        losses = [session.run([model.loss, train], {model.x: nhwc(image)})[0] for _ in range(3)]
    after = session.run(kernels)   # handed back to the user session
    assert losses[0] != losses[1] != losses[2]
    assert [t for t, _ in tool.masks] == ["conv2d", "conv2d", "linear"]
    for (_, mask), old, new in zip(tool.masks, before, after):
        np.testing.assert_array_equal(new[mask == 0], old[mask == 0])   # exactly unchanged
        assert (new[mask == 1] != old[mask == 1]).any()


class WeightProbe(amanda.Tool):
    """Records what the weight rules see."""

    def __init__(self):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.WEIGHT_RULES))
        self.seen = []
        self.sessions = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if "weight" in context:
            self.seen.append((context["type"], context["weight"]))
            self.sessions.append(tf_runtime.current_session())


def test_weight_values_in_session_runs_and_tf_functions():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 3])
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 2]) * 3, use_resource=True)
        y = tf.matmul(x, w)
        z = tf.matmul(y, tf.transpose(y))          # no weight: a plain matmul
        init = tf.compat.v1.global_variables_initializer()
    probe = WeightProbe()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        with amanda.apply(probe):
            session.run(z, {x: np.ones((1, 3), np.float32)})
    assert [t for t, _ in probe.seen] == ["linear"]
    np.testing.assert_array_equal(probe.seen[0][1], np.full((3, 2), 3, np.float32))
    assert probe.sessions == [session]

    v = tf.Variable(tf.fill([3, 2], 5.0))

    @tf.function
    def f(a):
        return tf.matmul(a, v)

    probe = WeightProbe()
    with amanda.apply(probe):
        f(tf.ones([1, 3]))
    assert [t for t, _ in probe.seen] == ["linear"]
    np.testing.assert_array_equal(probe.seen[0][1], np.full((3, 2), 5, np.float32))
    assert probe.sessions == [None]
    with pytest.raises(amanda.BackendError, match="only while analysis"):
        tf_runtime.evaluate(y)


def test_evaluate_sees_the_values_of_the_current_run():
    """A rule can read activations: the run's feeds are used."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        y = tf.nn.relu(x * 2.0, name="relu")
    seen = []
    tool = amanda.Tool()
    tool.add_inst_for_op(lambda c: seen.append(tf_runtime.evaluate(c.get_inputs()))
                         if c.get_op().type == "Relu" else None)
    with tf.compat.v1.Session(graph=graph) as session, amanda.apply(tool):
        session.run(y, {x: np.array([1.0, -1.0], np.float32)})
    np.testing.assert_array_equal(seen[0][0], [2.0, -2.0])
