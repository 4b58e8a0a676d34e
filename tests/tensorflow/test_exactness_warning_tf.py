"""amanda says when TensorFlow may compute other bits under its routines.

Grappler's arithmetic optimizer and constant folding rewrite float
expressions of the plain graph; Python routines between ops keep them
apart, so even routines that return None may change the last bits
(docs/tensorflow.md, Bit-exactness). The first rewrite that hosts a routine
under those rewrites emits `amanda.NotBitExactWarning`, once, naming the
settings at which outputs are bit-identical; none is emitted when they are
off or when every routine is portable (TF ops Grappler sees through).
"""

import warnings

import numpy as np
import pytest

import amanda
from amanda import portable

tf = pytest.importorskip("tensorflow")
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402


class Observe(amanda.Tool):
    def __init__(self, routine=None):
        super().__init__()
        self.routine = routine or self.look
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "Mul":
            context.insert_before_op(self.routine, inputs=[0])

    def look(self, *arrays):
        self.calls += 1


@portable.routine
def _double(x):
    return x * 2.0


def _caught(run, tool):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            first = run()
            second = run()
    return first, second, [w for w in caught if issubclass(w.category, amanda.NotBitExactWarning)]


def _session(rewrites_off):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        y = tf.reduce_sum(x * 3.0 * x)
    config = tf.compat.v1.ConfigProto()
    if rewrites_off:
        options = config.graph_options.rewrite_options
        options.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
        options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    session = tf.compat.v1.Session(graph=graph, config=config)
    feed = {x: np.arange(4, dtype=np.float32)}
    return session, (lambda: session.run(y, feed)), session.run(y, feed)


def test_a_session_with_default_grappler_is_warned_once_at_the_users_line():
    session, run, vanilla = _session(rewrites_off=False)
    tool = Observe()
    first, second, caught = _caught(run, tool)
    assert tool.calls == 2 * 2 and first == second == vanilla
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "arithmetic_optimization" in message and "constant_folding" in message
    assert "Bit-exactness" in message
    assert caught[0].filename == __file__


def test_no_warning_with_both_rewrites_off():
    session, run, vanilla = _session(rewrites_off=True)
    tool = Observe()
    first, _, caught = _caught(run, tool)
    assert tool.calls == 2 * 2 and first == vanilla and caught == []


def test_no_warning_for_portable_routines():
    session, run, vanilla = _session(rewrites_off=False)
    first, _, caught = _caught(run, Observe(routine=_double))
    assert caught == [] and first != vanilla  # the routine ran, as TF ops


def test_tf_function_follows_tf_config_optimizer():
    x = tf.constant(np.arange(4, dtype=np.float32))

    @tf.function
    def f(v):
        return tf.reduce_sum(v * 3.0 * v)

    vanilla = f(x)
    _, _, caught = _caught(lambda: f(x), Observe())
    assert len(caught) == 1

    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False,
                                                  "constant_folding": False})
    try:
        @tf.function
        def g(v):
            return tf.reduce_sum(v * 3.0 * v)

        first, _, caught = _caught(lambda: g(x), Observe())
    finally:
        tf.config.optimizer.set_experimental_options({
            "arithmetic_optimization": saved.get("arithmetic_optimization", True),
            "constant_folding": saved.get("constant_folding", True)})
    assert caught == [] and np.array_equal(first.numpy(), vanilla.numpy())


def test_onednn_kernels_are_named_even_with_both_rewrites_off(monkeypatch):
    """oneDNN (TensorFlow's default on x86) orders some computations
    differently when routines sit between ops: with it on, the warning is
    given and names TF_ENABLE_ONEDNN_OPTS even when Grappler's rewrites are
    off. These tests run with it off (conftest), where nothing is said."""
    from amanda.runtime.tensorflow import warnings as tensorflow_warnings
    assert tensorflow_warnings._onednn_enabled() is False     # conftest's setting
    monkeypatch.setattr(tensorflow_warnings, "_onednn_enabled", lambda: True)
    session, run, vanilla = _session(rewrites_off=True)
    first, _, caught = _caught(run, Observe())
    assert first == vanilla and len(caught) == 1
    message = str(caught[0].message)
    assert "oneDNN" in message and "TF_ENABLE_ONEDNN_OPTS=0" in message
    assert "arithmetic_optimization rewrite" not in message   # not the cause here
