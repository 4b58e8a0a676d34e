"""TensorFlow graph mode: entering and leaving ``apply`` on a cache hit.

A scope with the same tools reuses the rewrite (nothing is analysed, lifted
or imported again), and variable values move between the user's session and
its shadow only where one of them wrote them since the last sync: checked by
counting TensorFlow runs per session, and by difference against a plain
session doing the same steps (plain training between scopes, training and
inference inside them, runs under ``disabled()``, resource and reference
variables, an optimizer with slots).
"""

import contextlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda import controls  # noqa: E402
from amanda.runtime.tensorflow import current_rewrite  # noqa: E402
from tensorflow.python.client import session as tf_session  # noqa: E402

v1 = tf.compat.v1
X = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)


def training_graph(use_resource):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [4, 3], name="x")
        w = v1.get_variable("w", initializer=np.arange(6, dtype=np.float32).reshape(3, 2) / 7,
                            use_resource=use_resource)
        b = v1.get_variable("b", initializer=np.float32([0.5, -0.25]), use_resource=use_resource)
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w) + b), name="loss")
        train = v1.train.AdamOptimizer(0.05).minimize(loss)
        init = v1.global_variables_initializer()
        variables = v1.global_variables()
    return graph, dict(x=x, loss=loss, train=train, init=init, variables=variables)


class Observe(amanda.Tool):
    """Observes every op's inputs; counts its analysis calls."""

    def __init__(self):
        super().__init__()
        self.analysed = self.calls = 0
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        self.analysed += 1
        context.insert_before_op(self.observe)

    def observe(self, *arrays):
        self.calls += 1


def steps(session, t, tool):
    """Scopes and plain runs interleaved; the losses seen and the final values."""
    scope = (lambda: amanda.apply(tool)) if tool is not None else contextlib.nullcontext
    feed = {t["x"]: X}
    seen = []
    with scope():                                   # training inside a scope
        seen.append(session.run([t["loss"], t["train"]], feed)[0])
    seen.append(session.run([t["loss"], t["train"]], feed)[0])   # plain training between scopes
    with scope():                                   # inference only
        seen.append(session.run(t["loss"], feed))
    with scope():
        seen.append(session.run([t["loss"], t["train"]], feed)[0])
        with amanda.disabled():                     # a plain step inside the scope
            seen.append(session.run([t["loss"], t["train"]], feed)[0])
        seen.append(session.run([t["loss"], t["train"]], feed)[0])
    for _ in range(2):                              # a scope per step
        with scope():
            seen.append(session.run([t["loss"], t["train"]], feed)[0])
    seen.append(session.run(t["loss"], feed))
    return seen, session.run(t["variables"])


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "reference"])
def test_interleaved_scopes_and_plain_runs_equal_a_plain_session(use_resource):
    graph, t = training_graph(use_resource)
    results = []
    for tool in (None, Observe()):
        with v1.Session(graph=graph) as session:
            session.run(t["init"])
            results.append(steps(session, t, tool))
    (want_seen, want_values), (got_seen, got_values) = results
    np.testing.assert_array_equal(got_seen, want_seen)
    assert len(got_values) == len(want_values) == 8   # w, b, Adam's slots and beta powers
    for got, want in zip(got_values, want_values):
        np.testing.assert_array_equal(got, want)
    assert tool.calls > 0


class SessionRuns:
    """Counts TensorFlow's own runs (``Session.run`` and callables) per C session."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("TF_SessionRun_wrapper", "TF_SessionRunCallable"):
            original = getattr(tf_session.tf_session, name)
            monkeypatch.setattr(tf_session.tf_session, name, self._counting(original))

    def _counting(self, original):
        def counted(c_session, *args, **kwargs):
            self.calls.append(c_session)
            return original(c_session, *args, **kwargs)
        return counted

    def of(self, session):
        return sum(1 for c in self.calls if c is session._session)


def test_a_scope_on_a_cache_hit_rebuilds_nothing_and_moves_no_unchanged_variable(monkeypatch):
    graph, t = training_graph(use_resource=True)
    tool = Observe()
    with v1.Session(graph=graph) as session:
        session.run(t["init"])
        with amanda.apply(tool):
            want = session.run(t["loss"], {t["x"]: X})
            rewrite = current_rewrite(session)
            version, shadow_session = rewrite.copy.version, None
        analysed = tool.analysed
        runs = SessionRuns(monkeypatch)
        for _ in range(3):
            with amanda.apply(tool):
                assert session.run(t["loss"], {t["x"]: X}) == want
                assert current_rewrite(session) is rewrite
                shadow = controls.state.sessions[-1].caches["tensorflow"][session]
                assert shadow_session in (None, shadow.session)
                shadow_session = shadow.session
        assert tool.analysed == analysed and rewrite.copy.version == version
        # the instrumented runs and nothing else in the shadow; the user's
        # session only read (to see that its variables kept their buffers)
        assert runs.of(shadow_session) == 3
        assert runs.of(session) <= 3
        # a plain training step between scopes is seen by the next scope
        session.run(t["train"], {t["x"]: X})
        plain = session.run(t["loss"], {t["x"]: X})
        with amanda.apply(tool):
            assert session.run(t["loss"], {t["x"]: X}) == plain


def test_a_tf_function_scope_on_a_cache_hit_rebuilds_nothing():
    w = tf.Variable(np.ones((3, 2), np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    tool = Observe()
    x = tf.constant(X)
    with amanda.apply(tool):
        step(x)
        copies = dict(controls.state.sessions[-1].caches["tensorflow_functions"])
        (copy,) = copies.values()
        pruned, version = copy.pruned, copy.rewrite.copy.version
    analysed, calls = tool.analysed, tool.calls
    for _ in range(3):
        with amanda.apply(tool):
            step(x)
            assert dict(controls.state.sessions[-1].caches["tensorflow_functions"]) == copies
    assert tool.analysed == analysed and tool.calls == 4 * calls
    assert copy.pruned is pruned and copy.rewrite.copy.version == version


def test_the_shadow_writing_in_place_never_writes_the_users_buffers():
    """After an inference scope the shadow may share the user's buffers; a
    write in the next scope (an update no read keeps waiting: TensorFlow
    would write in place) must copy first. The user's variables are read
    inside the scope through a private callable, which runs uninstrumented
    and hands nothing back."""
    from tensorflow.core.protobuf import config_pb2
    graph, t = training_graph(use_resource=True)
    weights = t["variables"][:2]
    with graph.as_default():
        bump = tf.group([tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=tf.ones(v.shape))
                         for v in weights])
    with v1.Session(graph=graph) as session:
        session.run(t["init"])
        options = config_pb2.CallableOptions()
        options.fetch.extend([v.value().name for v in weights])
        read_user = session._make_callable_from_options(options)
        before = [a.copy() for a in read_user()]
        tool = Observe()
        with amanda.apply(tool):
            session.run(t["loss"], {t["x"]: X})          # the shadow gets the values
        with amanda.apply(tool):
            session.run(bump)                            # written in the shadow
            during = [a.copy() for a in read_user()]
        after = [a.copy() for a in read_user()]
    for want, got in zip(before, during):
        np.testing.assert_array_equal(got, want)
    for want, got in zip(before, after):
        np.testing.assert_array_equal(got, want + 1)
