"""Nothing amanda made for a scope outlives the user's objects: once the user
drops the tool, the graph and the session (or the function), they are freed.
A process that instruments many graphs (a test suite, a sweep over models, a
server that loads models) must not grow with each one. Before, a tool (with
its sessions, their shadow sessions and instrumented graphs) stayed alive for
the life of the process as soon as a routine saw an integer constant."""

import gc
import weakref

import numpy as np
import pytest

import amanda
from amanda.tools.identity import IdentityTool

tf = pytest.importorskip("tensorflow")


def _session_run(tool):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 6])
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 4]))
        y = tf.matmul(tf.reshape(x, [4, 3]), w)       # reshape's shape: an integer constant
        grad = tf.compat.v1.gradients(tf.reduce_sum(y), [w])[0]
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        feed = {x: np.arange(12, dtype=np.float32).reshape(2, 6)}
        expected = session.run([y, grad], feed)
        with amanda.apply(tool):
            actual = session.run([y, grad], feed)
    for a, b in zip(expected, actual):
        np.testing.assert_array_equal(a, b)
    return weakref.ref(graph)


def _function_run(tool):
    w = tf.Variable(tf.ones([3, 4]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.matmul(tf.reshape(x, [4, 3]), w)
            loss = tf.reduce_sum(y)
        return y, tape.gradient(loss, w)

    x = tf.constant(np.arange(12, dtype=np.float32).reshape(2, 6))
    expected = step(x)
    with amanda.apply(tool):
        actual = step(x)
    for a, b in zip(expected, actual):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    return weakref.ref(step)


@pytest.mark.parametrize("run", [_session_run, _function_run], ids=["session", "tf_function"])
def test_the_tool_and_the_users_program_are_freed_after_the_scope(run):
    tool = IdentityTool()
    program = run(tool)
    assert tool.calls["before_op"]          # routines ran, some on integer constants
    tool = weakref.ref(tool)
    gc.collect()
    assert tool() is None, "amanda keeps the tool (its sessions, graphs) alive"
    assert program() is None, "amanda keeps the user's graph or function alive"
