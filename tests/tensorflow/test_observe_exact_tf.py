"""An observing tool (routines returning None) leaves the numbers unchanged.

The hosted routines sit between ops; Grappler cannot see a shape through a
callback unless the graph states it, and without shapes it rewrote
MobileNetV2's gradient sums differently than in the plain graph (see
``_shaped`` in amanda/runtime/tensorflow/__init__.py). Default Grappler options here.
"""

import numpy as np
import pytest

import amanda

tf = pytest.importorskip("tensorflow")


class ObserveAll(amanda.Tool):
    """A routine before and after every forward and backward op (or every op
    of the types given); it only counts."""

    def __init__(self, types=None):
        super().__init__()
        self.types = types
        self.calls = 0
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True)

    def forward(self, context):
        if self.types is None or context.get_op().type in self.types:
            context.insert_before_op(self.observe)
            context.insert_after_op(self.observe)

    def backward(self, context):
        if self.types is None:
            context.insert_before_backward_op(self.observe)
            context.insert_after_backward_op(self.observe)

    def observe(self, *tensors):
        self.calls += 1


def _assert_same(expected, actual):
    assert len(expected) == len(actual)
    different = [i for i, (a, b) in enumerate(zip(expected, actual)) if not np.array_equal(a, b)]
    assert not different, f"{len(different)} of {len(expected)} results differ, first {different[:5]}"


def _images():
    return np.random.RandomState(0).rand(2, 32, 32, 3).astype(np.float32)


def _session_run(tool, config=None):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 32, 32, 3])
        model = tf.keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3))
        loss = tf.reduce_sum(model(x, training=True))
        grads = tf.compat.v1.gradients(loss, model.trainable_weights)
        init = tf.compat.v1.variables_initializer([w.value for w in model.weights])
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        expected = session.run([loss] + grads, {x: _images()})
        with amanda.apply(tool):
            actual = session.run([loss] + grads, {x: _images()})
    return expected, actual


def test_observing_convolutions_keeps_mobilenetv2_bit_exact():
    """Default Grappler options. Without the shapes stated in the graph, one
    observed convolution was enough to change every gradient."""
    tool = ObserveAll(types={"Conv2D"})
    expected, actual = _session_run(tool)
    assert tool.calls >= 2 * 35
    _assert_same(expected, actual)


def test_observing_every_op_of_mobilenetv2_is_bit_exact_without_reassociation():
    """Every forward and backward op observed; Grappler's arithmetic
    optimizer off in both runs (it re-associates chains that routines on
    every op break up, see the tf.function test below)."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    tool = ObserveAll()
    expected, actual = _session_run(tool, config)
    assert tool.calls > 1000
    _assert_same(expected, actual)


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="(not strict: exact in some processes, e.g. CI once) Grappler's arithmetic optimizer reassociates chains of "
                   "Mul/Add in the plain function that a routine in the dataflow breaks up; "
                   "exact with arithmetic_optimization off (docs/tensorflow.md)")
def test_observing_mobilenetv2_tf_function_is_bit_exact():
    model = tf.keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3))
    images = tf.constant(_images())

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return [loss] + tape.gradient(loss, model.trainable_variables)

    expected = step(images)
    tool = ObserveAll()
    with amanda.apply(tool):
        actual = step(images)
    assert tool.calls > 1000
    _assert_same(expected, actual)
