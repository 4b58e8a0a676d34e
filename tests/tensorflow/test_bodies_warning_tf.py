"""Ops inside TF function bodies (While/If branches) are not points of their
own (docs/tensorflow.md, Limits): amanda says so, once per call op, naming the
user's line, instead of reporting counts that silently leave them out."""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402


def _graph(control_flow):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        if control_flow:
            _, y = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, tf.tanh(v) * 2.0),
                                 [0, x])
            z = tf.cond(tf.reduce_sum(x) > 0, lambda: y * 2, lambda: y - 1)
        else:
            z = tf.tanh(x) * 2.0
    return graph, x, z


def _run_twice(control_flow):
    graph, x, z = _graph(control_flow)
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


def test_ops_in_function_bodies_are_said_to_be_no_points_once():
    caught = _run_twice(control_flow=True)
    assert len(caught) == 1                               # once, not per run
    message = str(caught[0].message)
    assert "'while'" in message and "'cond'" in message and "Limits" in message
    assert caught[0].filename == __file__                 # the user's line


def test_a_graph_without_function_bodies_warns_nothing():
    assert _run_twice(control_flow=False) == []
