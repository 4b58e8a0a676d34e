"""Observe-only routines in ``Session.run`` graphs run after the run, on
fetched tensors (amanda/runtime/tensorflow/observe.py), not as a callback
per op: checked by difference with the hosted path (`hosted_observation`),
which runs the same routines inside the run.

Same routines, same runs: every routine sees the same values, the same
number of times, whatever is fetched or fed; the outputs are those of the
plain session; and the instrumented graph holds no callback for them.
"""

import numpy as np
import pytest

import amanda
from amanda.runtime.observation import hosted_observation, observation_budget
from amanda.runtime.tensorflow import current_rewrite

tf = pytest.importorskip("tensorflow")

_CALLBACKS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


class Record(amanda.Tool):
    """Every point of every op with tensors to pass: records the values."""

    def __init__(self):
        super().__init__()
        self.seen = {}
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True)

    def forward(self, context):
        op = context.get_op()
        if op.inputs:
            context.insert_before_op(self.look, key=(op.name, "before"))
        if op.outputs:
            context.insert_after_op(self.look, key=(op.name, "after"))

    def backward(self, context):
        op = context.get_backward_op()
        if op.inputs:
            context.insert_before_backward_op(self.look, key=(op.name, "before_backward"))
        if op.outputs:
            context.insert_after_backward_op(self.look, key=(op.name, "after_backward"))

    def look(self, *arrays, key):
        for a in arrays:
            if a is not None:
                assert not a.flags.writeable
        self.seen.setdefault(key, []).append(
            [None if a is None else np.array(a, copy=True) for a in arrays])


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert len(a[key]) == len(b[key]), key
        for x, y in zip(a[key], b[key]):
            assert len(x) == len(y), key
            for u, v in zip(x, y):
                assert (u is None) == (v is None), key
                if u is not None:
                    assert u.dtype == v.dtype and np.array_equal(u, v), key


def _callbacks(session):
    graph_def = current_rewrite(session).copy.as_graph_def()
    return [node.name for node in graph_def.node if node.op in _CALLBACKS]


def _runs(cnn):
    """(fetches, feed) of several runs: the whole step, a forward part only,
    an intermediate tensor fed in place of its producer; last, a gradient
    that needs only part of the forward pass (see the first test)."""
    rng = np.random.RandomState(0)
    images = rng.rand(2, 16, 16, 3).astype(np.float32)
    hidden = cnn.graph.get_operation_by_name(cnn.y.op.name).inputs[0]
    return [
        ([cnn.loss] + cnn.grads, {cnn.x: images}),
        (cnn.y, {cnn.x: images}),
        ([cnn.loss, cnn.grads[-1]], {hidden: rng.rand(*hidden.shape.as_list()).astype(np.float32)}),
        (cnn.grads[0], {cnn.x: images}),
    ]


def _observe(cnn, hosted):
    tools = []
    with tf.compat.v1.Session(graph=cnn.graph) as session:
        session.run(cnn.init)
        runs = _runs(cnn)
        plain = [session.run(f, d) for f, d in runs]
        with (hosted_observation() if hosted else _nothing()):
            tools = [Record(), Record()]
            with amanda.apply(*tools):
                got = [session.run(f, d) for f, d in runs[:-1]]
                callbacks = _callbacks(session)
            # the last run alone, so its points can be told apart
            last = Record()
            with amanda.apply(last):
                got.append(session.run(*runs[-1]))
    return tools, last, plain, got, callbacks


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_observers_run_after_the_run_as_they_ran_inside_it(keras_cnn_graph):
    cnn = keras_cnn_graph()
    fetched, fetched_last, plain, got, callbacks = _observe(cnn, hosted=False)
    hosted, hosted_last, plain_h, got_h, callbacks_h = _observe(cnn, hosted=True)
    # the hosted path is the reference: a callback per point with tensors
    assert callbacks_h
    # fetched: no callback for a routine that passes a tensor; only routines
    # over handles (ReadVariableOp's input) stay in the graph
    assert len(callbacks) < len(callbacks_h) / 4
    for tool_plain, tool_got in ((plain, got), (plain_h, got_h)):
        for p, g in zip(tool_plain, tool_got):
            for u, v in zip(np.atleast_1d(np.asarray(p, dtype=object)),
                            np.atleast_1d(np.asarray(g, dtype=object))):
                assert np.array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    for h, f in zip(hosted, fetched):   # two tools: both get every point
        _same(h.seen, f.seen)
        assert len(f.seen) > 40
    # a gradient of the first layer needs no forward op after it; a hosted
    # routine over several tensors (a MatMul's input and weight) joins their
    # dependencies, so the hosted path also runs later forward ops for it.
    # An op one of whose points runs runs with all its points
    # (docs/tensorflow.md, "Every point of an op runs"), so fetched, the
    # points are the same, with the same values (before that rule they were
    # a subset: the ops TensorFlow ran)
    assert fetched_last.seen.keys() == hosted_last.seen.keys()
    _same(hosted_last.seen, fetched_last.seen)


def test_a_fed_tensor_gives_its_producer_the_after_point_only():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        a = tf.math.sin(x, name="a")
        b = tf.math.square(a, name="b")
        c = tf.reduce_sum(b, name="c")
    tool = Record()
    with tf.compat.v1.Session(graph=graph) as session, amanda.apply(tool):
        session.run(c, {a: np.array([1.0, 2.0, 3.0], np.float32)})
        assert not _callbacks(session)
    assert ("a", "after") in tool.seen and ("a", "before") not in tool.seen
    np.testing.assert_array_equal(tool.seen[("a", "after")][0][0], [1.0, 2.0, 3.0])
    assert ("x", "after") not in tool.seen


def test_hosted_observation_and_the_budget_keep_routines_in_the_run():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8], name="x")
        y = tf.reduce_sum(tf.math.tanh(x) * 2.0)
    feed = {x: np.arange(8, dtype=np.float32)}
    counts = []
    for scope in (_nothing, hosted_observation, lambda: observation_budget(16)):
        tool = Record()
        with tf.compat.v1.Session(graph=graph) as session, scope(), amanda.apply(tool):
            session.run(y, feed)
            counts.append(len(_callbacks(session)))
        assert tool.seen
    assert counts[0] == 0 and counts[1] > 0 and 0 < counts[2] <= counts[1]


def test_a_failing_observer_raises_a_tool_error_naming_it():
    class Failing(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op().type == "Tanh":
                context.insert_after_op(self.fail)

        def fail(self, y):
            raise ValueError("no")

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        y = tf.math.tanh(x, name="t")
    with tf.compat.v1.Session(graph=graph) as session, amanda.apply(Failing()):
        with pytest.raises(amanda.ToolError, match="t") as caught:
            session.run(y, {x: np.zeros(2, np.float32)})
        assert not _callbacks(session)
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize("use_resource", [True, False])
def test_a_weight_observed_before_its_update_keeps_its_value(use_resource):
    """A training step observing the weight its MatMul reads: the value
    before the update, as the hosted routine saw. A v1 reference variable's
    read shares the buffer the update then writes in place, so such graphs
    keep their routines hosted; a resource variable is copied first."""
    seen = {}
    for hosted in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [2, 4])
            w = tf.compat.v1.get_variable("w", initializer=np.ones((4, 4), np.float32),
                                          use_resource=use_resource)
            loss = tf.reduce_sum(tf.matmul(x, w))
            # the update after the loss: without this edge the MatMul and the
            # in-place update of a reference variable race in TensorFlow
            # itself (the gradient does not need the MatMul's result), and
            # any timing change (a routine) can let the MatMul see the update
            with tf.control_dependencies([loss]):
                train = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
            init = tf.compat.v1.global_variables_initializer()
        tool = Record()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            with (hosted_observation() if hosted else _nothing()), amanda.apply(tool):
                session.run([loss, train], {x: np.ones((2, 4), np.float32)})
        seen[hosted] = tool.seen
    _same(seen[True], seen[False])
    np.testing.assert_array_equal(seen[False][("MatMul", "before")][0][1], np.ones((4, 4)))
