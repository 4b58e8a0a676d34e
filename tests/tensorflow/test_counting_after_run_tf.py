"""Observe-only routines that select no tensor (a counter's ``inputs=[]``,
``outputs=[]``) run after ``Session.run`` in program order, like the fetched
observers (amanda/runtime/tensorflow/observe.py); routines recorded inside
``hosted_observation()`` (the op profiler's timers) stay inside the run.

Checked by difference: per run, every (op, point) is called as many times as
with the routines hosted (``hosted_observation()``) and as under
``cache_disabled()``; the calls come in program order, interleaved with the
selecting observers of the same ops; where the graph has v1 control flow or
function bodies, the routines there stay hosted and count the same.
"""

import collections
import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import amanda
from amanda.runtime.observation import hosted_observation
from amanda.runtime.tensorflow import current_rewrite
from amanda.tools.profiler import OpProfiler

tf = pytest.importorskip("tensorflow")

from tests.tensorflow.test_generated_tf import _build, _config, _feeds, programs  # noqa: E402

_CALLBACKS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")
_RANK = {"before": 0, "look": 1, "after": 2, "bbefore": 0, "bafter": 2}


class Count(amanda.Tool):
    """A counter selecting nothing before and after every op (forward and
    backward), and an observer receiving each forward op's inputs between
    them; all log ``(op name, point)`` to one list."""

    def __init__(self, log, look=True):
        super().__init__()
        self.log = log
        self.looks = look
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True)

    def forward(self, context):
        name = context.get_op().name
        context.insert_before_op(self.count, inputs=[], key=(name, "before"))
        if self.looks:
            context.insert_before_op(self.look, key=(name, "look"))
        context.insert_after_op(self.count, outputs=[], key=(name, "after"))

    def backward(self, context):
        name = context.get_backward_op().name
        context.insert_before_backward_op(self.count, grad_outputs=[], key=(name, "bbefore"))
        context.insert_after_backward_op(self.count, grad_inputs=[], key=(name, "bafter"))

    def count(self, key):
        self.log.append(key)

    def look(self, *arrays, key):
        self.log.append(key)


def _callbacks(session):
    return [n.name for n in current_rewrite(session).copy.as_graph_def().node
            if n.op in _CALLBACKS]


def _logged(graph, init, runs, scope, config=None, look=True):
    """Per run, the calls of a fresh `Count`; and the callbacks in the copy."""
    log, per_run = [], []
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        with scope(), amanda.apply(Count(log, look)):
            for fetches, feed in runs:
                start = len(log)
                session.run(fetches, feed)
                per_run.append(log[start:])
            callbacks = _callbacks(session)
    return per_run, callbacks


def _in_program_order(graph, calls):
    """Calls sorted by (the op's position in the graph, the point)."""
    position = {op.name: i for i, op in enumerate(graph.get_operations())}
    return sorted(calls, key=lambda key: (position.get(key[0], -1), _RANK[key[1]]))


def _training_graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        w = tf.Variable(np.ones(2, np.float32), name="w")
        a = tf.math.sin(x * w, name="a")
        c = tf.reduce_sum(tf.math.square(a, name="b"), name="c")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(c)
        init = tf.compat.v1.global_variables_initializer()
    return graph, x, a, c, train, init


def test_counters_selecting_nothing_run_after_the_run_as_often_as_hosted():
    graph, x, a, c, train, init = _training_graph()
    feed = {x: np.array([1.0, 2.0], np.float32)}
    runs = [(c, feed), (train, feed), ([c, a], feed)]
    fetched, callbacks = _logged(graph, init, runs, contextlib.nullcontext)
    hosted, callbacks_h = _logged(graph, init, runs, hosted_observation)
    uncached, _ = _logged(graph, init, runs, amanda.cache_disabled)
    # nothing sits in the run for them (they were hosted: a callback per routine)
    assert not callbacks and len(callbacks_h) > 50
    for f, h, u in zip(fetched, hosted, uncached):
        assert collections.Counter(f) == collections.Counter(h)
        # program order, counters and observers interleaved op by op
        assert f == u == _in_program_order(graph, f)
    assert {point for _, point in fetched[1]} == set(_RANK)
    assert len(fetched[1]) > 50


def test_a_fed_tensor_runs_nothing_above_it():
    """Hosted, an ``outputs=[]`` routine of a fed op made TensorFlow run the op
    (it waits on it) and everything above it; after the run, only what the
    run executes gets points: the fed op its after-point (and the counter
    before it, which runs whenever the op's after-routines do), nothing above."""
    graph, x, a, c, _, init = _training_graph()
    runs = [(c, {a: np.array([3.0, 4.0], np.float32)})]
    (fetched,), _ = _logged(graph, init, runs, contextlib.nullcontext)
    (uncached,), _ = _logged(graph, init, runs, amanda.cache_disabled)
    assert fetched == uncached
    assert ("a", "after") in fetched and ("a", "before") in fetched
    assert ("a", "look") not in fetched
    assert not {"x", "w", "mul"} & {name for name, _ in fetched}
    assert collections.Counter(fetched)[("c", "after")] == 1


_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                     phases=[Phase.explicit, Phase.reuse, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(programs(), st.integers(0, 1000))
def test_generated_graphs_count_as_hosted_and_uncached(recipe, seed):
    """Generated graphs (``tf.cond`` bodies among them: routines there stay
    hosted), fetching outputs, the training step; placeholders fed only, so
    the hosted path runs exactly the fetches' ancestors too."""
    graph, inputs, fetches, train_op, _, init = _build(recipe)
    feeds = _feeds(inputs[:2], seed)
    runs = [(fetches, feeds)] + ([(train_op, feeds)] if train_op is not None else [])
    fetched, _ = _logged(graph, init, runs, contextlib.nullcontext, _config())
    hosted, _ = _logged(graph, init, runs, hosted_observation, _config())
    uncached, _ = _logged(graph, init, runs, amanda.cache_disabled, _config())
    top = {op.name for op in graph.get_operations()}
    for f, h, u in zip(fetched, hosted, uncached):
        assert collections.Counter(f) == collections.Counter(h) == collections.Counter(u)
        # the top graph's routines come in program order (hosted body
        # routines ran inside the run, in the executor's order, before them)
        mine = [key for key in f if key[0] in top]
        assert mine == [key for key in u if key[0] in top] == _in_program_order(graph, mine)
        assert all(n == 1 for key, n in collections.Counter(mine).items())


def test_v1_control_flow_keeps_them_hosted_and_counting():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        no, yes = tf.raw_ops.Switch(data=x, pred=tf.reduce_sum(x) > 0, name="switch")
        out = tf.raw_ops.Merge(inputs=[tf.math.cos(no, name="cos"),
                                       tf.math.sin(yes, name="sin")], name="merge")[0]
        init = tf.no_op()
    runs = [(out, {x: np.ones(2, np.float32)}), (out, {x: -np.ones(2, np.float32)})]
    # (no observer of the Merge's inputs: routines on dead tensors are
    # tests/tensorflow/test_dead_tensors_tf.py's)
    (taken, other), callbacks = _logged(graph, init, runs, contextlib.nullcontext, look=False)
    uncached, _ = _logged(graph, init, runs, amanda.cache_disabled, look=False)
    assert len(callbacks) == 2 * len(graph.get_operations())   # all hosted
    for got, ran, dead in ((taken, "sin", "cos"), (other, "cos", "sin")):
        counts = collections.Counter(got)
        assert counts[("merge", "after")] == counts[(ran, "before")] == counts[(ran, "after")] == 1
        assert counts[(dead, "after")] == 0
    assert [collections.Counter(r) for r in uncached] == \
        [collections.Counter(taken), collections.Counter(other)]


def test_the_profiler_times_inside_the_run_beside_a_counter_after_it():
    """The profiler records its timers inside ``hosted_observation()``: they
    stay callbacks in the run, ordered by control edges, while a counter of
    another tool in the same scope runs after the run; each timed op's event
    lies inside the run, before the counter's calls."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [256, 256], name="x")
        y = x
        for i in range(4):
            y = tf.matmul(y, x, name=f"mm{i}")
        out = tf.reduce_sum(y, name="out")
    profiler, log = OpProfiler(backward=False), []
    stamps = []

    class Stamp(Count):
        def count(self, key):
            stamps.append(time.perf_counter_ns())
            log.append(key)

    import time
    feed = {x: np.random.default_rng(0).random((256, 256), np.float32)}
    with tf.compat.v1.Session(graph=graph) as session, amanda.apply(profiler, Stamp(log)):
        session.run(out, feed)
        profiler.reset()
        log.clear()
        stamps.clear()
        session.run(out, feed)
        copy = current_rewrite(session).copy
    routines = [op for op in copy.get_operations() if op.type in _CALLBACKS]
    assert {f"mm{i}" for i in range(4)} <= {info.key for info, _, _ in profiler.events}
    assert len(routines) == 2 * len(profiler.events)   # the profiler's, and only those
    for routine in routines:
        assert routine.name.startswith(("amanda/before_op", "amanda/after_op"))
    assert all(start <= end for _, start, end in profiler.events)
    # every event ended inside the run, before the first counter call after it
    assert max(end for _, _, end in profiler.events) < min(stamps)
    assert len(stamps) == 2 * len(profiler.events) and len(log) == 3 * len(profiler.events)
