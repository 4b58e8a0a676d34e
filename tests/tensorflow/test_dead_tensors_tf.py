"""Hosted routines in graphs with v1 control flow, where a tensor on the
branch a run does not take is dead (amanda/runtime/tensorflow/liveness.py).

By difference with a plain session: the fetched values are equal bit for
bit, and a routine runs exactly when its op runs (the taken branch, once per
loop iteration), receiving None for a selected tensor that is dead in that
run (the untaken input of a Merge, the untaken output of a Switch). Before
the fix, a routine reading a Merge's inputs or a Switch's outputs was itself
dead and the run failed ("Retval[0] does not have value").
"""

import collections

import numpy as np
import pytest

import amanda

tf = pytest.importorskip("tensorflow")


class Log(amanda.Tool):
    """Routines at the chosen points of the chosen ops, logging
    ``(op, point, which selected tensors arrived)``; identity ones hand back
    what they received."""

    def __init__(self, types=None, points=("before", "after"), identity=False):
        super().__init__()
        self.types, self.points, self.identity = types, points, identity
        self.log = []
        self.add_inst_for_op(self.forward)

    def forward(self, context):
        op = context.get_op()
        if self.types is not None and op.type not in self.types:
            return
        routine = self.same if self.identity else self.look
        if "before" in self.points:
            context.insert_before_op(routine, key=(op.name, "before"))
        if "after" in self.points:
            context.insert_after_op(routine, key=(op.name, "after"))

    def look(self, *arrays, key):
        self.log.append(key + (tuple(a is not None for a in arrays),))

    def same(self, *arrays, key):
        self.look(*arrays, key=key)
        return arrays[0] if len(arrays) == 1 else list(arrays)


def _cond():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        no, yes = tf.raw_ops.Switch(data=x, pred=tf.reduce_sum(x) > 0, name="switch")
        merged = tf.raw_ops.Merge(inputs=[tf.math.cos(no, name="cos"),
                                          tf.math.sin(yes, name="sin")], name="merge")[0]
        out = tf.identity(merged * 3.0, name="out")
    return graph, x, out


def _loop():
    tf.compat.v1.disable_control_flow_v2()
    try:
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
            _, result = tf.compat.v1.while_loop(lambda i, v: i < 3,
                                                lambda i, v: (i + 1, tf.sin(v) * 2.0),
                                                [tf.constant(0), x], name="loop")
            out = tf.identity(result, name="out")
    finally:
        tf.compat.v1.enable_control_flow_v2()
    return graph, x, out


def _runs(build, tool, values):
    """Per fed value: (plain result, instrumented result, the tool's log)."""
    graph, x, out = build()
    found = []
    with tf.compat.v1.Session(graph=graph) as session:
        for value in values:
            plain = session.run(out, {x: value})
            start = len(tool.log)
            with amanda.apply(tool):
                got = session.run(out, {x: value})
            found.append((plain, got, tool.log[start:]))
    return found


_POSITIVE, _NEGATIVE = np.array([1.0, 2.0], np.float32), np.array([-1.0, -3.0], np.float32)


@pytest.mark.parametrize("identity", [False, True])
def test_a_routine_on_a_merges_inputs_gets_the_live_one(identity):
    found = _runs(_cond, Log({"Merge"}, ("before",), identity), [_POSITIVE, _NEGATIVE])
    (plain_t, got_t, log_t), (plain_f, got_f, log_f) = found
    assert got_t.tobytes() == plain_t.tobytes() and got_f.tobytes() == plain_f.tobytes()
    # inputs [cos(untaken side of x > 0), sin(taken side)]
    assert log_t == [("merge", "before", (False, True))]
    assert log_f == [("merge", "before", (True, False))]


@pytest.mark.parametrize("identity", [False, True])
def test_a_routine_on_a_switchs_outputs_gets_the_live_one(identity):
    found = _runs(_cond, Log({"Switch"}, ("after",), identity), [_POSITIVE, _NEGATIVE])
    (plain_t, got_t, log_t), (plain_f, got_f, log_f) = found
    assert got_t.tobytes() == plain_t.tobytes() and got_f.tobytes() == plain_f.tobytes()
    assert log_t == [("switch", "after", (False, True))]
    assert log_f == [("switch", "after", (True, False))]


@pytest.mark.parametrize("identity", [False, True])
def test_every_point_of_a_cond_runs_exactly_on_the_taken_branch(identity):
    for (plain, got, log), ran, skipped in zip(
            _runs(_cond, Log(identity=identity), [_POSITIVE, _NEGATIVE]),
            ("sin", "cos"), ("cos", "sin")):
        assert got.tobytes() == plain.tobytes()
        counts = collections.Counter(entry[:2] for entry in log)
        for name in ("switch", ran, "merge", "out"):
            assert counts[(name, "before")] == counts[(name, "after")] == 1
        assert counts[(skipped, "before")] == counts[(skipped, "after")] == 0


def test_a_counter_selecting_nothing_skips_the_untaken_branch():
    class Count(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.log = []
            self.add_inst_for_op(self.forward)

        def forward(self, context):
            name = context.get_op().name
            context.insert_before_op(self.count, inputs=[], key=(name, "before"))
            context.insert_after_op(self.count, outputs=[], key=(name, "after"))

        def count(self, key):
            self.log.append(key)

    for (plain, got, log), skipped in zip(_runs(_cond, Count(), [_POSITIVE, _NEGATIVE]),
                                          ("cos", "sin")):
        assert got.tobytes() == plain.tobytes()
        assert (skipped, "before") not in log and (skipped, "after") not in log
        assert log.count(("merge", "before")) == log.count(("merge", "after")) == 1


@pytest.mark.parametrize("identity", [False, True])
def test_every_point_of_a_v1_while_loop_runs_once_per_iteration(identity):
    (plain, got, log), = _runs(_loop, Log(identity=identity), [_POSITIVE])
    assert got.tobytes() == plain.tobytes()
    counts = collections.Counter(entry[:2] for entry in log)
    # three iterations; the condition's side runs once more
    assert counts[("loop/Sin", "before")] == counts[("loop/mul", "after")] == 3
    assert counts[("loop/Merge_1", "before")] == counts[("loop/Switch_1", "after")] == 4
    assert counts[("loop/LoopCond", "after")] == 4
    assert counts[("loop/Enter_1", "before")] == counts[("loop/Exit_1", "after")] == 1
    # the Merge's inputs: the entry on the first iteration, the back edge after
    merges = [entry[2] for entry in log if entry[:2] == ("loop/Merge_1", "before")]
    assert merges == [(True, False)] + [(False, True)] * 3


def test_a_loops_back_edge_cannot_be_replaced():
    class Doubling(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.forward)

        def forward(self, context):
            if context.get_op().name == "loop/Merge_1":
                context.insert_before_op(self.double)

        def double(self, entry, back):
            return [None if entry is None else entry * 2, None if back is None else back * 2]

    graph, x, out = _loop()
    with tf.compat.v1.Session(graph=graph) as session, amanda.apply(Doubling()):
        with pytest.raises(amanda.ToolError, match="previous iteration"):
            session.run(out, {x: _POSITIVE})


def test_replacing_a_control_flow_op_is_refused():
    class Replace(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.forward)

        def forward(self, context):
            if context.get_op().type == "Merge":
                context.replace_op(self.merge)

        def merge(self, *inputs):
            live = [a for a in inputs if a is not None]
            return np.array(live[0]), np.int32(0)

    graph, x, out = _cond()
    with tf.compat.v1.Session(graph=graph) as session, amanda.apply(Replace()):
        with pytest.raises(amanda.BackendError, match="control-flow op"):
            session.run(out, {x: _POSITIVE})
