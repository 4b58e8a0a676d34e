"""TensorFlow graph mode: Session.run executes the instrumented copy."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402


def dense_graph():
    """x @ w -> relu -> sum, its gradients and a training op."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 2]), use_resource=True)
        y = tf.nn.relu(tf.matmul(x, w, name="matmul"), name="relu")
        loss = tf.reduce_sum(y, name="loss")
        grads = tf.compat.v1.gradients(loss, [w])
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return graph, dict(x=x, w=w, y=y, loss=loss, grads=grads, train=train, init=init)


X = np.array([[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]], np.float32)


class Counter(amanda.Tool):
    def __init__(self, op_type, backward_type):
        super().__init__()
        self.op_type, self.backward_type = op_type, backward_type
        self.count = self.backward_count = 0
        self.backward_owners = []
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True, require_outputs=True)

    def forward(self, context):
        if context.get_op().type == self.op_type:
            context.insert_before_op(self.tick)

    def backward(self, context):
        if context.get_backward_op().type == self.backward_type:
            self.backward_owners.append(context.get_op())
            context.insert_after_backward_op(self.tick_backward)

    def tick(self, *arrays):
        self.count += 1

    def tick_backward(self, *arrays):
        self.backward_count += 1


def test_routines_run_every_execution_and_user_graph_is_untouched():
    graph, t = dense_graph()
    names_before = [op.name for op in graph.get_operations()]
    collections_before = {k: list(graph.get_collection(k)) for k in graph.get_all_collection_keys()}
    tool = Counter("MatMul", "MatMul")
    with amanda.apply(tool):
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(t["init"])
            for _ in range(3):
                sess.run(t["grads"], {t["x"]: X})
    assert tool.count == 3
    # MatMul's gradient w.r.t. w is a MatMul owned by the forward matmul
    assert tool.backward_count == 3
    assert {op.name for op in tool.backward_owners} == {"matmul"}
    assert [op.name for op in graph.get_operations()] == names_before
    assert {k: list(graph.get_collection(k)) for k in graph.get_all_collection_keys()} \
        == collections_before


class Shift(amanda.Tool):
    """Adds 1 to the matmul's inputs and 10 to the relu's output."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "MatMul":
            context.insert_before_op(lambda a, b: (a + 1, b + 1))
        if context.get_op().type == "Relu":
            context.insert_after_op(lambda y: y + 10)


def test_routines_change_values_and_vanilla_outside_apply():
    graph, t = dense_graph()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        vanilla = sess.run(t["y"], {t["x"]: X})
        with amanda.apply(Shift()):
            for _ in range(2):
                shifted = sess.run(t["y"], {t["x"]: X})
                expected = np.maximum((X + 1) @ (np.ones((3, 2), np.float32) + 1), 0) + 10
                np.testing.assert_allclose(shifted, expected)
        np.testing.assert_array_equal(sess.run(t["y"], {t["x"]: X}), vanilla)


def test_variables_updated_in_one_run_are_seen_in_the_next_and_handed_back():
    graph, t = dense_graph()
    tool = Counter("MatMul", "MatMul")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        with amanda.apply(tool):
            losses = [sess.run([t["loss"], t["train"]], {t["x"]: X})[0] for _ in range(3)]
        trained = sess.run(t["w"])   # outside apply: the plain session
    # relu passes the first row only: d loss / d w = x[0] per column
    assert losses[0] > losses[1] > losses[2]
    expected = np.ones((3, 2), np.float32) - 3 * 0.1 * X[0][:, None]
    np.testing.assert_allclose(trained, expected, rtol=1e-6)
    assert tool.count == 3


def test_graph_growth_analyses_only_new_ops():
    graph, t = dense_graph()
    analysed = []
    tool = amanda.Tool()
    tool.add_inst_for_op(lambda c: analysed.append(c.get_op().name))
    with amanda.apply(tool):
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(t["init"])
            first = len(analysed)
            sess.run(t["y"], {t["x"]: X})
            assert len(analysed) == first          # cached: graph unchanged
            with graph.as_default():
                z = tf.multiply(t["y"], 2.0, name="double")
            assert sess.run(z, {t["x"]: X}).shape == (2, 2)
    assert analysed[first:] == ["double/y", "double"]
    assert len(set(analysed)) == len(analysed)


def test_tool_error_leaves_tensorflow_untouched():
    from tensorflow.python.client import session as tf_session
    original = tf_session.BaseSession.run

    class Broken(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op().type == "Relu":
                raise KeyError("nope")

    graph, t = dense_graph()
    before = [op.name for op in graph.get_operations()]
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        with pytest.raises(amanda.ToolError, match=r"op 'Relu' \(id relu\).*tensorflow/"):
            with amanda.apply(Broken()):
                sess.run(t["y"], {t["x"]: X})
        assert tf_session.BaseSession.run is original
        assert [op.name for op in graph.get_operations()] == before
        assert sess.run(t["y"], {t["x"]: X}).shape == (2, 2)


def test_tf_function_calls_run_the_instrumented_function():
    w = tf.Variable(tf.ones([3, 2]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)))
        grad = tape.gradient(loss, w)
        w.assign_sub(0.1 * grad)
        return loss

    tool = Counter("MatMul", "MatMul")
    vanilla_w = tf.Variable(tf.ones([3, 2]))
    with amanda.apply(tool):
        losses = [float(step(tf.constant(X))) for _ in range(3)]
    assert tool.count == 3
    assert tool.backward_count == 3
    assert losses[0] > losses[1] > losses[2]
    # the variable was updated through its handle: the same state as plain calls
    expected = vanilla_w.numpy() - 3 * 0.1 * X[0][:, None]
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)
    before = tool.count
    step(tf.constant(X))     # outside apply: vanilla, no routine runs
    assert tool.count == before


def test_identity_on_every_op_is_bit_exact_and_runs_everywhere():
    from amanda.tools.identity import IdentityTool
    graph, t = dense_graph()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        vanilla = sess.run([t["y"], t["grads"]], {t["x"]: X})
        tool = IdentityTool()
        with amanda.apply(tool):
            for _ in range(2):
                instrumented = sess.run([t["y"], t["grads"]], {t["x"]: X})
                np.testing.assert_array_equal(instrumented[0], vanilla[0])
                np.testing.assert_array_equal(instrumented[1][0], vanilla[1][0])
    assert all(count > 0 for count in tool.calls.values()), tool.calls


class VariableOps(amanda.Tool):
    """Counts runs of VarHandleOp (no input: a bare routine), sees the
    resource handle read by ReadVariableOp (None: it stays in TF) and counts
    runs of the training op (no outputs)."""

    def __init__(self):
        super().__init__()
        self.handles = self.trained = 0
        self.reads = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        op = context.get_op()
        if op.type == "VarHandleOp":
            context.insert_before_op(self.handle)
        if op.type == "ReadVariableOp":
            context.insert_before_op(self.reads.append)
        if op.type == "NoOp" and op.name.startswith("GradientDescent"):
            context.insert_after_op(self.train)

    def handle(self):
        self.handles += 1

    def train(self):
        self.trained += 1


def test_routines_on_variables_and_on_ops_without_outputs():
    graph, t = dense_graph()
    tool = VariableOps()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        with amanda.apply(tool):
            for _ in range(2):
                sess.run(t["train"], {t["x"]: X})    # fetching the op runs its after-routine
    # once per run: the variable syncs into and out of the shadow run none
    assert tool.handles == 2
    assert tool.trained == 2
    assert tool.reads and set(tool.reads) == {None}


def test_nested_scopes_hand_variables_over():
    graph, t = dense_graph()
    outer, inner = Counter("MatMul", "MatMul"), Counter("Relu", "ReluGrad")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        with amanda.apply(outer):
            sess.run(t["train"], {t["x"]: X})
            with amanda.apply(inner):
                sess.run(t["train"], {t["x"]: X})
            sess.run(t["train"], {t["x"]: X})
        trained = sess.run(t["w"])
    assert (outer.count, inner.count) == (3, 1)
    # three steps, each seeing the previous one's update, wherever it ran
    expected = np.ones((3, 2), np.float32) - 3 * 0.1 * X[0][:, None]
    np.testing.assert_allclose(trained, expected, rtol=1e-6)


def test_disabled_runs_inside_apply_see_the_trained_variables():
    graph, t = dense_graph()
    tool = Counter("MatMul", "MatMul")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        with amanda.apply(tool):
            sess.run(t["train"], {t["x"]: X})
            with amanda.disabled():
                once = sess.run(t["w"])         # the plain session, up to date
                sess.run(t["train"], {t["x"]: X})
            sess.run(t["train"], {t["x"]: X})   # the shadow again, from there
        trained = sess.run(t["w"])
    assert tool.count == 2
    step = 0.1 * X[0][:, None]
    np.testing.assert_allclose(once, np.ones((3, 2), np.float32) - step, rtol=1e-6)
    np.testing.assert_allclose(trained, np.ones((3, 2), np.float32) - 3 * step, rtol=1e-6)


def test_variables_created_inside_apply_are_handed_back():
    graph, t = dense_graph()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(t["init"])
        with amanda.apply(Counter("MatMul", "MatMul")):
            sess.run(t["y"], {t["x"]: X})
            with graph.as_default():
                v = tf.compat.v1.get_variable("late", initializer=tf.zeros([2]), use_resource=True)
                bump = v.assign_add(tf.ones([2]))
            sess.run(v.initializer)
            sess.run(bump)
        np.testing.assert_array_equal(sess.run(v), [1.0, 1.0])


def test_session_closed_inside_apply():
    graph, t = dense_graph()
    tool = Counter("MatMul", "MatMul")
    with amanda.apply(tool):
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(t["init"])
            sess.run(t["y"], {t["x"]: X})
    assert tool.count == 1


def test_identity_through_control_flow_and_its_gradients():
    """Control flow v2: the forward While reads accumulators that
    tf.gradients adds; they are gradient ops without owner."""
    from amanda.tools.identity import IdentityTool
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3])
        w = tf.compat.v1.get_variable("w", initializer=tf.fill([3], 1.5), use_resource=True)
        looped = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * w), [0, x])[1]
        y = tf.cond(tf.reduce_sum(x) > 0, lambda: looped * 2, lambda: looped)
        grads = tf.compat.v1.gradients(tf.reduce_sum(y), [w, x])
        init = tf.compat.v1.global_variables_initializer()
    ones = np.ones(3, np.float32)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        vanilla = sess.run([y, grads], {x: ones})
        tool = IdentityTool()
        with amanda.apply(tool):
            instrumented = sess.run([y, grads], {x: ones})
    np.testing.assert_array_equal(instrumented[0], vanilla[0])
    for a, b in zip(instrumented[1], vanilla[1]):
        np.testing.assert_array_equal(a, b)
    assert tool.calls["after_backward_op"] > 0


def test_v1_reference_variables_train_and_are_handed_back():
    """``VariableV2`` (``float32_ref`` tensors stay in TF: routines get None)."""
    from amanda.tools.identity import IdentityTool
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3])
        w = tf.compat.v1.Variable(tf.ones([3, 2]), use_resource=False, name="w")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_sum(tf.matmul(x, w)))
        init = tf.compat.v1.global_variables_initializer()
    assert w.op.type == "VariableV2"
    ones = np.ones((2, 3), np.float32)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        with amanda.apply(IdentityTool()):
            for _ in range(2):
                sess.run(train, {x: ones})
        np.testing.assert_allclose(sess.run(w), np.full((3, 2), 1 - 2 * 0.1 * 2), rtol=1e-6)
