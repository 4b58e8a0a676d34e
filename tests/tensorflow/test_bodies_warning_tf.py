"""Ops inside the bodies of While/If/Case/PartitionedCall are points of their
own (tests/tensorflow/test_control_flow_tf.py), so they warn nothing. A
direct call of a library function (a node whose type is the function's name,
as ``Defun`` makes) is not instrumented inside (docs/tensorflow.md, Limits):
amanda says so, once per call op, naming the user's line, instead of
reporting counts that silently leave its ops out."""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402


def _graph(kind):
    from tensorflow.python.framework import function

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        if kind == "control_flow":
            _, y = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, tf.tanh(v) * 2.0),
                                 [0, x])
            z = tf.cond(tf.reduce_sum(x) > 0, lambda: y * 2, lambda: y - 1)
        elif kind == "direct_call":
            @function.Defun(tf.float32)
            def scaled_tanh(v):
                return tf.tanh(v) * 2.0

            z = scaled_tanh(x, name="direct")
            z.set_shape([4])
        else:
            z = tf.tanh(x) * 2.0
    return graph, x, z


def _run_twice(kind):
    graph, x, z = _graph(kind)
    session = tf.compat.v1.Session(graph=graph)
    feed = {x: np.ones(4, np.float32)}
    vanilla = session.run(z, feed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(IdentityTool()):
            first = session.run(z, feed)
            second = session.run(z, feed)
    assert np.array_equal(first, vanilla) and np.array_equal(second, vanilla)
    return [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]


def test_direct_function_calls_are_said_to_be_no_points_once():
    caught = _run_twice("direct_call")
    assert len(caught) == 1                               # once, not per run
    message = str(caught[0].message)
    assert "'direct'" in message and "Limits" in message
    assert caught[0].filename == __file__                 # the user's line


def test_while_and_cond_bodies_are_instrumented_and_warn_nothing():
    assert _run_twice("control_flow") == []


def test_a_graph_without_function_bodies_warns_nothing():
    assert _run_twice("plain") == []
