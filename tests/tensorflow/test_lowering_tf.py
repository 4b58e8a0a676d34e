"""The TF copy is lowered from the instrumented IR op by op
(amanda/runtime/tensorflow/emit.py): every user op is created once, with the
inputs the IR gives it and all its control edges; no op is rewired or given
an edge after it exists, except a v1 loop's ``Merge``, whose back edge is
set when its ``NextIteration`` is built (as TensorFlow's ``while_loop``
does).

Checked by difference: on generated programs and a Keras model, the copy's
user ops are the user's ops (name, type, attributes, device), reading the
user's tensors or a routine's results; values equal the plain run; and the
ordering rules (recorded order of after-routines, a routine done before a
later update of the variable it reads) hold.
"""

import contextlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import amanda
from amanda.runtime.observation import hosted_observation
from amanda.runtime.tensorflow import current_rewrite
from amanda.runtime.tensorflow.bodies import _STATEFUL_TWIN

tf = pytest.importorskip("tensorflow")

from tests.tensorflow.test_generated_tf import (Identity, Observe, _build, _config,  # noqa: E402
                                                _feeds, programs)

_AMANDA = os.path.dirname(amanda.__file__)


@contextlib.contextmanager
def _surgery():
    """Every ``_add_control_input`` / ``_update_input`` amanda's own code
    makes on the ops of any graph, as (kind, op type, new input's op type)."""
    calls = []
    add, update = tf.Operation._add_control_input, tf.Operation._update_input
    own = {k: tf.Operation.__dict__[k] for k in ("_add_control_input", "_update_input")
           if k in tf.Operation.__dict__}   # (the first one is the C++ base class's)

    def caller():
        import sys
        return sys._getframe(2).f_code.co_filename.startswith(_AMANDA)

    def _add(self, op):
        if caller():
            calls.append(("control", self.type, op.type))
        return add(self, op)

    def _update(self, index, tensor):
        if caller():
            calls.append(("input", self.type, tensor.op.type))
        return update(self, index, tensor)

    tf.Operation._add_control_input, tf.Operation._update_input = _add, _update
    try:
        yield calls
    finally:
        for key in ("_add_control_input", "_update_input"):
            if key in own:
                setattr(tf.Operation, key, own[key])
            else:
                delattr(tf.Operation, key)


def _user_ops_kept(user_graph, copy):
    """Assert every op of the user's graph is in the copy as it was: same
    type, attributes and device, its control inputs kept, each input the
    user's tensor or made by amanda (a routine's result)."""
    user_names = {op.name for op in user_graph.get_operations()}
    for op in user_graph.get_operations():
        twin = copy.get_operation_by_name(op.name)
        assert twin.device == op.device
        attrs, theirs = dict(op.node_def.attr), dict(twin.node_def.attr)
        if twin.type != op.type:   # a call whose bodies were instrumented: its stateful twin
            assert _STATEFUL_TWIN[op.type] == twin.type
        for key in list(attrs):
            if attrs[key].HasField("func") or attrs[key].list.func:
                del attrs[key], theirs[key]   # the instrumented bodies' functions
        assert theirs == attrs, op.name
        assert {c.name for c in op.control_inputs} <= {c.name for c in twin.control_inputs}
        assert len(twin.inputs) == len(op.inputs)
        for mine, theirs in zip(op.inputs, twin.inputs):
            assert theirs.name == mine.name or theirs.op.name not in user_names, op.name


_SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                     phases=[Phase.explicit, Phase.reuse, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(programs(), st.integers(0, 1000))
def test_generated_programs_are_lowered_without_rewiring(recipe, seed):
    graph, inputs, fetches, train_op, w, init = _build(recipe)
    feeds = _feeds(inputs, seed)
    # fetches, then two training steps fetching them too (as
    # test_generated_tf does: a variable fetched in a training run could be
    # read before or after its update, so it is fetched in runs of its own)
    steps = [fetches]
    if train_op is not None:
        kept = [f for f in fetches if f is not w]
        steps += [[train_op] + kept] * 2 + [[w]]

    def run(session):
        return [session.run(step, feeds) for step in steps]

    with tf.compat.v1.Session(graph=graph, config=_config()) as plain:
        plain.run(init)
        want = run(plain)
    tool = Identity()
    with tf.compat.v1.Session(graph=graph, config=_config()) as session:
        session.run(init)
        with _surgery() as calls, hosted_observation(), amanda.apply(tool):
            got = run(session)
            copy = current_rewrite(session).copy
        _user_ops_kept(graph, copy)
    assert calls == []
    for values, expected in zip(got, want):
        for a, b in zip(values or (), expected or ()):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_keras_training_step_is_lowered_without_rewiring():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.LayerNormalization(),
                                     tf.keras.layers.Dense(3)])
        loss = tf.reduce_sum(model(x) ** 2)
        grads = tf.compat.v1.gradients(loss, model.trainable_variables)
        init = tf.compat.v1.global_variables_initializer()
    feed = {x: np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    # Grappler's float rewrites off: hosted routines keep apart what it would
    # fuse (docs/tensorflow.md, Bit-exactness)
    with tf.compat.v1.Session(graph=graph, config=_config()) as session:
        session.run(init)
        want = session.run([loss, grads], feed)
        tool = Identity()
        with _surgery() as calls, hosted_observation(), amanda.apply(tool):
            got = session.run([loss, grads], feed)
            copy = current_rewrite(session).copy
    _user_ops_kept(graph, copy)
    assert calls == [] and tool.calls > 100
    assert np.asarray(got[0]).tobytes() == np.asarray(want[0]).tobytes()
    for a, b in zip(got[1], want[1]):
        assert a.tobytes() == b.tobytes()


def test_a_v1_loop_closes_its_back_edges_and_nothing_else():
    graph = tf.Graph()
    tf.compat.v1.disable_control_flow_v2()
    try:
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
            _, out = tf.compat.v1.while_loop(lambda i, v: i < 4,
                                             lambda i, v: (i + 1, tf.math.tanh(v) * 2.0), [0, x])
    finally:
        tf.compat.v1.enable_control_flow_v2()
    feed = {x: np.array([0.1, -0.2, 0.3], np.float32)}
    with tf.compat.v1.Session(graph=graph) as session:
        want = session.run(out, feed)
        tool = Observe()   # (a routine may not replace a loop's back edge)
        with _surgery() as calls, amanda.apply(tool):
            got = session.run(out, feed)
            copy = current_rewrite(session).copy
    _user_ops_kept(graph, copy)
    assert got.tobytes() == want.tobytes()
    # every point of the body once per iteration (4), the Merge's too
    ops = {op for op, _, _ in tool.log}
    assert "while/Merge_1" in ops
    assert sum(1 for op, point, _ in tool.log if op == "while/Tanh" and point == "after") == 4
    # one back edge per loop variable, into the Merge (and the views of it)
    assert calls and all(kind == "input" and source == "NextIteration"
                         for kind, _, source in calls)
    assert {target for _, target, _ in calls} >= {"Merge"}


class _Order(amanda.Tool):
    """At every op's after point: an observer receiving its outputs, then a
    counter selecting nothing, both recorded inside the run."""

    def __init__(self, log):
        super().__init__()
        self.log = log
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        name = context.get_op().name
        with hosted_observation():
            context.insert_after_op(self.look, op=name)
            context.insert_after_op(self.count, outputs=[], op=name)

    def look(self, *arrays, op):
        self.log.append((op, "look"))

    def count(self, op):
        self.log.append((op, "count"))


def test_after_routines_run_in_the_order_they_were_recorded():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        y = tf.math.sin(x, name="sin")
        z = tf.math.exp(y, name="exp")
    log = []
    with tf.compat.v1.Session(graph=graph) as session:
        with amanda.apply(_Order(log)):
            session.run(z, {x: np.ones(2, np.float32)})
    for op in ("sin", "exp"):
        mine = [point for name, point in log if name == op]
        assert mine == ["look", "count"], (op, log)
    # and both routines of an op before those of the op reading it
    assert log.index(("sin", "count")) < log.index(("exp", "look"))


class _SeeMul(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.seen = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "Mul":
            context.insert_before_op(self.look)

    def look(self, *arrays):
        self.seen.append([np.array(a, copy=True) for a in arrays if a is not None])


def test_a_routine_reading_a_variable_is_done_before_a_later_update():
    """In a ``tf.function`` the read is ordered before the update; the
    routine on the read's reader is created before the update, which waits
    on it (`_GraphRewrite._waits`), though the update comes first in the
    function's op order."""
    v = tf.Variable(np.array([1.0, 2.0], np.float32))

    @tf.function
    def step():
        r = v.read_value()
        v.assign(r + 10.0)
        return r * 3.0

    tool = _SeeMul()
    with amanda.apply(tool):
        got = step()
    assert np.array_equal(got.numpy(), [3.0, 6.0])
    assert tool.seen and all(np.array_equal(a[0], [1.0, 2.0]) for a in tool.seen)
    assert np.array_equal(v.numpy(), [11.0, 12.0])


class _AfterGradientMul(amanda.Tool):
    """Routines before and after each backward ``Mul`` that return None, but
    could return arrays (so they are hosted as possible replacers)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.backward, backward=True)

    def backward(self, context):
        if context.get_backward_op().type == "Mul":
            context.insert_before_backward_op(self.maybe)
            context.insert_after_backward_op(self.maybe)

    def maybe(self, *arrays):
        return list(arrays) if len(arrays) > 99 else None


@pytest.mark.xfail(strict=True, reason="found 2026-11-28, open: hosted routines around the "
                   "backward Mul of w*w changes a gradient-descent step by one ulp with "
                   "Grappler and oneDNN off (the gradient terms meet in an AddN; "
                   "docs/tensorflow.md, Bit-exactness)")
def test_a_routine_returning_none_after_gradient_terms_leaves_a_training_step_exact():
    from tests.tensorflow.test_generated_tf import _build as build
    recipe = ([("matmul", 0), ("matmul", 2), ("unary", "sigmoid", 2)], [3, 2], True, None, True)
    graph, inputs, _, train_op, w, init = build(recipe)
    feeds = _feeds(inputs, 176)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                      intra_op_parallelism_threads=1,
                                      use_per_session_threads=True)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    values = []
    for tool in (None, _AfterGradientMul()):
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            session.run(init)
            with amanda.apply(tool) if tool is not None else contextlib.nullcontext():
                session.run(train_op, feeds)
            values.append(session.run(w))
    assert values[0].tobytes() == values[1].tobytes()


class _Watch(amanda.Tool):
    """Before and after every op, inside the run: a routine that can only
    return None (``look``), or, with ``may_return``, one that could return
    arrays but does not."""

    def __init__(self, may_return=False):
        super().__init__()
        self.log = []
        self.may_return = may_return
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        name = context.get_op().name
        routine = self.maybe if self.may_return else self.look
        with hosted_observation():
            context.insert_before_op(routine, op=name, point="before")
            context.insert_after_op(routine, op=name, point="after")

    def look(self, *arrays, op, point):
        self.log.append((op, point, [np.array(a, copy=True) for a in arrays if a is not None]))

    def maybe(self, *arrays, op, point):
        self.look(*arrays, op=op, point=point)
        return list(arrays) if len(arrays) > 99 else None


def _types(copy):
    import collections
    return collections.Counter(op.type for op in copy.get_operations())


def test_a_routine_that_can_only_return_none_is_one_callback_ordered_by_control_edges():
    """An observing routine hosted in the run is one ``tf.numpy_function``
    reading its tensors and nothing flows back: no ``Switch``/``Merge``
    choosing between its result and the original, no ``EnsureShape``
    (five ops per tensor a routine that may return needs). It still runs in
    program order and sees the op's values."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        y = tf.math.sin(x, name="sin")
        z = tf.math.exp(y, name="exp")
    feed = {x: np.array([0.5, -1.0], np.float32)}
    with tf.compat.v1.Session(graph=graph) as session:
        want, sine = session.run([z, y], feed)
    copies = {}
    for may_return in (False, True):
        tool = _Watch(may_return)
        with tf.compat.v1.Session(graph=graph) as session:
            with amanda.apply(tool):
                got = session.run(z, feed)
                copies[may_return] = _types(current_rewrite(session).copy)
        assert got.tobytes() == want.tobytes()
        points = [(op, point) for op, point, _ in tool.log]
        assert points == [("x", "before"), ("x", "after"), ("sin", "before"), ("sin", "after"),
                          ("exp", "before"), ("exp", "after")], points
        values = {(op, point): arrays for op, point, arrays in tool.log}
        assert values["sin", "after"][0].tobytes() == sine.tobytes()
        assert values["exp", "before"][0].tobytes() == sine.tobytes()
    only_none, may_return = copies[False], copies[True]
    assert only_none["PyFunc"] == may_return["PyFunc"] == 6
    assert only_none["Switch"] == only_none["Merge"] == only_none["EnsureShape"] == 0
    assert may_return["Switch"] >= 8 and may_return["Merge"] >= 4


class _AfterOne(amanda.Tool):
    def __init__(self, name, kind):
        super().__init__()
        self.name, self.calls, self.kind = name, 0, kind
        self.add_inst_for_op(self.backward, backward=True)

    def backward(self, context):
        if context.get_backward_op().name == self.name:
            if self.kind == "count":
                context.insert_after_backward_op(self.look, grad_inputs=[])
            else:
                context.insert_after_backward_op(self.maybe if self.kind == "maybe"
                                                 else self.look)

    def look(self, *arrays):
        self.calls += 1

    def maybe(self, *arrays):
        self.look()
        return list(arrays) if len(arrays) > 99 else None


def test_an_after_routine_runs_whenever_its_op_runs():
    """``tf.gradients`` builds the gradient of a ``MatMul`` with respect to
    a placeholder, which nothing reads, and a ``tf.tuple`` group waits on
    it: the graph runs it (the step stats of a session without Grappler,
    which may prune it, say so), so its after-routines run, as a counter
    selecting nothing always did, whether called after the run, hosted as
    one callback, or hosted as a routine that may return arrays. (Before,
    the last three did not run, and the counter did.)"""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4], name="x")
        w = tf.Variable(np.ones((4, 4), np.float32), name="w")
        loss = tf.reduce_sum(tf.matmul(x, w))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    grad_x = [op for op in graph.get_operations() if op.type == "MatMul"
              and "_grad" in op.name and op.outputs[0].shape == x.shape]
    assert len(grad_x) == 1 and not grad_x[0].outputs[0].consumers()[0].outputs[0].consumers()
    name, feed = grad_x[0].name, {x: np.ones((2, 4), np.float32)}
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        metadata = tf.compat.v1.RunMetadata()
        session.run(train, feed, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
    ran = {node.node_name for dev in metadata.step_stats.dev_stats for node in dev.node_stats}
    assert name in ran
    for scope, kind in ((contextlib.nullcontext, "count"), (contextlib.nullcontext, "look"),
                        (hosted_observation, "look"), (hosted_observation, "maybe")):
        tool = _AfterOne(name, kind)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            with scope(), amanda.apply(tool):
                session.run(train, feed)
                session.run(train, feed)
        assert tool.calls == 2, (scope, kind)


class _BeforeNeg(amanda.Tool):
    def __init__(self, bare):
        super().__init__()
        self.calls, self.bare = 0, bare
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "Neg":
            if self.bare:
                context.insert_before_op(self.count, inputs=[])
            else:
                context.insert_before_op(self.look, inputs=[0])

    def look(self, x):
        self.calls += 1

    def count(self):
        self.calls += 1


@pytest.mark.parametrize("bare", [True, False])
def test_routines_tied_by_control_edges_survive_grappler_removing_their_ops(bare):
    """Grappler rewrites ``Neg(Neg(x))`` to ``x``, and the control edges that
    made a routine's callback an ancestor of the fetch go with the removed
    ops: hosted counters (``inputs=[]``) before a chain of 32 negations ran
    twice instead of 32 times (before this was found), and so did
    observers once they became one callback ordered by edges. A run now
    names them as its targets (`_Observers.plan`). Checked against the
    count called after the run, under ``cache_disabled()``, and in a
    ``tf.function``."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        y = x
        for i in range(32):
            y = tf.negative(y, name=f"neg{i}")
    feed = {x: np.ones(4, np.float32)}
    for scope in (contextlib.nullcontext, hosted_observation, amanda.cache_disabled):
        tool = _BeforeNeg(bare)
        with tf.compat.v1.Session(graph=graph) as session:   # Grappler on
            with scope(), amanda.apply(tool):
                got = [session.run(y, feed) for _ in range(3)]
        assert tool.calls == 3 * 32, scope
        assert all(np.array_equal(value, feed[x]) for value in got)

    @tf.function
    def chain(v):
        for _ in range(32):
            v = tf.negative(v)
        return v

    tool = _BeforeNeg(bare)
    with amanda.apply(tool):
        chain(tf.ones(4))
        chain(tf.ones(4))
    assert tool.calls == 2 * 32


def test_counters_in_a_v1_graph_that_grappler_may_skip_are_said_loudly():
    """In a graph with v1 control flow a routine selecting no tensor cannot
    be a run's target, and Grappler's arithmetic optimizer removing
    ``Neg(Neg(x))`` skipped all eight counters of a ``cond`` branch:
    amanda says so (a ``NotInstrumentedWarning``) where those rewrites are
    on, and with them off every counter runs and nothing is said."""
    import warnings
    from amanda.errors import NotInstrumentedWarning
    graph = tf.Graph()
    tf.compat.v1.disable_control_flow_v2()
    try:
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
            take = tf.compat.v1.placeholder(tf.bool, [], name="take")

            def branch():
                y = x
                for _ in range(8):
                    y = tf.negative(y)
                return y

            out = tf.compat.v1.cond(take, branch, lambda: x * 2.0)
    finally:
        tf.compat.v1.enable_control_flow_v2()
    feed = {x: np.ones(4, np.float32), take: True}
    for rewrites_off in (False, True):
        config = tf.compat.v1.ConfigProto()
        if rewrites_off:
            options = config.graph_options.rewrite_options
            options.arithmetic_optimization = options.constant_folding = options.OFF
        tool = _BeforeNeg(bare=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tf.compat.v1.Session(graph=graph, config=config) as session, \
                    amanda.apply(tool):
                assert session.run(out, feed).tobytes() == feed[x].tobytes()
        said = [w for w in caught if issubclass(w.category, NotInstrumentedWarning)
                and "v1 control flow" in str(w.message)]
        assert bool(said) != rewrites_off
        if rewrites_off:
            assert tool.calls == 8


class _CopyBeforeAddN(amanda.Tool):
    """Replaces inputs 0 and 2 of every ``AddN`` by copies of themselves."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.forward)

    def forward(self, context):
        if context.get_op().type == "AddN":
            context.insert_before_op(self.copy, inputs=[0, 2])

    def copy(self, first, third):
        return [np.array(first, copy=True), np.array(third, copy=True)]


def test_a_replaced_addn_input_is_summed_first_as_in_the_plain_graph():
    # AddN sums from the first input whose buffer it may reuse. TensorFlow
    # reuses a callback's result only where it copied it into a buffer of its
    # own, which it did or not by NumPy's alignment of the array: 1e8 + 1 is
    # 1e8 in float32, so starting from input 0 gives 0 and from input 2
    # gives 1. Input 1 (a variable's value) is never reused, in both graphs.
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [5], name="x")
        big = tf.Variable(np.full(5, 1e8, np.float32))
        total = tf.math.add_n([x * 1.0, big.read_value(), x * -1e8])
        init = tf.compat.v1.global_variables_initializer()
    feed = {x: np.ones(5, np.float32)}
    with tf.compat.v1.Session(graph=graph, config=_config()) as session:
        session.run(init)
        want = session.run(total, feed)
        tool = _CopyBeforeAddN()
        with amanda.apply(tool):
            # 40 runs, each with new copies (the old code lost the order in
            # about one run of five)
            got = [session.run(total, feed) for _ in range(40)]
    assert want.tolist() == [0.0] * 5
    assert all(g.tobytes() == want.tobytes() for g in got)
