"""Generated TensorFlow graphs, checked by difference.

Hypothesis builds small random ``tf.compat.v1`` graphs (element-wise ops, a
resource variable read by several ``MatMul``s, multi-output ``split``,
broadcasting, boolean intermediates, constants, ``tf.cond`` with branches
reading outer values, a tensor read twice by one op) and a training step
(gradient descent on the variable). On each, in sessions with Grappler's
value-changing rewrites off (docs/tensorflow.md, ``NotBitExactWarning``):

* a tool observing before and after every op sees, at every run, exactly the
  values a plain session computes for those tensors, for each op that runs
  (the fetches' ancestors), once per run;
* a second ``apply`` scope (a cache hit), a fresh tool of the same kind (a
  fresh rewrite) and a scope under ``amanda.cache_disabled()`` see the same
  (op, point, values);
* Python identity routines at every forward and backward point leave the
  fetched values and the trained variable bit-identical to plain training;
* the user's graph is byte-identical afterwards.
"""

import collections
import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import amanda

tf = pytest.importorskip("tensorflow")

SHAPE = (2, 4)
UNARY = ("relu", "negative", "abs", "tanh", "sigmoid", "identity", "softmax")
BINARY = ("add", "subtract", "multiply", "maximum", "minimum")
_NUMERIC = (tf.float32, tf.float64, tf.int32, tf.int64, tf.bool)


def _config():
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                      intra_op_parallelism_threads=1,
                                      use_per_session_threads=True)
    rewrite = config.graph_options.rewrite_options
    off = rewrite.OFF
    rewrite.arithmetic_optimization = off
    rewrite.constant_folding = off
    return config


def _unary(name, value):
    if name == "softmax":
        return tf.nn.softmax(value, axis=1)
    if name == "relu":
        return tf.nn.relu(value)
    if name == "identity":
        return tf.identity(value)
    return getattr(tf.math, name)(value)


@st.composite
def programs(draw, max_ops=10):
    """A recipe: a list of steps and the outputs, replayed by `_build`."""
    steps = []
    floats, halves = 2, 0           # x, y; split halves
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["unary", "binary", "matmul", "split", "concat", "reduce",
                                     "where", "constant", "cond"]))
        pick = st.integers(0, floats - 1)
        if kind == "unary":
            steps.append(("unary", draw(st.sampled_from(UNARY)), draw(pick)))
        elif kind == "binary":
            left = draw(pick)
            steps.append(("binary", draw(st.sampled_from(BINARY)), left,
                          left if draw(st.booleans()) else draw(pick)))
        elif kind == "matmul":
            steps.append(("matmul", draw(pick)))
        elif kind == "split":
            steps.append(("split", draw(pick)))
            halves += 2
            continue
        elif kind == "concat":
            if not halves:
                continue
            steps.append(("concat", draw(st.integers(0, halves - 1)),
                          draw(st.integers(0, halves - 1))))
        elif kind == "reduce":
            steps.append(("reduce", draw(pick), draw(pick)))
        elif kind == "where":
            steps.append(("where", draw(pick), draw(pick)))
        elif kind == "constant":
            steps.append(("constant", draw(st.sampled_from([0.5, -1.0, 2.0]))))
        else:
            steps.append(("cond", draw(pick), draw(pick), draw(st.sampled_from(UNARY[:4])),
                          draw(st.sampled_from(UNARY[:4]))))
        floats += 1
    outputs = draw(st.lists(st.integers(2, max(2, floats - 1)), min_size=1, max_size=3,
                            unique=True)) if floats > 2 else []
    fed = draw(st.none() | st.integers(2, max(2, floats - 1))) if floats > 2 else None
    return steps, outputs, draw(st.booleans()), fed, draw(st.booleans())


def _compute(steps, x, y, w):
    """The recipe's tensors: x, y, then one per step that makes a float."""
    floats, halves = [x, y], []
    for step in steps:
        kind = step[0]
        if kind == "unary":
            floats.append(_unary(step[1], floats[step[2]]))
        elif kind == "binary":
            floats.append(getattr(tf.math, step[1])(floats[step[2]], floats[step[3]]))
        elif kind == "matmul":
            floats.append(tf.matmul(floats[step[1]], w))
        elif kind == "split":
            halves.extend(tf.split(floats[step[1]], 2, axis=1))
        elif kind == "concat":
            floats.append(tf.concat([halves[step[1]], halves[step[2]]], axis=1))
        elif kind == "reduce":
            floats.append(floats[step[1]] + tf.reduce_sum(floats[step[2]], axis=1,
                                                          keepdims=True))
        elif kind == "where":
            a, b = floats[step[1]], floats[step[2]]
            floats.append(tf.where(a > b, b, a))
        elif kind == "constant":
            floats.append(tf.constant(np.full(SHAPE, step[1], np.float32)))
        elif kind == "cond":
            source, inner, yes, no = floats[step[1]], floats[step[2]], step[3], step[4]
            floats.append(tf.cond(tf.reduce_sum(source) > 0, lambda: _unary(yes, inner),
                                  lambda: _unary(no, inner)))
    return floats


def _build(recipe):
    """The graph of a recipe: (graph, feeds, fetches, train op, variable, init).

    ``feeds`` are the placeholders and, where the recipe says so, one
    intermediate tensor fed in their place; ``fetches`` may hold the
    variable itself."""
    steps, outputs, train, fed, fetch_variable = recipe
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, SHAPE, name="x")
        y = tf.compat.v1.placeholder(tf.float32, SHAPE, name="y")
        w = tf.Variable(np.random.default_rng(7).standard_normal((4, 4)).astype(np.float32),
                        name="w")
        floats = _compute(steps, x, y, w)
        fetches = [floats[i] for i in outputs] or [tf.nn.relu(x)]
        inputs = [x, y] + ([floats[fed]] if fed is not None and fed < len(floats) else [])
        if fetch_variable:
            fetches.append(w)
        train_op = None
        if train:
            loss = tf.add_n([tf.reduce_sum(f * f) for f in fetches[:len(outputs) or 1]]) \
                + tf.reduce_sum(w * w)
            train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
        init = tf.compat.v1.variables_initializer([w])
    return graph, inputs, fetches, train_op, w, init


def _feeds(inputs, seed):
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(SHAPE).astype(np.float32) for p in inputs}


def _ancestors(tensors, fed=()):
    """The ops a run of ``tensors`` executes (inputs and control inputs; a
    fed tensor's producer does not run for it)."""
    fed = {t.name for t in fed}
    seen, stack = set(), [t.op for t in tensors if t.name not in fed]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs if t.name not in fed)
        stack.extend(op.control_inputs)
    return seen


class Observe(amanda.Tool):
    """Records (op name, point) -> copies of the values, per run."""

    def __init__(self):
        super().__init__()
        self.log = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        op = context.get_op()
        context.insert_before_op(self.look, op=op.name, point="before")
        context.insert_after_op(self.look, op=op.name, point="after")

    def look(self, *arrays, op, point):
        self.log.append((op, point, [None if a is None else np.array(a, copy=True)
                                     for a in arrays]))


class Identity(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True)

    def forward(self, context):
        context.insert_before_op(self.copy)
        context.insert_after_op(self.copy)

    def backward(self, context):
        context.insert_before_backward_op(self.copy)
        context.insert_after_backward_op(self.copy)

    def copy(self, *arrays):
        self.calls += 1     # (a resource handle arrives as None and must stay None)
        return [None if a is None else np.array(a, copy=True) for a in arrays]


def _by_point(log):
    found = collections.defaultdict(list)
    for op, point, arrays in log:
        found[(op, point)].append(arrays)
    return found


def _same(a, b):
    if a is None or b is None:
        return a is b
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _same_points(a, b):
    a, b = _by_point(a), _by_point(b)
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            assert len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y)), key


# no shrinking: a TF example takes about a second; the failing recipe prints as is
_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                     phases=[Phase.explicit, Phase.reuse, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(programs(), st.integers(0, 1000))
def test_observed_values_are_the_plain_ones_and_the_cache_changes_nothing(recipe, seed):
    graph, inputs, fetches, _, _, init = _build(recipe)
    before = graph.as_graph_def().SerializeToString(deterministic=True)
    feeds = _feeds(inputs, seed)
    ran = _ancestors([graph.as_graph_element(f) for f in fetches], feeds)
    numeric = {}
    for name in sorted(ran):
        op = graph.get_operation_by_name(name)
        numeric[name] = all(t.dtype in _NUMERIC and graph.is_fetchable(t)
                            for t in list(op.inputs) + list(op.outputs))
    with tf.compat.v1.Session(graph=graph, config=_config()) as plain:
        plain.run(init)
        probe = {t.name: t for name in ran if numeric[name]
                 for op in [graph.get_operation_by_name(name)]
                 for t in list(op.inputs) + list(op.outputs)}
        reference = dict(zip(probe, plain.run(list(probe.values()), feeds)))
        expected = plain.run(fetches, feeds)

    def observed_run(tool, scope):
        with tf.compat.v1.Session(graph=graph, config=_config()) as session:
            session.run(init)
            with scope(), amanda.apply(tool):
                start = len(tool.log)
                got = session.run(fetches, feeds)
                first = tool.log[start:]
                start = len(tool.log)
                again = session.run(fetches, feeds)
                second = tool.log[start:]
            for a, b in zip(expected, got):
                assert _same(a, b)
            for a, b in zip(expected, again):
                assert _same(a, b)
        _same_points(first, second)
        return first

    tool = Observe()
    log = observed_run(tool, contextlib.nullcontext)
    points = _by_point(log)
    for name in ran:
        op = graph.get_operation_by_name(name)
        if op.type in ("Placeholder", "NoOp"):
            continue
        for point, tensors in (("before", op.inputs), ("after", op.outputs)):
            assert len(points.get((name, point), [])) == 1, (name, op.type, point)
            if not numeric[name]:
                continue
            (arrays,) = points[(name, point)]
            assert len(arrays) == len(tensors), (name, point)
            for array, tensor in zip(arrays, tensors):
                assert _same(array, reference[tensor.name]), (name, op.type, point)
    top = {op.name for op in graph.get_operations()}
    # (function body ops have names of their own.) A fed tensor's producer, a
    # placeholder or an intermediate op, has its "after" point only: the fed value.
    read = {t.name for name in ran for t in graph.get_operation_by_name(name).inputs}
    for tensor, value in feeds.items():
        if tensor.op.inputs:        # (an op without inputs, a placeholder too, has one)
            assert (tensor.op.name, "before") not in points
        if tensor.name in read:
            (arrays,) = points[(tensor.op.name, "after")]
            assert _same(arrays[tensor.value_index], value)
    assert {op for op, _ in points if op in top} <= ran | {t.op.name for t in feeds}

    _same_points(log, observed_run(tool, contextlib.nullcontext))      # cache hit
    _same_points(log, observed_run(Observe(), contextlib.nullcontext))  # fresh rewrite
    _same_points(log, observed_run(Observe(), amanda.cache_disabled))
    assert graph.as_graph_def().SerializeToString(deterministic=True) == before


@_SETTINGS
@given(programs(), st.integers(0, 1000))
def test_identity_routines_change_no_value_and_no_training_step(recipe, seed):
    graph, inputs, fetches, train_op, w, init = _build(recipe)
    before = graph.as_graph_def().SerializeToString(deterministic=True)
    feeds = _feeds(inputs, seed)
    if train_op is not None:
        # a read of the variable in the training run races with its update
        # (plain TF gives either value), so it is fetched in runs of its own
        fetches = [f for f in fetches if f is not w]
    run = fetches + ([train_op] if train_op is not None else [])

    def steps(tool):
        with tf.compat.v1.Session(graph=graph, config=_config()) as session:
            session.run(init)
            results = []
            with (amanda.apply(tool) if tool is not None else contextlib.nullcontext()):
                for _ in range(2):
                    results.append(session.run(run, feeds)[:len(fetches)])
            results.append([session.run(w)])
        return results

    expected = steps(None)
    tool = Identity()
    got = steps(tool)
    # routines ran, unless the run executes nothing (every fetch fed) but the
    # variable reads of the last run
    ran = _ancestors([graph.as_graph_element(f) for f in fetches], feeds)
    assert tool.calls > 0 or (train_op is None and all(
        graph.get_operation_by_name(n).type == "Placeholder" for n in ran))
    for a, b in zip(expected, got):
        for p, q in zip(a, b):
            assert _same(p, q)
    assert graph.as_graph_def().SerializeToString(deterministic=True) == before



@settings(max_examples=30, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.integers(0, 1000))
def test_tf_function_identity_counts_and_cache(recipe, seed):
    """The same programs as ``tf.function``s called eagerly: identity routines
    leave the outputs and a gradient step bit-identical, a counting tool sees
    every op of the function once per call, and a cache hit in a new scope, a
    fresh tool and ``cache_disabled()`` see the same (op, point, values)."""
    steps, outputs, train, _, _ = recipe
    rng = np.random.default_rng(seed)
    x, y = (tf.constant(rng.standard_normal(SHAPE).astype(np.float32)) for _ in range(2))
    w = tf.Variable(np.random.default_rng(7).standard_normal((4, 4)).astype(np.float32))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            floats = _compute(steps, x, y, w)
            results = [floats[i] for i in outputs] or [tf.nn.relu(x)]
            loss = tf.add_n([tf.reduce_sum(r * r) for r in results]) + tf.reduce_sum(w * w)
        if train:
            w.assign_sub(0.01 * tape.gradient(loss, w))
        return results

    def calls(tool, scope=contextlib.nullcontext):
        w.assign(np.random.default_rng(7).standard_normal((4, 4)).astype(np.float32))
        with scope(), (amanda.apply(tool) if tool is not None else contextlib.nullcontext()):
            got = [[r.numpy() for r in step(x, y)] for _ in range(2)]
        return got + [[w.numpy()]]

    expected = calls(None)
    tool = Identity()
    for a, b in zip(expected, calls(tool)):
        assert all(_same(p, q) for p, q in zip(a, b))
    assert tool.calls > 0

    observer = Observe()
    first = len(observer.log)
    calls(observer)
    log = observer.log[first:]
    half = _by_point(log)
    assert all(len(v) == 2 for v in half.values())     # each point once per call
    for tool, scope in ((observer, contextlib.nullcontext), (Observe(), contextlib.nullcontext),
                        (Observe(), amanda.cache_disabled)):
        first = len(tool.log)
        calls(tool, scope)
        _same_points(log, tool.log[first:])


class Double(amanda.Tool):
    """Doubles input 0 before, or output 0 after, the named ops (Python routines)."""

    def __init__(self, before, after, native=False):
        super().__init__()
        self.before, self.after = before, after
        if native:
            two = np.float32(2)
            # pure arithmetic over a captured constant: inferred portable, so it is
            # lowered to the backend's own ops (docs/portable.md)
            self.double = lambda array: array * two
            assert amanda.portable.explain(self.double).portable
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        name = context.get_op().name
        if name in self.before:
            context.insert_before_op(self.double, inputs=[0])
        if name in self.after:
            context.insert_after_op(self.double, outputs=[0])

    def double(self, array):
        return array * np.float32(2)


def _hand_doubled(graph, before, after):
    """A GraphDef with a ``Mul`` by 2 where `Double` puts routines: before an
    op only that op reads the doubled value; after it, every reader does.
    Returns the GraphDef and the renaming of doubled outputs (for fetches)."""
    graph_def = graph.as_graph_def()
    graph_def.node.add().CopyFrom(_const_node("amanda_test_two", np.float32(2)))
    renamed = {}
    for name in after:
        node = graph_def.node.add()
        node.CopyFrom(_mul_node(f"{name}_doubled", f"{name}:0"))
        renamed[f"{name}:0"] = f"{name}_doubled:0"
    for node in graph_def.node:
        if node.name.endswith("_doubled") or node.name.startswith("amanda_test_"):
            continue
        for i, source in enumerate(node.input):
            key = source if ":" in source or source.startswith("^") else f"{source}:0"
            if key in renamed:
                node.input[i] = renamed[key][:-2]
    for name in before:
        node = next(n for n in graph_def.node if n.name == name)
        mul = graph_def.node.add()
        mul.CopyFrom(_mul_node(f"amanda_test_{name}_input", node.input[0]))
        node.input[0] = mul.name
    return graph_def, renamed


def _const_node(name, value):
    node = tf.compat.v1.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.float32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return node


def _mul_node(name, source):
    node = tf.compat.v1.NodeDef(name=name, op="Mul", input=[source, "amanda_test_two"])
    node.attr["T"].type = tf.float32.as_datatype_enum
    return node


@_SETTINGS
@given(programs(), st.integers(0, 1000), st.randoms(use_true_random=False), st.booleans())
def test_replacing_routines_equal_the_hand_edited_graph(recipe, seed, random, native):
    """Rewiring by difference, forward: routines that replace values (Python
    callbacks, or inferred portable and lowered natively) equal the same
    change written into the GraphDef by hand."""
    graph, inputs, fetches, _, w, init = _build(recipe)
    fetches = [f for f in fetches if f is not w]
    feeds = _feeds(inputs, seed)
    fed_ops = {t.op.name for t in feeds}
    ran = _ancestors(fetches, feeds)
    float32 = tf.float32

    def floats(tensors):
        return len(tensors) > 0 and tensors[0].dtype == float32

    # every op that runs, placeholders (their fed value) included; a fed
    # intermediate's producer does not run, so it has no "before" to double
    ops = [graph.get_operation_by_name(n) for n in sorted(ran | fed_ops)]
    ops = [op for op in ops if op.type == "Placeholder" or op.name not in fed_ops]
    before = {op.name for op in ops if floats(op.inputs) and random.random() < 0.4}
    after = {op.name for op in ops if floats(op.outputs) and random.random() < 0.4}
    edited, renamed = _hand_doubled(graph, before, after)
    reference = tf.Graph()
    with reference.as_default():
        tf.graph_util.import_graph_def(edited, name="")
    with tf.compat.v1.Session(graph=reference, config=_config()) as plain:
        plain.run(init.name)
        expected = plain.run([renamed.get(f.name, f.name) for f in fetches],
                             {t.name: v for t, v in feeds.items()})
    with tf.compat.v1.Session(graph=graph, config=_config()) as session:
        session.run(init)
        with amanda.apply(Double(before, after, native)):
            for _ in range(2):
                got = session.run(fetches, feeds)
                assert all(_same(e, g) for e, g in zip(expected, got)), (before, after)
