"""amanda.instrument on TensorFlow graphs: the GraphDef of an instrumented copy."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402


class Double(amanda.Tool):
    """Doubles the MatMul's first input and counts executions."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "MatMul":
            context.insert_before_op(self.double, inputs=[0])

    def double(self, a):
        self.calls += 1
        return a * 2


def small_graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 2], name="x")
        tf.matmul(x, tf.constant([[1.0], [1.0]]), name="y")
    return graph


@pytest.mark.parametrize("as_graph_def", [False, True])
def test_instrument_tf_graph_gives_a_runnable_graphdef(as_graph_def):
    graph = small_graph()
    names = [op.name for op in graph.get_operations()]
    tool = Double()
    program = graph.as_graph_def() if as_graph_def else graph
    graph_def = amanda.instrument(program, tool)
    assert isinstance(graph_def, tf.compat.v1.GraphDef)
    assert [op.name for op in graph.get_operations()] == names
    assert any(node.op in ("PyFunc", "PyFuncStateless") for node in graph_def.node)
    result = tf.Graph()
    with result.as_default():
        tf.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=result) as session:
        y = session.run("y:0", {"x:0": np.array([[1.0, 2.0]], np.float32)})
    assert y.tolist() == [[6.0]] and tool.calls == 1
