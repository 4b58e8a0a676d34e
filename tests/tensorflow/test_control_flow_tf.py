"""Ops inside TF function bodies (While/If/Case, PartitionedCall) are points
of their own (docs/tensorflow.md, Function bodies), tested by difference:
counts against the trip count the program fixes, outputs against the plain
session or function, a replacement against a hand-edited model."""

import collections
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402


class CountingTool(amanda.Tool):
    """A routine before every op, counting the runs per point id; analysis
    also keeps ``get_op()`` per id."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.ops = {}
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        op_id = context.get_op_id()
        self.ops[op_id] = context.get_op()
        context.insert_before_op(self.count, inputs=[], op_id=op_id)

    def count(self, op_id):
        self.counts[op_id] += 1


class ObservingTool(amanda.Tool):
    """Reads every input before and every output after each op; returns None."""

    def __init__(self):
        super().__init__()
        self.seen = 0
        self.add_inst_for_op(self.analysis)
        self.add_inst_for_op(self.analysis_after, require_outputs=True)

    def analysis(self, context):
        context.insert_before_op(self.observe)

    def analysis_after(self, context):
        context.insert_after_op(self.observe)

    def observe(self, *arrays):
        self.seen += 1
        for array in arrays:
            if array is not None:
                np.sum(array)


class ReplaceTanhInBodies(amanda.Tool):
    """Replaces every Tanh inside a function body by a sigmoid."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get_op().type == "Tanh" and "/body/" in context.get_op_id():
            context.replace_op(self.sigmoid)

    @staticmethod
    def sigmoid(x):
        return (1.0 / (1.0 + np.exp(-x))).astype(x.dtype)


def _loop_graph(activation=tf.tanh):
    """while i < n: v = act(v) * 2; then cond(sum(x) > 0, y * 2, y - 1)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        n = tf.compat.v1.placeholder(tf.int32, [], name="n")
        _, y = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, activation(v) * 2.0),
                             [0, x], name="loop")
        z = tf.cond(tf.reduce_sum(x) > 0, lambda: y * 2, lambda: y - 1, name="branch")
    return graph, x, n, z


def _session_run(tool, graph, fetch, feed):
    session = tf.compat.v1.Session(graph=graph)
    plain = session.run(fetch, feed)
    with amanda.apply(tool):
        out = session.run(fetch, feed)
    return plain, out


@pytest.mark.parametrize("trips", [0, 1, 4])
def test_body_ops_run_once_per_iteration_and_only_in_the_taken_branch(trips):
    graph, x, n, z = _loop_graph()
    tool = CountingTool()
    values = np.array([1, -2, 3, 0.5], np.float32)   # sum > 0: then_branch
    plain, out = _session_run(tool, graph, z, {x: values, n: trips})
    assert np.array_equal(plain, out)
    counts = tool.counts
    body = [k for k in tool.ops if k.startswith("loop/body/")]
    cond = [k for k in tool.ops if k.startswith("loop/cond/")]
    assert "loop/body/Tanh" in body and "loop/cond/Less" in cond
    assert all(counts[k] == trips for k in body)
    assert all(counts[k] == trips + 1 for k in cond)        # the last test fails
    then_ops = [k for k in tool.ops if k.startswith("branch/then_branch/")]
    else_ops = [k for k in tool.ops if k.startswith("branch/else_branch/")]
    assert then_ops and else_ops
    assert all(counts[k] == 1 for k in then_ops) and not any(counts[k] for k in else_ops)
    assert counts["loop"] == 1 and counts["branch"] == 1      # the call ops stay points


def test_body_ops_are_ops_of_the_body_graph():
    graph, x, n, z = _loop_graph()
    tool = CountingTool()
    _session_run(tool, graph, z, {x: np.ones(4, np.float32), n: 2})
    op = tool.ops["loop/body/Tanh"]
    assert isinstance(op, tf.Operation) and op.type == "Tanh" and op.name == "loop/body/Tanh"
    assert op.graph is not graph                      # the body's own FuncGraph
    assert tool.ops["loop"].graph is graph


def test_nested_bodies_are_points_recursively():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")

        def body(i, v):
            v = tf.cond(tf.equal(i % 2, 0), lambda: tf.sin(v), lambda: tf.cos(v), name="inner")
            return i + 1, v

        _, y = tf.while_loop(lambda i, v: i < 5, body, [0, x], name="outer")
    tool = CountingTool()
    plain, out = _session_run(tool, graph, y, {x: np.arange(3, dtype=np.float32)})
    assert np.array_equal(plain, out)
    assert tool.counts["outer/body/inner"] == 5
    assert tool.counts["outer/body/inner/then_branch/Sin"] == 3     # i = 0, 2, 4
    assert tool.counts["outer/body/inner/else_branch/Cos"] == 2     # i = 1, 3


def _rewrites_off():
    config = tf.compat.v1.ConfigProto()
    options = config.graph_options.rewrite_options
    from tensorflow.core.protobuf import rewriter_config_pb2
    options.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    return config


@pytest.mark.parametrize("make_tool", [ObservingTool, IdentityTool])
def test_observers_and_identity_routines_everywhere_are_bit_identical(make_tool):
    graph, x, n, z = _loop_graph()
    with graph.as_default():
        grad = tf.gradients(z, x)[0]
    session = tf.compat.v1.Session(graph=graph, config=_rewrites_off())
    feed = {x: np.array([0.3, -1.2, 2.0, 0.7], np.float32), n: 3}
    plain = session.run([z, grad], feed)
    tool = make_tool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amanda.NotBitExactWarning)
        with amanda.apply(tool):
            out = session.run([z, grad], feed)
    assert all(np.array_equal(a, b) for a, b in zip(plain, out))
    if isinstance(tool, ObservingTool):
        assert tool.seen > 0


def test_a_replacement_in_a_body_computes_what_the_edited_model_does():
    feed_values = np.array([0.3, -1.2, 2.0, 0.7], np.float32)
    graph, x, n, z = _loop_graph()
    plain, out = _session_run(ReplaceTanhInBodies(), graph, z, {x: feed_values, n: 3})
    edited, ex, en, ez = _loop_graph(tf.sigmoid)
    expected = tf.compat.v1.Session(graph=edited).run(ez, {ex: feed_values, en: 3})
    assert not np.allclose(plain, out)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_function_bodies_in_a_tf_function():
    @tf.function
    def f(x, n):
        _, y = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, tf.tanh(v) * 2.0),
                             [0, x], name="loop")
        return tf.cond(tf.reduce_sum(y) > 0, lambda: y * 2, lambda: y - 1, name="branch")

    x = tf.constant([0.5, 1.0, -0.25, 2.0])
    plain = f(x, tf.constant(3)).numpy()
    concrete = f.get_concrete_function(x, tf.constant(3))
    before = concrete.graph.as_graph_def().SerializeToString(deterministic=True)
    tool = CountingTool()
    with amanda.apply(tool):
        out = f(x, tf.constant(3)).numpy()
    assert np.array_equal(plain, out)
    # in a tf.function the body's nodes keep their name scope: the FunctionDef
    # node "loop/Tanh" of the While "loop"'s body is the point "loop/body/loop/Tanh"
    assert tool.ops["loop/body/loop/Tanh"].type == "Tanh"
    assert tool.counts["loop/body/loop/Tanh"] == 3 and tool.counts["loop/cond/loop/Less"] == 4
    then_ops = [k for k in tool.ops if k.startswith("branch/then_branch/")]
    else_ops = [k for k in tool.ops if k.startswith("branch/else_branch/")]
    assert then_ops and else_ops
    assert all(tool.counts[k] == 1 for k in then_ops)
    assert not any(tool.counts[k] for k in else_ops)
    # the user's function is left as it was
    assert concrete.graph.as_graph_def().SerializeToString(deterministic=True) == before
    assert np.array_equal(f(x, tf.constant(3)).numpy(), plain)


def test_the_users_graph_and_library_are_unchanged():
    graph, x, n, z = _loop_graph()
    before = graph.as_graph_def().SerializeToString(deterministic=True)
    _session_run(CountingTool(), graph, z, {x: np.ones(4, np.float32), n: 2})
    _session_run(ReplaceTanhInBodies(), graph, z, {x: np.ones(4, np.float32), n: 2})
    assert graph.as_graph_def().SerializeToString(deterministic=True) == before
    session = tf.compat.v1.Session(graph=graph)
    edited_free = session.run(z, {x: np.ones(4, np.float32), n: 2})
    expected = np.ones(4, np.float32)
    for _ in range(2):
        expected = np.tanh(expected) * 2
    np.testing.assert_allclose(edited_free, expected * 2, rtol=1e-6)


def test_keras_lstm_loop_body_matmuls_are_points_and_outputs_bit_identical():
    keras = pytest.importorskip("keras")
    layer = keras.layers.LSTM(6, return_sequences=True, unroll=False)
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 5, 3)).astype(np.float32))
    layer(x)

    @tf.function
    def f(x):
        return layer(x)

    plain = f(x).numpy()
    counting, observing = CountingTool(), ObservingTool()
    with amanda.apply(counting):
        counted = f(x).numpy()
    with amanda.apply(observing):
        observed = f(x).numpy()
    assert np.array_equal(plain, counted) and np.array_equal(plain, observed)
    matmuls = {k: v for k, v in counting.counts.items()
               if "/body/" in k and counting.ops[k].type == "MatMul"}
    assert matmuls, sorted(counting.ops)
    assert all(v == 5 for v in matmuls.values())      # once per time step
    assert observing.seen > 0


class BackwardTool(amanda.Tool):
    """Keeps context values from forward to backward: a forward routine
    stores the op id in the context; backward routines count runs per
    (forward id, backward id) and check the id came through."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True)

    def forward(self, context):
        context["seen_forward"] = context.get_op_id()

    def backward(self, context):
        key = (context.get_op_id(), context.get_backward_op_id())
        if context.get_op() is not None:
            assert context["seen_forward"] == context.get_op_id()
        context.insert_before_backward_op(self.count, grad_outputs=[], key=key)

    def count(self, key):
        self.counts[key] += 1


def test_gradient_body_ops_map_to_the_forward_body_ops():
    graph, x, n, z = _loop_graph()
    with graph.as_default():
        grad = tf.gradients(z, x)[0]
    tool = BackwardTool()
    feed = {x: np.array([0.3, -1.2, 2.0, 0.7], np.float32), n: 3}
    plain, out = _session_run(tool, graph, grad, feed)
    assert np.array_equal(plain, out)
    tanh_grads = {k: v for k, v in tool.counts.items() if k[0] == "loop/body/Tanh"}
    assert tanh_grads, sorted(tool.counts)
    (forward_id, backward_id), runs = next(iter(tanh_grads.items()))
    assert backward_id.startswith("gradients/") and "/body/" in backward_id
    assert backward_id.endswith("Tanh_grad/TanhGrad") and runs == 3    # once per iteration
    # ops of the gradient body with no forward body op are backward points
    # with no forward op, as at top level
    assert any(k[0] is None and "/body/" in k[1] for k in tool.counts)


def test_case_branches_and_nested_function_calls():
    @tf.function
    def inner(v):
        return tf.sin(v) * 3.0

    @tf.function
    def f(x, k):
        y = tf.switch_case(k, [lambda: x + 1.0, lambda: tf.exp(x), lambda: x * x], name="case")
        return inner(y)

    x = tf.constant([0.25, -0.5, 1.5])
    plain = f(x, tf.constant(1)).numpy()
    tool = CountingTool()
    with amanda.apply(tool):
        out = f(x, tf.constant(1)).numpy()
    assert np.array_equal(plain, out)
    # tf.switch_case names its Case op "<name>/indexed_case"
    ran = {k for k, v in tool.counts.items() if v}
    assert tool.ops["case/indexed_case/branches/1/case/indexed_case/Exp"].type == "Exp"
    assert tool.counts["case/indexed_case/branches/1/case/indexed_case/Exp"] == 1
    assert not any(k.startswith(("case/indexed_case/branches/0/",
                                 "case/indexed_case/branches/2/")) for k in ran)
    assert any(k.startswith("case/indexed_case/branches/2/") for k in tool.ops)
    calls = [k for k, op in tool.ops.items() if op.type in ("PartitionedCall",
                                                           "StatefulPartitionedCall")]
    assert calls
    assert any(tool.ops[k].type == "Sin" and tool.counts[k] == 1 for k in tool.ops
               if k.startswith(calls[0] + "/f/"))


def test_portable_identity_routines_in_bodies_are_bit_identical():
    graph, x, n, z = _loop_graph()
    plain, out = _session_run(IdentityTool(portable=True), graph, z,
                              {x: np.array([0.3, -1.2, 2.0, 0.7], np.float32), n: 4})
    assert np.array_equal(plain, out)


def test_evaluate_on_a_body_tensor_says_why_it_cannot():
    from amanda.runtime.tensorflow import evaluate

    class Evaluating(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analysis)

        def analysis(self, context):
            if context.get_op_id() == "loop/body/Tanh":
                evaluate(context.get_inputs()[0])

    graph, x, n, z = _loop_graph()
    from amanda.errors import BackendError

    with pytest.raises(BackendError, match="function body 'loop/body'"):
        _session_run(Evaluating(), graph, z, {x: np.ones(4, np.float32), n: 2})


def test_a_body_that_cannot_be_rebuilt_runs_as_it_is_and_is_said(monkeypatch):
    from amanda.runtime.tensorflow import body_rewrite as tensorflow_body_rewrite   # where _BodyRewrite looks it up

    def fails(prefix, fdef, library):
        raise RuntimeError("no")

    monkeypatch.setattr(tensorflow_body_rewrite, "_prefixed_body", fails)
    graph, x, n, z = _loop_graph()
    tool = CountingTool()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, out = _session_run(tool, graph, z, {x: np.ones(4, np.float32), n: 2})
    assert np.array_equal(plain, out)
    said = [str(w.message) for w in caught
            if issubclass(w.category, amanda.NotInstrumentedWarning)]
    assert any("loop/body" in m and "RuntimeError: no" in m for m in said)
    assert tool.counts["loop"] == 1 and not any("/body/" in k for k in tool.ops)


def test_gradients_of_a_loop_added_after_an_instrumented_run_is_a_clear_error():
    """tf.gradients of a While built after the graph ran changes the forward
    While in place (more outputs). Plain TF cannot run that in the same session
    either; amanda says why instead of an IndexError from its copy."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3])
        w = tf.compat.v1.get_variable("w_late", initializer=tf.ones([3]))
        out = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, tf.tanh(v * w)),
                            [tf.constant(0), x])[1]
        loss = tf.reduce_sum(out)
    session = tf.compat.v1.Session(graph=graph)
    session.run(w.initializer)
    feed = {x: np.array([0.1, 0.2, 0.3], np.float32)}
    # exiting apply hands the variables back through the user's session, which
    # TF cannot run any more (the same error a plain run gives)
    with pytest.raises(tf.errors.InvalidArgumentError, match="output_all_intermediates"):
        with amanda.apply(IdentityTool()):
            session.run(loss, feed)
            with graph.as_default():
                grads = tf.compat.v1.gradients(loss, [w])
            with pytest.raises(amanda.BackendError, match="output_all_intermediates"):
                session.run(grads, feed)
