"""The one cache rule on TensorFlow's two paths (``Session.run`` and
``tf.function``): inside ``amanda.cache_disabled()`` the tools' analysis runs
at every execution of the program (a run, a call), and the executions of
(op id, point) are those of the cached runs. Before, ``cache_disabled()``
had no effect on TensorFlow: the analysis ran once per graph.

A training step updates variables in each run, so the values the runs
hand from one instrumented copy to the next (through the user's session)
are checked too: the variables after three steps equal plain TensorFlow's
bit for bit, with the cache on and off."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from tests.cache_rule import Recording, assert_one_rule  # noqa: E402

tf1 = tf.compat.v1
_OFF = ("constant_folding", "arithmetic_optimization")
RUNS = 3
X = np.random.default_rng(0).random((4, 3), dtype=np.float32)


@pytest.fixture(autouse=True)
def _bit_exact():
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({option: False for option in _OFF})
    yield
    tf.config.optimizer.set_experimental_options(
        {option: saved.get(option, True) for option in _OFF})


def session_program():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, (4, 3))
        w = tf1.get_variable("w", initializer=np.arange(6, dtype=np.float32).reshape(3, 2) / 7)
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
        step = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
        init = tf1.global_variables_initializer()
    session = tf1.Session(graph=graph)
    session.run(init)

    def run():
        return session.run([loss, step], {x: X})[0]

    return run, lambda: session.run(w)


def function_program():
    w = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2) / 7)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
        w.assign_sub(0.5 * tape.gradient(loss, w))
        return loss

    return (lambda: step(tf.constant(X)).numpy()), w.numpy


@pytest.mark.parametrize("program", [session_program, function_program],
                         ids=["Session.run", "tf.function"])
def test_cache_disabled_analyses_every_execution_and_changes_nothing_else(program):
    run, weights = program()
    plain = [run() for _ in range(RUNS)] + [weights()]
    results = {}
    for cached in (True, False):
        run, weights = program()
        tool = Recording(backward=True)
        with amanda.apply(tool), (amanda.cache_enabled() if cached else amanda.cache_disabled()):
            got = [run() for _ in range(RUNS)]
        got.append(weights())
        for a, b in zip(plain, got):
            np.testing.assert_array_equal(a, b)
        results[cached] = tool
    cached, uncached = results[True], results[False]
    assert any(key[1] == "before backward" for key in cached.executions)
    assert_one_rule(cached, uncached, RUNS)
