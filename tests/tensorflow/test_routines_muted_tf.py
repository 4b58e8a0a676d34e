"""amanda never instruments itself: a routine that runs TensorFlow itself
(a reference graph in its own session) runs it plainly, whichever thread
TensorFlow calls the routine in."""

import numpy as np
import pytest

import amanda

tf = pytest.importorskip("tensorflow")


def _graph(scale):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        y = tf.reduce_sum(x * scale, name="y")
    return graph, x, y


def test_a_routines_own_session_runs_are_not_instrumented():
    ref_graph, ref_x, ref_y = _graph(2.0)
    reference = tf.compat.v1.Session(graph=ref_graph)
    seen, inner = [], []

    class Nested(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op().type == "Mul":
                context.insert_before_op(self.look, inputs=[0], op=context.get_op().name)

        def look(self, x, op):
            seen.append(op)
            inner.append(reference.run(ref_y, {ref_x: x}))

    graph, x, y = _graph(3.0)
    session = tf.compat.v1.Session(graph=graph)
    feed = np.arange(3, dtype=np.float32)
    with amanda.apply(Nested()):
        out = session.run(y, {x: feed})
    assert out == 9.0 and inner == [6.0]
    assert seen == ["mul"]   # the reference graph's Mul ran plainly
