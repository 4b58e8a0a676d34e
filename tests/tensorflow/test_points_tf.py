"""Every op that runs one of its instrumentation points runs all of them.

Before-routines of ops without inputs pass no tensor and hang on the op as
control inputs; a fed placeholder never runs, and Grappler folds constants,
so they used to be skipped while the after-routines ran.
"""

import numpy as np
import pytest

import amanda

tf = pytest.importorskip("tensorflow")


class Points(amanda.Tool):
    """Records which points ran, per op id."""

    def __init__(self):
        super().__init__()
        self.ran = {}
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True)

    def forward(self, context):
        context.insert_before_op(self.record, key=(context.get_op_id(), "before"))
        context.insert_after_op(self.record, key=(context.get_op_id(), "after"))

    def backward(self, context):
        op_id = context.get_backward_op_id()
        context.insert_before_backward_op(self.record, key=(op_id, "before"))
        context.insert_after_backward_op(self.record, key=(op_id, "after"))

    def record(self, *tensors, key):
        self.ran.setdefault(key[0], set()).add(key[1])


def _model(x, w):
    # sqrt(2) and the Sub constant are folded by Grappler in a tf.function
    return tf.reduce_sum((x * tf.sqrt(tf.constant(2.0)) - tf.constant(1.0)) * w)


def _assert_complete(tool, expected_ops):
    partial = {op: points for op, points in tool.ran.items() if points != {"before", "after"}}
    assert not partial
    assert expected_ops <= set(tool.ran)


def test_session_placeholder_and_constants_get_both_points():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        w = tf.Variable(np.ones(3, np.float32), name="w")
        loss = _model(x, w)
        grad = tf.compat.v1.gradients(loss, [w])[0]
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(w.initializer)
        tool = Points()
        with amanda.apply(tool):
            session.run([loss, grad], {x: np.arange(3, dtype=np.float32)})
    _assert_complete(tool, {"x", "Const", "Const_1"})


def test_tf_function_inputs_and_constants_get_both_points():
    w = tf.Variable(np.ones(3, np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = _model(x, w)
        return loss, tape.gradient(loss, w)

    x = tf.constant(np.arange(3, dtype=np.float32))
    names = {op.name for op in step.get_concrete_function(x).graph.get_operations()}
    tool = Points()
    with amanda.apply(tool):
        step(x)
    _assert_complete(tool, {"x", "Const", "Const_1"} & names)
