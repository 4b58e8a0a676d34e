"""The shadow's runs through session callables (`runtime/tensorflow/callables.py`)
answer exactly as ``Session.run``: same values, types and errors, results that
never alias TensorFlow's buffers, checked by difference with a plain session."""

import numpy as np
import pytest

import amanda
from amanda.runtime.tensorflow import shadow as tensorflow_shadow

tf = pytest.importorskip("tensorflow")
v1 = tf.compat.v1


class Watch(amanda.Tool):
    """An observe-only routine after every op: fetched with the run."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_after_op(self.seen)

    def seen(self, *arrays):
        self.calls += 1


def exact_config():
    config = v1.ConfigProto()
    rewrites = config.graph_options.rewrite_options
    off = rewrites.OFF
    rewrites.arithmetic_optimization = rewrites.constant_folding = off
    return config


def build():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        n = v1.placeholder(tf.int32, [2], name="n")
        res = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="res")
        ref = v1.Variable(np.float32([1.0, 2.0]), name="ref", use_resource=False)
        y = tf.matmul(x, res, name="y")
        z = tf.negative(y, name="z")
        c = tf.constant([3.0, 4.0], name="c")
        names = tf.constant([b"a", b"bc"], name="names")
        m = tf.add(n, 1, name="m")
        bump = v1.assign_add(ref, [1.0, 1.0], name="bump")
        step = res.assign_add(tf.ones((3, 2)), name="step").op
        reads = [ref.value(), res.read_value()]
        doubled = c * 2
        init = v1.global_variables_initializer()
    return graph, dict(x=x, n=n, res=res, ref=ref, y=y, z=z, c=c, names=names, m=m,
                       bump=bump, step=step, reads=reads, doubled=doubled, init=init)


def sessions(graph, init):
    with graph.as_default():
        plain, instrumented = v1.Session(config=exact_config()), v1.Session(config=exact_config())
    plain.run(init)
    instrumented.run(init)
    return plain, instrumented


def same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            same(u, v)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes() if a.dtype != object else a.tolist() == b.tolist()
        assert a.flags.writeable == b.flags.writeable
    else:
        assert a == b


@pytest.fixture
def shadow_runs(monkeypatch):
    """How many of the shadow's runs went through ``Session.run``."""
    count = [0]
    original = tensorflow_shadow._original_run

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(tensorflow_shadow, "_original_run", counted)
    return count


def test_fetches_of_every_kind_equal_a_plain_session(shadow_runs):
    graph, t = build()
    plain, instrumented = sessions(graph, t["init"])
    ones = np.ones((2, 3), np.float32)
    cases = [
        ([t["y"], t["z"]], {t["x"]: ones}),
        ([t["z"], t["c"]], {t["x"]: [[1.0, 2.0, 3.0]]}),           # a Python list
        (t["z"], {t["x"]: np.ones((1, 3), np.float64)}),          # converted to float32
        ([t["res"], t["ref"]], None),                             # resource and ref variables
        (t["reads"], None),
        (t["names"], None),                                       # strings
        ([t["m"], t["n"]], {t["n"]: np.int32([4, 5])}),           # a fetched feed
        ({"y": t["y"], "op": t["bump"].op}, {t["x"]: ones}),      # an op: None
        ([t["z"], t["y"]], {t["y"]: ones[:, :2]}),                # a fed intermediate
        (t["c"], None),
    ]
    tool = Watch()
    for fetches, feed in cases:
        want = plain.run(fetches, feed)
        with amanda.apply(tool):
            got = instrumented.run(fetches, feed)
        same(got, want)
    assert tool.calls > 0
    # the plain numeric steps were answered by callables, not Session.run
    assert shadow_runs[0] < len(cases) // 2, shadow_runs[0]


@pytest.mark.parametrize("feed, error", [
    (np.ones((2, 4), np.float32), ValueError),       # wrong shape
    ([[1.0, 2.0]], ValueError),                      # wrong shape, a list
    ([["a", "b", "c"]], ValueError),                 # not numbers
    ("text", ValueError),
])
def test_bad_feeds_raise_what_a_plain_session_raises(feed, error):
    graph, t = build()
    plain, instrumented = sessions(graph, t["init"])
    with pytest.raises(error) as want:
        plain.run(t["z"], {t["x"]: feed})
    with amanda.apply(Watch()), pytest.raises(error) as got:
        instrumented.run(t["z"], {t["x"]: feed})
    assert type(got.value) is type(want.value)


def test_int_overflow_tensor_values_and_unfeedable_tensors_fail_as_in_tf():
    graph, t = build()
    graph.prevent_feeding(t["c"])
    plain, instrumented = sessions(graph, t["init"])
    for feed, fetch in [({t["n"]: 2**40}, t["m"]),                  # TypeError: int overflow
                        ({t["n"]: t["m"]}, t["m"]),   # TypeError: a tf.Tensor
                        ({t["c"]: np.float32([0, 0])}, t["doubled"])]:  # ValueError: may not be fed
        with pytest.raises(Exception) as want:
            plain.run(fetch, feed)
        with amanda.apply(Watch()), pytest.raises(Exception) as got:
            instrumented.run(fetch, feed)
        assert type(got.value) is type(want.value), (got.value, want.value)


def test_fetched_arrays_never_alias_variables_or_constants(shadow_runs):
    graph, t = build()
    plain, instrumented = sessions(graph, t["init"])
    with amanda.apply(Watch()):
        before = instrumented.run([t["reads"][0], t["c"], t["res"]])
        kept = [a.copy() for a in before]
        instrumented.run(t["bump"].op)               # in place, into the ref variable's buffer
        instrumented.run(t["step"])
        for array in before:
            array += 100.0                           # the caller's own arrays
        after = instrumented.run([t["reads"][0], t["c"], t["res"]])
    assert shadow_runs[0] == 0
    for got, want in zip(before, kept):
        np.testing.assert_array_equal(got - 100.0, want)
    plain.run(t["bump"])
    plain.run(t["step"])
    same(after, plain.run([t["reads"][0], t["c"], t["res"]]))


def test_a_training_loop_equals_a_plain_session(shadow_runs):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 4])
        label = v1.placeholder(tf.float32, [None, 1])
        w1 = v1.get_variable("w1", [4, 8])
        w2 = v1.get_variable("w2", [8, 1], use_resource=False)   # a v1 reference variable
        hidden = tf.nn.relu(tf.matmul(x, w1))
        out = tf.matmul(hidden, w2)
        loss = tf.reduce_mean(tf.square(out - label))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = v1.global_variables_initializer()
        weights = v1.trainable_variables()
    plain, instrumented = sessions(graph, init)
    instrumented.run(weights)                        # same initial values in both
    with graph.as_default():
        for var in weights:
            var.load(plain.run(var), instrumented)
    rng = np.random.default_rng(0)
    tool = Watch()
    for _ in range(5):
        feed = {x: rng.standard_normal((6, 4), dtype=np.float32),
                label: rng.standard_normal((6, 1), dtype=np.float32)}
        want = plain.run([loss, train], feed)
        with amanda.apply(tool):
            got = instrumented.run([loss, train], feed)
        same(got, want)
    same(instrumented.run(weights), plain.run(weights))
    assert tool.calls > 0 and shadow_runs[0] == 0


def test_run_options_and_metadata_go_through_session_run(shadow_runs):
    graph, t = build()
    plain, instrumented = sessions(graph, t["init"])
    metadata = v1.RunMetadata()
    with amanda.apply(Watch()):
        got = instrumented.run(t["z"], {t["x"]: np.ones((1, 3), np.float32)},
                               options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE),
                               run_metadata=metadata)
    assert shadow_runs[0] == 1 and len(metadata.step_stats.dev_stats) > 0
    same(got, plain.run(t["z"], {t["x"]: np.ones((1, 3), np.float32)}))


def test_a_step_known_to_fetch_large_tensors_never_goes_through_a_callable(shadow_runs,
                                                                          monkeypatch):
    """Fetched tensors whose static shapes average over ``COPY_LIMIT``
    bytes go through ``Session.run`` from the first run: a callable's
    results are copied, which would hold them twice. Where the shapes are
    not known, the first run measures them (through a callable)."""
    from amanda.runtime.tensorflow import callables as tensorflow_callables
    made = []
    original = v1.Session._make_callable_from_options

    def making(self, options):
        made.append(list(options.fetch))
        return original(self, options)

    monkeypatch.setattr(v1.Session, "_make_callable_from_options", making)
    side = 256   # 256 KiB of float32, over the 64 KiB limit
    assert side * side * 4 > tensorflow_callables.COPY_LIMIT
    graph = tf.Graph()
    with graph.as_default():
        known = v1.placeholder(tf.float32, [side, side], name="known")
        unknown = v1.placeholder(tf.float32, [None, side], name="unknown")
        big, big_unknown = tf.negative(known, name="big"), tf.negative(unknown, name="big_u")
    feed = {known: np.ones((side, side), np.float32), unknown: np.ones((side, side), np.float32)}
    with v1.Session(graph=graph) as plain:
        want = plain.run([big, big_unknown], feed)
    with v1.Session(graph=graph) as session, amanda.apply(Watch()):
        for _ in range(2):
            same(session.run(big, feed), want[0])
        assert made == [] and shadow_runs[0] == 2
        for _ in range(2):
            same(session.run(big_unknown, feed), want[1])
        # measured on the first run, through a callable; Session.run after
        assert len(made) == 1 and shadow_runs[0] == 3


def test_a_step_fetching_many_tensors_over_the_total_limit_never_copies_them(shadow_runs,
                                                                           monkeypatch):
    """Many tensors under the mean limit but over ``COPY_TOTAL_LIMIT`` in
    all: copies held beside them would add their total to the run's peak."""
    from amanda.runtime.tensorflow import callables as tensorflow_callables
    made = []
    original = v1.Session._make_callable_from_options
    monkeypatch.setattr(v1.Session, "_make_callable_from_options",
                        lambda self, options: made.append(1) or original(self, options))
    count, side = 300, 120   # 300 tensors of 56 KiB: 16.5 MiB
    each = side * side * 4
    assert each < tensorflow_callables.COPY_LIMIT
    assert count * each > tensorflow_callables.COPY_TOTAL_LIMIT
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [side, side], name="x")
        outs = [tf.add(x, float(i)) for i in range(count)]
    feed = {x: np.ones((side, side), np.float32)}
    with v1.Session(graph=graph) as plain:
        want = plain.run(outs, feed)
    with v1.Session(graph=graph) as session, amanda.apply(Watch()):
        same(session.run(outs, feed), want)
    assert made == [] and shadow_runs[0] == 1
