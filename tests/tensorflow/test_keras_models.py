"""TensorFlow graph mode on real Keras models: counting, value changes and
bit-exact identity instrumentation, forward and backward."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402


def snapshot(graph):
    """The user graph's op names and collections, to check it is untouched."""
    collections = {key: [getattr(item, "name", repr(item)) for item in graph.get_collection(key)]
                   for key in graph.get_all_collection_keys()}
    return [op.name for op in graph.get_operations()], collections


def session_for(model_graph):
    """A session over ``model_graph`` with its variables initialised."""
    session = tf.compat.v1.Session(graph=model_graph.graph)
    session.run(model_graph.init)
    return session


class CountOPTool(amanda.Tool):
    """The tutorial's counter, with TF op types (forward Conv2D, backward
    Conv2DBackpropFilter)."""

    def __init__(self):
        super().__init__()
        self.counter = 0
        self.backward_counter = 0
        self.backward_owners = []
        self.add_inst_for_op(self.callback)
        self.add_inst_for_op(self.backward_callback, backward=True, require_outputs=True)

    def callback(self, context):
        if "Conv2D" == context.get_op().type:
            context.insert_before_op(self.counter_op)

    def backward_callback(self, context):
        if context.get_backward_op().type == "Conv2DBackpropFilter":
            self.backward_owners.append(context.get_op())
            context.insert_after_backward_op(self.counter_backward_op)

    def counter_op(self, *inputs):
        self.counter += 1
        return inputs

    def counter_backward_op(self, *inputs):
        self.backward_counter += 1
        return inputs


def test_resnet50_every_run_executes_53_conv_and_53_filter_gradient_routines(keras_resnet50_graph):
    model = keras_resnet50_graph
    before = snapshot(model.graph)
    image = np.random.default_rng(0).random((1, 64, 64, 3), np.float32)
    tool = CountOPTool()
    with session_for(model) as session:
        with amanda.apply(tool):
            session.run(model.grads, {model.x: image})
            assert (tool.counter, tool.backward_counter) == (53, 53)
            session.run(model.grads, {model.x: image})
            assert (tool.counter, tool.backward_counter) == (106, 106)
    # every backward context names its forward convolution, in the user's graph
    assert len(tool.backward_owners) == 53
    assert all(isinstance(op, tf.Operation) and op.type == "Conv2D" and op.graph is model.graph
               for op in tool.backward_owners)
    assert len({op.name for op in tool.backward_owners}) == 53
    assert snapshot(model.graph) == before


class Tweak(amanda.Tool):
    """Adds 1 to the image entering the first convolution, 10 to the dense
    layer's MatMul output and doubles the first kernel's gradient."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True, require_outputs=True)

    def forward(self, context):
        op = context.get_op()
        if op.type == "Conv2D" and op.inputs[0].op.type == "Placeholder":
            context.insert_before_op(lambda image: image + 1, inputs=[0])
        elif op.type == "MatMul":
            context.insert_after_op(lambda y: y + 10)

    def backward(self, context):
        op = context.get_op()
        if (context.get_backward_op().type == "Conv2DBackpropFilter"
                and op.inputs[0].op.type == "Placeholder"):
            context.insert_after_backward_op(lambda grad: grad * 2)


def test_routines_change_values_on_a_keras_cnn(keras_cnn_graph):
    model = keras_cnn_graph()
    image = np.random.default_rng(1).random((2, 16, 16, 3), np.float32)
    with session_for(model) as session:
        y, grads = session.run([model.y, model.grads], {model.x: image + 1})
        with amanda.apply(Tweak()):
            for _ in range(2):
                tweaked_y, tweaked_grads = session.run([model.y, model.grads], {model.x: image})
                np.testing.assert_allclose(tweaked_y, y + 10, rtol=1e-5)
                # the first kernel's gradient is doubled; the others see the +1 image
                np.testing.assert_allclose(tweaked_grads[0], 2 * grads[0], rtol=1e-5)
                for tweaked, plain in zip(tweaked_grads[1:], grads[1:]):
                    np.testing.assert_allclose(tweaked, plain, rtol=1e-5)
        # outside apply: vanilla again
        np.testing.assert_array_equal(session.run(model.y, {model.x: image + 1}), y)


def assert_identity_is_bit_exact(model, inputs, config=None, portable=False):
    """Identity routines around every forward and backward op change no bit
    of the outputs and gradients, compared in the same session. ``portable``
    routines are lowered as TF ``Identity`` ops instead of Python callbacks."""
    before = snapshot(model.graph)
    with tf.compat.v1.Session(graph=model.graph, config=config) as session:
        session.run(model.init)
        plain = session.run([model.y, model.grads], {model.x: inputs})
        again = session.run([model.y, model.grads], {model.x: inputs})
        assert all(np.array_equal(a, b) for a, b in zip([again[0], *again[1]], [plain[0], *plain[1]])), \
            "the plain run is not deterministic"
        tool = IdentityTool(portable=portable)
        with amanda.apply(tool):
            output, grads = session.run([model.y, model.grads], {model.x: inputs})
            rewrite = amanda.runtime.tensorflow.current_rewrite(session)
    assert np.array_equal(output, plain[0])
    assert len(grads) == len(plain[1])
    different = [v.name for v, a, b in zip(model.variables, grads, plain[1])
                 if not np.array_equal(a, b)]
    assert different == []
    copied = {op.type for op in rewrite.copy.get_operations() if op.name.startswith("amanda/")}
    if portable:   # lowered natively: Identity ops, no callback
        assert copied == {"Identity"} and not any(tool.calls.values())
    else:
        assert "PyFunc" in copied
        assert all(count > 0 for count in tool.calls.values()), tool.calls
    assert snapshot(model.graph) == before
    return tool


@pytest.mark.slow
def test_identity_on_every_op_is_bit_exact_on_resnet50(keras_resnet50_graph):
    image = np.random.default_rng(2).random((1, 64, 64, 3), np.float32)
    tool = assert_identity_is_bit_exact(keras_resnet50_graph, image)
    assert tool.calls["before_backward_op"] > 1000


@pytest.mark.slow
def test_portable_identity_on_every_op_is_bit_exact_on_resnet50(keras_resnet50_graph):
    image = np.random.default_rng(2).random((1, 64, 64, 3), np.float32)
    assert_identity_is_bit_exact(keras_resnet50_graph, image, portable=True)


def exact_arithmetic():
    """A session config without Grappler's algebraic rewrites.

    Constant folding (which also re-associates ``c1 * (c2 * x)``) and the
    arithmetic optimizer change float rounding. They cannot apply across
    instrumentation routines, so with a routine on every op the instrumented
    graph computes each op exactly as written; a bit-exact comparison needs
    the plain run to do the same. ResNet50 happens to offer them nothing.
    """
    from tensorflow.core.protobuf import rewriter_config_pb2
    config = tf.compat.v1.ConfigProto()
    rewrites = config.graph_options.rewrite_options
    rewrites.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    rewrites.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    return config


def test_identity_on_every_op_is_bit_exact_on_a_transformer_block(keras_transformer_graph):
    model = keras_transformer_graph()
    types = {op.type for op in model.graph.get_operations()}
    assert {"Einsum", "Softmax", "MatMul", "Rsqrt"} <= types
    tokens = np.random.default_rng(3).random((2, 6, 16), np.float32)
    assert_identity_is_bit_exact(model, tokens, config=exact_arithmetic())
    assert_identity_is_bit_exact(model, tokens, config=exact_arithmetic(), portable=True)


def test_grappler_rewrites_are_the_only_difference_on_a_transformer_block(keras_transformer_graph):
    """With the default config the identity run differs from the plain one
    only by rounding (the plain run's rewritten arithmetic)."""
    model = keras_transformer_graph()
    tokens = np.random.default_rng(3).random((2, 6, 16), np.float32)
    with session_for(model) as session:
        plain = session.run(model.grads, {model.x: tokens})
        with amanda.apply(IdentityTool()):
            grads = session.run(model.grads, {model.x: tokens})
    for a, b in zip(grads, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
