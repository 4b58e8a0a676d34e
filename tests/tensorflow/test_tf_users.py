"""tf.compat.v1 sessions as users write them, inside `amanda.apply`: input
pipelines and other state the session keeps (iterators, queues, tables,
random ops), and run options. Compared by difference against the same
code without amanda; the user's session must be as a plain run leaves it."""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402

tf1 = tf.compat.v1


class Count(amanda.Tool):
    """A routine before every op: counts calls per op name."""

    def __init__(self):
        super().__init__()
        self.calls = {}
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.tick, name=context.get_op().name)

    def tick(self, *arrays, name):
        self.calls[name] = self.calls.get(name, 0) + 1


def _one_shot():
    it = tf1.data.make_one_shot_iterator(tf.data.Dataset.range(10).map(lambda v: v * 2))
    return it.get_next(), None


def _initializable():
    it = tf1.data.make_initializable_iterator(tf.data.Dataset.range(10))
    return it.get_next() + 1, it.initializer


def _queue():
    queue = tf1.FIFOQueue(10, tf.float32)
    return queue.dequeue() * 2, queue.enqueue_many([[1.0, 2.0, 3.0, 4.0]])


def _table():
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant([1, 2], tf.int64), tf.constant([10, 20], tf.int64)), -1)
    return table.lookup(tf.constant([1, 2, 3], tf.int64)), tf1.tables_initializer()


STATE = {"one-shot iterator": _one_shot, "initializable iterator": _initializable,
         "FIFO queue": _queue, "hash table": _table}


def _session(build):
    graph = tf.Graph()
    with graph.as_default():
        fetch, init = build()
    session = tf1.Session(graph=graph)
    if init is not None:
        session.run(init)
    return session, fetch


@pytest.mark.parametrize("kind", sorted(STATE))
def test_a_run_using_state_of_the_users_session_is_refused_and_leaves_it_as_it_was(kind):
    """The instrumented copy runs in a session of its own: an iterator
    started again from its first element there (a one-shot iterator's run
    inside the scope returned 0, 0 where the plain runs give 2, 4; elements
    were repeated and skipped silently), an initialised one or a filled
    table was empty, and a dequeue from the copy's empty queue blocked the
    run for ever."""
    session, fetch = _session(STATE[kind])
    expected = [session.run(fetch) for _ in range(3)]
    session.close()
    session, fetch = _session(STATE[kind])
    got = [session.run(fetch)]
    tool = Count()
    with amanda.apply(tool):
        with pytest.raises(amanda.BackendError, match="lives in your session"):
            # a dequeue from the copy's empty queue blocked for ever: bounded here
            session.run(fetch, options=tf1.RunOptions(timeout_in_ms=5000))
    got += [session.run(fetch) for _ in range(2)]
    session.close()
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))
    assert tool.calls == {}


def test_an_input_pipeline_fed_through_the_iterators_output_runs_instrumented():
    """The way the refusal names: take the batch under amanda.disabled() and
    feed it. Values and points equal those of the plain pipeline."""
    def build():
        it = tf1.data.make_one_shot_iterator(
            tf.data.Dataset.range(6).map(lambda v: tf.cast(v, tf.float32) * 0.5))
        batch = it.get_next()
        w = tf1.get_variable("w", initializer=2.0, use_resource=True)
        y = tf.square(batch * w, name="y")
        return (batch, y), tf1.global_variables_initializer()
    session, (batch, y) = _session(build)
    expected = [session.run(y) for _ in range(3)]
    session.close()
    session, (batch, y) = _session(build)
    tool = Count()
    got = []
    with amanda.apply(tool):
        for _ in range(3):
            with amanda.disabled():
                value = session.run(batch)
            got.append(session.run(y, {batch: value}))
    assert got == expected
    assert tool.calls["y"] == 3 and tool.calls["mul"] == 3
    assert not any("Iterator" in name for name in tool.calls)
    session.close()


def test_fetching_the_fed_output_of_an_iterator_runs_no_iterator_and_is_not_refused():
    """A fetched tensor that is fed runs nothing (TF answers the fed value):
    the refusal looks only at what the run executes (the walk the observers'
    plan uses, `tensorflow_observe._executed`), so fetching ``batch`` while
    feeding it is answered as outside apply and the iterator does not move."""
    def build():
        it = tf1.data.make_one_shot_iterator(tf.data.Dataset.range(6).map(
            lambda v: tf.cast(v, tf.float32)))
        batch = it.get_next()
        return (batch, tf.square(batch, name="y")), None
    session, (batch, y) = _session(build)
    plain = session.run([batch, y], {batch: 4.0})
    with amanda.apply(Count()):
        got = session.run([batch, y], {batch: 4.0})
    assert [float(v) for v in got] == [float(v) for v in plain] == [4.0, 16.0]
    assert float(session.run(batch)) == 0.0     # the iterator did not move
    session.close()


def _random(stateless):
    def build():
        tf1.set_random_seed(1)
        if stateless:
            value = tf.random.stateless_uniform([3], seed=[1, 2])
        else:
            value = tf1.random_uniform([3], seed=5)
        return value * 2.0, None
    return build


def test_stateful_random_ops_in_the_copy_are_named_at_the_users_line():
    """Their draws start afresh in the copy's session and do not advance
    the user's: the values inside the scope differ from the plain run's
    continuing sequence, and amanda said nothing."""
    session, fetch = _session(_random(False))
    first = session.run(fetch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(Count()):
            inside = [session.run(fetch) for _ in range(2)]
    said = [w for w in caught if issubclass(w.category, amanda.NotBitExactWarning)
            and "stateful random ops" in str(w.message)]
    assert len(said) == 1 and "random_uniform" in str(said[0].message)
    assert said[0].filename == __file__
    assert np.array_equal(inside[0], first)    # what it says: the copy starts afresh
    session.close()


def test_stateless_random_ops_draw_as_in_a_plain_session_without_a_warning():
    session, fetch = _session(_random(True))
    expected = [session.run(fetch) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(Count()):
            got = [session.run(fetch) for _ in range(2)]
    assert not [w for w in caught if "random" in str(w.message)]
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))
    session.close()


def test_run_options_and_run_metadata_trace_the_instrumented_run():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [2, 3])
        y = tf.nn.relu(tf.matmul(x, tf.ones([3, 2])), name="relu")
    session = tf1.Session(graph=graph)
    feed = {x: np.arange(6, dtype=np.float32).reshape(2, 3) - 2}
    expected = session.run(y, feed)
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
    metadata = tf1.RunMetadata()
    tool = Count()
    with amanda.apply(tool):
        got = session.run(y, feed, options=options, run_metadata=metadata)
    assert np.array_equal(got, expected) and tool.calls["relu"] == 1
    traced = {node.node_name for dev in metadata.step_stats.dev_stats for node in dev.node_stats}
    assert "relu" in traced
    session.close()


@pytest.mark.parametrize("dtype, value", [
    (tf.int8, np.int8([1, -2, 3])), (tf.uint8, np.uint8([1, 2, 250])),
    (tf.complex64, np.complex64([1 + 2j, 3, -1j])), (tf.float16, np.float16([1, 2, 3]))])
def test_identity_routines_on_small_and_complex_dtypes_log_nothing(dtype, value):
    """Identity routines before and after every op give the plain values.
    The check amanda adds where a routine sees an integer constant (the
    axis of `tf.reverse`) made TensorFlow log "Object was never used" into
    the user's stderr when the copy was collected."""
    import gc
    import logging

    class Identity(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            context.insert_before_op(self.same)
            context.insert_after_op(self.same)

        def same(self, *arrays):
            return arrays if len(arrays) > 1 else (arrays[0] if arrays else None)

    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(dtype, [3])
        y = tf.reverse(x, [0]) * x + x
    session = tf1.Session(graph=graph)
    expected = session.run(y, {x: value})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = tf.get_logger()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with amanda.apply(Identity()):
                got = session.run(y, {x: value})
        session.close()
        del session
        gc.collect()
    finally:
        logger.removeHandler(handler)
    assert np.array_equal(got, expected)
    assert not [r for r in records if "never used" in r.getMessage()]
