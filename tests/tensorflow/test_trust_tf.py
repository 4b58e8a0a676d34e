"""Issue 13, TensorFlow part: results, fetches and errors inside ``apply`` are
the ones TensorFlow gives outside it, or a loud amanda error.

* hosted routines cannot write into TensorFlow's buffers, an observing
  routine feeds nothing into the graph, and routines reading a variable run
  before its later updates (a tf.function training step stays bit-exact);
* ``Session.run`` answers every fetch kind exactly as without amanda;
* a routine's error reaches the caller as a `amanda.ToolError` chained to
  the routine's exception; a replacement of another shape or dtype is one;
* ``make_callable`` runs instrumented, ``partial_run`` is refused.
"""

import collections
import contextlib

import numpy as np
import pytest

import amanda
from amanda import controls, portable

tf = pytest.importorskip("tensorflow")
v1 = tf.compat.v1


# -- helpers ------------------------------------------------------------------------


class Observe(amanda.Tool):
    """Observe-only routines before and after the chosen ops (all by default),
    forward and backward."""

    def __init__(self, types=None, points=("before", "after"), backward=True):
        super().__init__()
        self.types, self.points, self.calls = types, points, 0
        self.add_inst_for_op(self.analyse)
        if backward:
            self.add_inst_for_op(self.analyse_backward, backward=True, require_outputs=True)

    def _wanted(self, op):
        return op is not None and (self.types is None or op.type in self.types)

    def analyse(self, context):
        if self._wanted(context.get_op()):
            if "before" in self.points:
                context.insert_before_op(self.observe)
            if "after" in self.points:
                context.insert_after_op(self.observe)

    def analyse_backward(self, context):
        if self._wanted(context.get_backward_op()):
            if "before" in self.points:
                context.insert_before_backward_op(self.observe)
            if "after" in self.points:
                context.insert_after_backward_op(self.observe)

    def observe(self, *arrays):
        self.calls += 1


class Routine(amanda.Tool):
    """One routine at ``point`` ("before", "after", "replace", "after_backward")
    of the ops of type ``op_type``."""

    def __init__(self, op_type, routine, point="before", **select):
        super().__init__()
        self.op_type, self.routine, self.point, self.select = op_type, routine, point, select
        self.add_inst_for_op(self.analyse)
        self.add_inst_for_op(self.analyse_backward, backward=True, require_outputs=True)

    def analyse(self, context):
        if context.get_op().type == self.op_type and self.point in ("before", "after", "replace"):
            {"before": context.insert_before_op, "after": context.insert_after_op,
             "replace": context.replace_op}[self.point](self.routine, **self.select)

    def analyse_backward(self, context):
        if context.get_backward_op().type == self.op_type and self.point == "after_backward":
            context.insert_after_backward_op(self.routine, **self.select)


def dense_training(seed=0):
    """A two-layer Dense model and a tf.function SGD step (forward, tape,
    update) returning the outputs and the loss."""
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(4)])
    optimizer = tf.keras.optimizers.SGD(0.05)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = model(x)
            loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return y, loss

    return model, step


def train(make, x, steps, tool=None):
    model, step = make()
    if tool is None:
        outs = [[t.numpy() for t in step(x)] for _ in range(steps)]
    else:
        with amanda.apply(tool):
            outs = [[t.numpy() for t in step(x)] for _ in range(steps)]
    return outs, [w.numpy() for w in model.trainable_weights]


def assert_bit_exact(got, want):
    (outs, weights), (ref_outs, ref_weights) = got, want
    for step, (a, b) in enumerate(zip(outs, ref_outs)):
        for u, v in zip(a, b):
            assert np.array_equal(u, v), f"step {step} differs by {np.abs(u - v).max()}"
    for u, v in zip(weights, ref_weights):
        assert np.array_equal(u, v)


def function_copies():
    """The instrumented copies of tf.function graphs in the innermost scope."""
    table = controls.state.sessions[-1].caches.get("tensorflow_functions", {})
    return [copy.rewrite.copy for copy in table.values()]


X = np.random.RandomState(0).randn(5, 8).astype(np.float32)


# -- 0. training steps under observe-only tools -------------------------------------


@pytest.mark.parametrize("tool", [
    lambda: Observe(),                                        # every op, both points
    lambda: Observe({"ReadVariableOp"}, ("after",)),          # the variable reads alone
    lambda: Observe({"MatMul"}, ("before",), backward=False),  # before the weights' consumers
])
def test_tf_function_training_is_bit_exact_under_observers(tool):
    want = train(dense_training, X, 4)
    tool = tool()
    assert_bit_exact(train(dense_training, X, 4, tool), want)
    assert tool.calls > 0


def test_routines_cannot_write_into_tensorflow_buffers():
    """A routine writing into its argument would write into the variable (the
    array shares its memory): it gets a read-only array, and the error says so."""
    v = tf.Variable(np.ones((3, 3), np.float32))

    @tf.function
    def read():
        return tf.identity(v.read_value())

    def clobber(x):
        x[...] = 7

    with pytest.raises(amanda.ToolError, match="clobber") as info:
        with amanda.apply(Routine("ReadVariableOp", clobber, "after")):
            read()
    assert isinstance(info.value.__cause__, ValueError)
    assert np.array_equal(v.numpy(), np.ones((3, 3), np.float32))


def test_an_observing_routine_feeds_the_original_tensor_on():
    """Where the routine returns None the consumers read the original tensor
    (through Merge), not the callback's output; a routine replacing only
    sometimes is honoured each time."""
    calls = []

    def sometimes(x):
        calls.append(1)
        return x * 2 if len(calls) % 2 == 0 else None

    @tf.function
    def f(a):
        return tf.nn.relu(a) + 1.0

    a = tf.constant([[1.0, -2.0]])
    with amanda.apply(Routine("Relu", sometimes, "after")):
        first, second = f(a).numpy(), f(a).numpy()
        (copy,) = function_copies()
    assert np.array_equal(first, [[2.0, 1.0]]) and np.array_equal(second, [[3.0, 1.0]])
    add = next(op for op in copy.get_operations() if op.type == "AddV2")
    merge = add.inputs[0].op
    if merge.type == "EnsureShape":   # the shape stated for Grappler
        merge = merge.inputs[0].op
    assert merge.type == "Merge"
    kept = merge.inputs[0].op
    assert kept.type == "Switch" and kept.inputs[0].op.type == "Relu"


def test_routines_on_a_variable_read_run_before_its_update():
    """Before-routines of the MatMul reading a weight are control inputs of
    the weight's later update in the instrumented tf.function."""
    with amanda.apply(Observe({"MatMul"}, ("before",), backward=False)):
        dense_training()[1](X)
        (copy,) = function_copies()
    updates = [op for op in copy.get_operations() if op.type == "AssignSubVariableOp"]
    assert updates
    for update in updates:
        # the update of each kernel waits on a routine (directly)
        waits = [c.type for c in update.control_inputs]
        if "kernel" in update.inputs[0].op.name or any("MatMul" in c.name for c in update.control_inputs):
            assert "PyFunc" in waits
    assert any("PyFunc" in [c.type for c in u.control_inputs] for u in updates)


@pytest.mark.slow
def test_convnext_training_step_is_exact_under_observers():
    """ConvNeXtTiny, forward + tape + SGD in one tf.function, observe-only
    routines after every variable read and before every MatMul: the same
    outputs and weights as without amanda, with Grappler's float rewrites
    off (they cannot see through routines; see docs/tensorflow.md)."""
    x = np.random.RandomState(0).randn(2, 32, 32, 3).astype(np.float32)

    def make():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3),
                                                   classes=10)
        optimizer = tf.keras.optimizers.SGD(0.01)

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = model(x)
                loss = tf.reduce_sum(y * y)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_weights),
                                          model.trainable_weights))
            return y, loss

        return model, step

    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        want = train(make, x, 3)
        got = train(make, x, 3, Observe({"ReadVariableOp", "MatMul"}, backward=False))
    finally:
        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": saved.get("disable_meta_optimizer", False)})
    assert_bit_exact(got, want)


# -- 1. fetches inside apply are what TF returns outside it --------------------------

Pair = collections.namedtuple("Pair", "first second")


def fetch_graph():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="w")
        ref = v1.Variable(np.float32(2.0), name="ref", use_resource=False)
        y = tf.matmul(x, w, name="y") * ref
        names = tf.constant([b"a", b"bc"], name="names")
        sparse = tf.SparseTensor([[0, 1], [1, 0]], [1.5, 2.5], [2, 2])
        sparse_in = v1.sparse_placeholder(tf.float32, name="sparse_in")
        sparse_sum = tf.sparse.reduce_sum(sparse_in, name="sparse_sum")
        step = w.assign_add(tf.ones((3, 2)), name="step").op
        init = v1.global_variables_initializer()
    return graph, dict(x=x, w=w, ref=ref, y=y, names=names, sparse=sparse, sparse_in=sparse_in,
                       sparse_sum=sparse_sum, step=step, init=init)


def same(a, b):
    """Equal values of the same types, recursively."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            same(u, v)
    elif isinstance(a, np.ndarray) or isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    else:
        assert a == b


def test_fetches_inside_apply_equal_fetches_outside():
    graph, t = fetch_graph()
    feed = {t["x"]: np.ones((2, 3), np.float32)}
    sparse_value = v1.SparseTensorValue([[0, 0], [1, 1]], np.float32([3, 4]), [2, 2])
    cases = [
        (t["w"], None),                                   # a resource variable: its value
        (t["ref"], None),                                 # a v1 reference variable
        (t["step"], None),                                # an operation: None
        (t["y"], feed),
        ("y:0", {"x:0": np.ones((1, 3), np.float32)}),    # names, as fetch and as feed key
        ({"y": t["y"], "w": [t["w"], (t["names"],)]}, feed),
        (Pair(t["y"], [t["ref"], t["names"]]), feed),
        (t["names"], None),                               # strings
        (t["sparse"], None),                              # SparseTensorValue
        ([t["sparse_sum"], t["sparse_in"]], {t["sparse_in"]: sparse_value}),  # sparse feed
        ([t["x"], t["y"]], feed),                         # a fetched feed: the fed value
    ]
    with graph.as_default():
        plain = v1.Session()
        instrumented = v1.Session()
    plain.run(t["init"])
    instrumented.run(t["init"])
    tool = Observe()
    for fetches, feed_dict in cases:
        want = plain.run(fetches, feed_dict)
        with amanda.apply(tool):
            got = instrumented.run(fetches, feed_dict)
        same(got, want)
    assert tool.calls > 0


def test_make_callable_runs_instrumented_and_partial_run_is_refused():
    graph, t = fetch_graph()
    with graph.as_default():
        session = v1.Session()
    session.run(t["init"])
    before_scope = session.make_callable(t["w"])
    tool = Observe({"MatMul", "ReadVariableOp"})
    with amanda.apply(tool):
        inside = session.make_callable([t["y"], t["w"]], feed_list=[t["x"]])
        y, w = inside(np.ones((1, 3), np.float32))
        counted = tool.calls
        assert counted > 0
        same(before_scope(), session.run(t["w"]))
        assert tool.calls > counted                      # made before apply, instrumented too
        with pytest.raises(amanda.AmandaError, match="partial_run"):
            session.partial_run_setup([t["y"]], [t["x"]])
    same(y, session.run(t["y"], {t["x"]: np.ones((1, 3), np.float32)}))
    same(before_scope(), w)


# -- 2 and 3. routine errors and replacements of another shape or dtype --------------


def session_case():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [64], name="x")
        w = tf.Variable(np.ones(64, np.float32), name="w")
        y = tf.reduce_sum(tf.square(x * w, name="sq"), name="total")
        (grad,) = v1.gradients(y, [w])
        init = v1.global_variables_initializer()
        session = v1.Session()
    session.run(init)
    return session, x, y, grad


def function_case():
    @tf.function
    def f(a):
        return tf.reduce_sum(tf.square(a, name="sq"))
    return f


def boom(*arrays):
    raise KeyError("boom")


@pytest.mark.parametrize("backend", ["session", "function"])
def test_a_routine_error_is_a_tool_error_chained_to_it(backend):
    tool = Routine("Square", boom, "before")
    with pytest.raises(amanda.ToolError) as info:
        with amanda.apply(tool):
            if backend == "session":
                session, x, y, _ = session_case()
                session.run(y, {x: np.ones(64, np.float32)})
            else:
                function_case()(tf.ones(64))
    assert isinstance(info.value.__cause__, KeyError)
    message = str(info.value)
    assert "boom" in message and "Square" in message and "before_op" in message


BAD_RESULTS = {
    "shape": (lambda x: x[:1], "shape"),
    "dtype": (lambda x: x.astype(np.float64), "dtype"),
    "resource": (lambda *xs: [np.zeros(1)] * len(xs), "cannot leave TensorFlow"),
}


@pytest.mark.parametrize("bad", sorted(BAD_RESULTS))
def test_a_replacement_of_another_shape_or_dtype_is_a_tool_error(bad):
    routine, words = BAD_RESULTS[bad]
    session, x, y, _ = session_case()
    if bad == "resource":
        tool = Routine("ReadVariableOp", routine, "before")
    else:
        tool = Routine("Square", routine, "before")
    with pytest.raises(amanda.ToolError, match=words) as info:
        with amanda.apply(tool):
            session.run(y, {x: np.ones(64, np.float32)})
    assert info.value.op_name in ("Square", "ReadVariableOp")


def test_a_wrong_shape_backward_result_is_a_tool_error():
    session, x, y, grad = session_case()
    tool = Routine("Mul", lambda *grads: [g[:2] for g in grads], "after_backward")
    with pytest.raises(amanda.ToolError, match="shape"):
        with amanda.apply(tool):
            session.run(grad, {x: np.ones(64, np.float32)})


def test_replace_op_results_are_checked():
    f = function_case()
    with pytest.raises(amanda.ToolError, match="output 0"):
        with amanda.apply(Routine("Square", lambda a: (a * a)[:3], "replace")):
            f(tf.ones(64))
    with amanda.apply(Routine("Square", lambda a: a * a * 2, "replace")):
        assert f(tf.ones(64)).numpy() == 128


@portable.routine
def to_half(x):
    return portable.cast(x, "float16")


@portable.routine
def first_row(x):
    return x[:1]


@pytest.mark.parametrize("routine", [to_half, first_row])
def test_portable_replacements_are_checked_when_lowered(routine):
    with pytest.raises(amanda.ToolError, match="keep the shape and dtype"):
        with amanda.apply(Routine("Square", routine, "before")):
            function_case()(tf.ones(64))


# -- 5. amanda's variable sync runs none of the user's ops ----------------------------
#
# Variable values move between the user session and the instrumented copy's
# session through existing reads and assigns of the user's graph. A pruning
# hook (``var.assign(var * mask)`` after the training step, the mask fed
# through a placeholder) adds reads and assigns with control inputs; running
# one of those would run the user's training step or ask for the mask. Which
# consumer TensorFlow lists first is not fixed (a hash set), so several
# variables of both kinds make the bad choice certain before the fix.

N_HOOKED = 16


def pruning_hook_graph():
    rng = np.random.RandomState(1)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        weights = [v1.get_variable(f"w{i}", initializer=rng.randn(4, 4).astype(np.float32) / 2,
                                   use_resource=i % 2 == 0) for i in range(N_HOOKED)]
        masks = [v1.placeholder(tf.float32, [4, 4], name=f"mask{i}") for i in range(N_HOOKED)]
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([train]):   # the hook: step, then re-apply the masks
            prune = [tf.convert_to_tensor(w.assign(w * m)) for w, m in zip(weights, masks)]
        init = v1.global_variables_initializer()
    mask_values = [(rng.rand(4, 4) > 0.3).astype(np.float32) for _ in masks]
    return graph, dict(x=x, weights=weights, loss=loss, train=train, prune=prune, init=init,
                       masks=dict(zip(masks, mask_values)))


def hooked_runs(session, t, tool):
    """Two scopes (values move into the copy and back twice), the hook fed in
    one run only; the fetches of every run and the variables at the end."""
    xs = np.random.RandomState(2).randn(3, 4).astype(np.float32)
    runs = [(t["loss"], {t["x"]: xs}),
            ([t["loss"], t["train"]], {t["x"]: xs}),
            (t["prune"], {t["x"]: xs, **t["masks"]}),
            (t["loss"], {t["x"]: xs})]
    fetched = []
    for scope in range(2):
        with contextlib.ExitStack() as stack:
            if tool is not None:
                stack.enter_context(amanda.apply(tool))
            fetched += [session.run(f, d) for f, d in runs]
    return fetched, session.run(t["weights"])


def test_variable_sync_runs_no_user_op_and_equals_a_plain_session():
    graph, t = pruning_hook_graph()
    sessions = []
    for _ in range(2):
        with graph.as_default():
            sessions.append(v1.Session())
        sessions[-1].run(t["init"])
    want = hooked_runs(sessions[0], t, None)
    tool = Observe({"MatMul", "ReadVariableOp"})
    got = hooked_runs(sessions[1], t, tool)
    same(got, want)
    assert tool.calls > 0


def test_a_pruner_runs_beside_a_placeholder_fed_pruning_hook():
    from amanda.tools.pruning_projects.tile_wise import TileWisePruner
    graph, t = pruning_hook_graph()
    with graph.as_default():
        session = v1.Session()
    session.run(t["init"])
    pruner = TileWisePruner(sparsity=0.5, tile=2)
    fetched, weights = hooked_runs(session, t, pruner)
    assert len(pruner.masks()) == N_HOOKED
    assert np.isfinite(fetched[-1]) and all(np.isfinite(w).all() for w in weights)
