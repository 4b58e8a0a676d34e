"""Graph tools get the whole TF graph, as on the other backends.

The TF runtime runs the one instrumentation pipeline
(`amanda.passes.pipeline`), whose ``graph_completed`` step hands the analysed
graph to tools with ``requires_graph``; before, TF never called it, so
`GraphTracingTool` saw no TF graph. Function bodies are parts of a program,
not programs: they are not handed on.
"""

import numpy as np
import pytest

import amanda
from amanda.tools.graph import GraphTracingTool

tf = pytest.importorskip("tensorflow")


def test_graph_tracing_gets_the_session_graph_once_per_version():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        y = tf.reduce_sum(tf.nn.relu(x) * 2.0, name="y")
        i = tf.constant(0)
        loop = tf.while_loop(lambda k: k < 3, lambda k: k + 1, [i], name="loop")
    session = tf.compat.v1.Session(graph=graph)
    feed = {x: np.arange(3, dtype=np.float32)}
    tracer = GraphTracingTool(keep=5)
    with amanda.apply(tracer):
        session.run([y, loop], feed)
        session.run([y, loop], feed)            # cached: no new analysis
        assert len(tracer.graphs) == 1
        names = {op.name for op in tracer.graph}
        assert {"x", "Relu", "mul", "y"} <= names and "loop" in names
        assert not any(name.startswith("loop/body/") for name in names)   # bodies are not handed on
        with graph.as_default():
            z = tf.identity(y, name="z")
        session.run(z, feed)                    # the graph grew
    assert len(tracer.graphs) == 2 and "z" in {op.name for op in tracer.graph}


def test_graph_tracing_gets_a_tf_function_graph():
    @tf.function
    def f(v):
        return tf.reduce_sum(tf.tanh(v))

    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        f(tf.ones(4))
    assert len(tracer.graphs) == 1 and "Tanh" in {op.type for op in tracer.graph}
