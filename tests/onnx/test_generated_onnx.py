"""Generated ONNX programs, checked by difference.

Hypothesis builds small random ONNX graphs (element-wise ops, a shared
weight, multi-output ``Split``, broadcasting, boolean intermediates,
``Constant`` nodes, ``If`` with branches reading outer values, ``Loop``s run
0, 1 or 3 times whose bodies read outer values, a value read
twice by one node, intermediates that are also graph outputs). On each:

* a tool observing before and after every op sees, at every run, exactly
  the values plain onnxruntime computes for that node (every intermediate
  fetched as a graph output of a plain session), each op once per run (only
  the taken ``If`` branch), producers before consumers;
* a second session in a new ``apply`` scope (a cache hit) and one built under
  ``amanda.cache_disabled()`` run the same (op id, point) sequence with the
  same values (the cache never changes which routines run);
* Python identity routines at every point leave the outputs bit-identical;
* the user's model is byte-identical afterwards.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amanda
from tests.onnx.conftest import onnx, ort, same  # noqa: F401
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
SHAPE = [2, 4]
UNARY = ("Relu", "Neg", "Abs", "Tanh", "Sigmoid", "Identity", "Softmax")
BINARY = ("Add", "Sub", "Mul", "Max", "Min")


class _Builder:
    def __init__(self):
        self.nodes, self.initializers = [], []
        self.values = {"x": "f", "y": "f"}       # name -> kind: f [2,4], h [2,2], c [2,1], b bool
        self.count = 0
        self.weights = []

    def new(self, kind):
        self.count += 1
        name = f"v{self.count}"
        self.values[name] = kind
        return name

    def of(self, kind):
        return sorted(n for n, k in self.values.items() if k == kind)


@st.composite
def programs(draw, max_nodes=12):
    b = _Builder()
    weight_made = False
    for _ in range(draw(st.integers(1, max_nodes))):
        floats = b.of("f")
        kind = draw(st.sampled_from(["unary", "binary", "matmul", "split", "concat", "reduce",
                                     "where", "constant", "if", "loop"]))
        if kind == "unary":
            op = draw(st.sampled_from(UNARY))
            attrs = {"axis": 1} if op == "Softmax" else {}
            out = b.new("f")
            b.nodes.append(helper.make_node(op, [draw(st.sampled_from(floats))], [out],
                                            name=f"n{b.count}", **attrs))
        elif kind == "binary":
            op = draw(st.sampled_from(BINARY))
            left = draw(st.sampled_from(floats))
            right = left if draw(st.booleans()) else draw(st.sampled_from(floats))
            out = b.new("f")
            b.nodes.append(helper.make_node(op, [left, right], [out], name=f"n{b.count}"))
        elif kind == "matmul":
            if not weight_made or draw(st.booleans()):
                seed = draw(st.integers(0, 2 ** 16))
                w = np.random.default_rng(seed).standard_normal((4, 4)).astype(np.float32)
                b.weights.append(f"w{len(b.weights)}")
                b.initializers.append(numpy_helper.from_array(w, b.weights[-1]))
                weight_made = True
            weight = draw(st.sampled_from(b.weights))
            out = b.new("f")
            b.nodes.append(helper.make_node("MatMul", [draw(st.sampled_from(floats)), weight],
                                            [out], name=f"n{b.count}"))
        elif kind == "split":
            first, second = b.new("h"), b.new("h")
            b.nodes.append(helper.make_node("Split", [draw(st.sampled_from(floats))],
                                            [first, second], name=f"n{b.count}", axis=1))
        elif kind == "concat" and len(b.of("h")) >= 1:
            halves = b.of("h")
            parts = [draw(st.sampled_from(halves)), draw(st.sampled_from(halves))]
            out = b.new("f")
            b.nodes.append(helper.make_node("Concat", parts, [out], name=f"n{b.count}", axis=1))
        elif kind == "reduce":
            axes = f"axes{b.count}"
            b.initializers.append(numpy_helper.from_array(np.array([1], np.int64), axes))
            column = b.new("c")
            b.nodes.append(helper.make_node("ReduceSum", [draw(st.sampled_from(floats)), axes],
                                            [column], name=f"n{b.count}", keepdims=1))
            out = b.new("f")
            b.nodes.append(helper.make_node("Add", [draw(st.sampled_from(floats)), column],
                                            [out], name=f"n{b.count}"))
        elif kind == "where":
            left, right = draw(st.sampled_from(floats)), draw(st.sampled_from(floats))
            mask = b.new("b")
            b.nodes.append(helper.make_node("Greater", [left, right], [mask], name=f"n{b.count}"))
            out = b.new("f")
            b.nodes.append(helper.make_node("Where", [mask, right, left], [out],
                                            name=f"n{b.count}"))
        elif kind == "constant":
            value = np.full(SHAPE, draw(st.sampled_from([0.5, -1.0, 2.0])), np.float32)
            out = b.new("f")
            b.nodes.append(helper.make_node("Constant", [], [out], name=f"n{b.count}",
                                            value=numpy_helper.from_array(value)))
        elif kind == "loop":
            # v <- v * outer + v, trip count 0, 1 or 3: body points per iteration
            trips = f"trips{b.count}"
            b.initializers.append(numpy_helper.from_array(
                np.array(draw(st.sampled_from([0, 1, 3])), np.int64), trips))
            start, outer = draw(st.sampled_from(floats)), draw(st.sampled_from(floats))
            out = b.new("f")
            body = helper.make_graph(
                [helper.make_node("Mul", ["v_in", outer], ["prod"], name=f"{out}_mul"),
                 helper.make_node("Add", ["prod", "v_in"], ["v_out"], name=f"{out}_add"),
                 helper.make_node("Identity", ["cond_in"], ["cond_out"], name=f"{out}_cond")],
                f"{out}_body",
                [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, SHAPE)],
                [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_out", TensorProto.FLOAT, SHAPE)])
            b.nodes.append(helper.make_node("Loop", [trips, "", start], [out],
                                            name=f"n{b.count}", body=body))
        elif kind == "if":
            source = draw(st.sampled_from(floats))
            total = b.new("s")
            b.nodes.append(helper.make_node("ReduceSum", [source], [total], name=f"n{b.count}",
                                            keepdims=0))
            zero = f"zero{b.count}"
            b.initializers.append(numpy_helper.from_array(np.array(0, np.float32), zero))
            cond = b.new("sb")
            b.nodes.append(helper.make_node("Greater", [total, zero], [cond],
                                            name=f"n{b.count}"))
            inner = draw(st.sampled_from(floats))
            out = b.new("f")
            branches = {}
            for branch, op in (("then_branch", draw(st.sampled_from(UNARY[:4]))),
                               ("else_branch", draw(st.sampled_from(UNARY[:4])))):
                result = f"{out}_{branch}"
                branches[branch] = helper.make_graph(
                    [helper.make_node(op, [inner], [result], name=f"{out}_{branch}_op")],
                    f"{out}_{branch}", [],
                    [helper.make_tensor_value_info(result, TensorProto.FLOAT, SHAPE)])
            b.nodes.append(helper.make_node("If", [cond], [out], name=f"n{b.count}",
                                            **branches))
    produced = [n for n in b.values if n not in ("x", "y") and b.values[n] == "f"]
    if not produced:
        out = b.new("f")
        b.nodes.append(helper.make_node("Relu", ["x"], [out], name=f"n{b.count}"))
        produced = [out]
    outputs = draw(st.lists(st.sampled_from(produced), min_size=1, max_size=3, unique=True))
    graph = helper.make_graph(
        b.nodes, "generated",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in ("x", "y")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in outputs],
        initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _feeds(seed):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("x", "y")}


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _reference(model, feeds):
    """Every top-level value of the graph, computed by plain onnxruntime."""
    everything = onnx.ModelProto()
    everything.CopyFrom(model)
    declared = {o.name for o in everything.graph.output}
    for node in everything.graph.node:
        for name in node.output:
            if name and name not in declared:
                everything.graph.output.append(helper.make_empty_tensor_value_info(name))
                declared.add(name)
    names = [o.name for o in everything.graph.output]
    values = dict(zip(names, _session(everything).run(None, feeds)))
    values.update(feeds)
    values.update({i.name: numpy_helper.to_array(i) for i in model.graph.initializer})
    return values


class Observe(amanda.Tool):
    """Records (op id, point, copies of the arrays) at every op's two points."""

    def __init__(self):
        super().__init__()
        self.log = []
        self.names = {}
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        op_id = context.get_op_id()
        self.names[op_id] = context.get_op()
        context.insert_before_op(self.look, op=op_id, point="before")
        context.insert_after_op(self.look, op=op_id, point="after")

    def look(self, *arrays, op, point):
        self.log.append((op, point, [None if a is None else np.array(a, copy=True)
                                     for a in arrays]))


class Identity(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        context.insert_before_op(self.copy)
        context.insert_after_op(self.copy)

    def copy(self, *arrays):
        self.calls += 1
        return [None if a is None else np.array(a, copy=True) for a in arrays]


def _inputs(node):
    """A node's inputs as amanda's points see them: the outer values its
    subgraphs read are explicit inputs after its own, once each, also when
    the node reads one of them itself (docs/onnx.md)."""
    captured = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            local = {n for inner in attribute.g.node for n in inner.output}
            local.update(i.name for i in attribute.g.input)
            for inner in attribute.g.node:
                captured += [n for n in inner.input if n and n not in local and n not in captured]
    return list(node.input) + captured


def _same_log(a, b):
    if [(op, point) for op, point, _ in a] != [(op, point) for op, point, _ in b]:
        return False
    return all(len(x) == len(y) and all((p is None and q is None) or same(p, q)
                                        for p, q in zip(x, y))
               for (_, _, x), (_, _, y) in zip(a, b))


_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(programs(), st.integers(0, 1000))
def test_observed_values_are_the_plain_ones_and_the_cache_changes_nothing(model, seed):
    before = model.SerializeToString()
    feeds = _feeds(seed)
    reference = _reference(model, feeds)
    plain = _session(model).run(None, feeds)

    tool = Observe()
    with amanda.apply(tool):
        first = _session(model)
    logs = []
    for _ in range(2):
        start = len(tool.log)
        got = first.run(None, feeds)
        assert all(same(p, g) for p, g in zip(plain, got))
        logs.append(tool.log[start:])
    assert _same_log(logs[0], logs[1])
    log = logs[0]

    # every top-level node: once per run, before then after, with the plain values
    nodes = {n.name: n for n in model.graph.node}
    seen = {}
    for op, point, arrays in log:
        seen.setdefault(op, []).append(point)
        node = tool.names[op]
        if getattr(node, "name", None) in nodes:
            names = _inputs(node) if point == "before" else list(node.output)
            # (an empty optional input keeps its slot, as None)
            expected = [reference[n] if n else None for n in names]
            assert len(arrays) == len(expected), (node.op_type, point)
            for got_value, want in zip(arrays, expected):
                assert (got_value is None and want is None) or same(got_value, want), \
                    (node.op_type, node.name, point)
    top = [op for op in seen if getattr(tool.names[op], "name", None) in nodes]
    assert len(top) == len(nodes)
    # body ops: before/after pairs, once per iteration (only the taken branch)
    assert all(points == ["before", "after"] * (len(points) // 2) and points
               for points in seen.values())
    for op in top:
        node = tool.names[op]
        if node.op_type == "Loop":
            trips = int(reference[node.input[0]])
            body = [inner.name for a in node.attribute if a.name == "body" for inner in a.g.node]
            counts = [len(seen[o]) // 2 for o in seen
                      if getattr(tool.names[o], "name", None) in body]
            assert counts == [trips] * len(body) if trips else counts == [], (trips, counts)

    # producers' after-points come before their consumers' before-points
    position = {(op, point): i for i, (op, point, _) in enumerate(log)}
    producer = {}
    for op in top:
        for name in tool.names[op].output:
            producer[name] = op
    for op in top:
        for name in tool.names[op].input:
            if name in producer:
                assert position[(producer[name], "after")] < position[(op, "before")]

    # a cache hit in a new scope, and a build with the cache disabled, run the same
    with amanda.apply(tool):
        second = _session(model)
    with amanda.cache_disabled(), amanda.apply(tool):
        third = _session(model)
    for session in (second, third):
        start = len(tool.log)
        got = session.run(None, feeds)
        assert all(same(p, g) for p, g in zip(plain, got))
        assert _same_log(log, tool.log[start:])
    assert model.SerializeToString() == before


@_SETTINGS
@given(programs(), st.integers(0, 1000))
def test_identity_routines_change_no_output(model, seed):
    before = model.SerializeToString()
    feeds = _feeds(seed)
    plain = _session(model).run(None, feeds)
    tool = Identity()
    with amanda.apply(tool):
        session = _session(model)
    got = session.run(None, feeds)
    assert tool.calls >= 2 * len(model.graph.node)
    assert all(same(p, g) for p, g in zip(plain, got))
    assert model.SerializeToString() == before


_FLOAT_OUT = set(UNARY) | set(BINARY) | {"MatMul", "Concat", "Where", "Constant", "Split", "Add"}
_FLOAT_IN = set(UNARY) | set(BINARY) | {"MatMul", "Split", "ReduceSum", "Greater", "Add"}


class Double(amanda.Tool):
    """Doubles input 0 before, or output 0 after, the chosen nodes (Python routines)."""

    def __init__(self, before, after, native=False):
        super().__init__()
        self.before, self.after = before, after
        if native:
            two = np.float32(2)
            # pure arithmetic over a captured constant: inferred portable, so it is
            # lowered to the backend's own ops (docs/portable.md)
            self.double = lambda array: array * two
            assert amanda.portable.explain(self.double).portable
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        name = getattr(context.get_op(), "name", None)
        if name in self.before:
            context.insert_before_op(self.double, inputs=[0])
        if name in self.after:
            context.insert_after_op(self.double, outputs=[0])

    def double(self, array):
        return array * np.float32(2)


def _hand_doubled(model, before, after):
    """The model with a ``Mul`` by 2 written in where `Double` puts routines:
    before a node only that node reads the doubled value; after it, every
    reader (and the graph output) does."""
    edited = onnx.ModelProto()
    edited.CopyFrom(model)
    graph = edited.graph
    graph.initializer.append(numpy_helper.from_array(np.array(2, np.float32), "two"))
    nodes = []
    for node in graph.node:
        if node.name in before:
            doubled = f"{node.input[0]}_doubled_for_{node.name}"
            nodes.append(helper.make_node("Mul", [node.input[0], "two"], [doubled]))
            node.input[0] = doubled
        nodes.append(node)
        if node.name in after:
            raw = f"{node.output[0]}_raw"
            nodes.append(helper.make_node("Mul", [raw, "two"], [node.output[0]]))
            node.output[0] = raw
    del graph.node[:]
    graph.node.extend(nodes)
    return edited


@_SETTINGS
@given(programs(), st.integers(0, 1000), st.randoms(use_true_random=False), st.booleans())
def test_replacing_routines_equal_the_hand_edited_model(model, seed, random, native):
    """Rewiring by difference: routines that replace values (Python
    callbacks, or inferred portable and lowered natively) equal the same
    change written into the model by hand (optimisations off on both sides,
    so no fusion tells them apart)."""
    before = sorted(n.name for n in model.graph.node
                    if n.op_type in _FLOAT_IN and random.random() < 0.4)
    after = sorted(n.name for n in model.graph.node
                   if n.op_type in _FLOAT_OUT and random.random() < 0.4)
    feeds = _feeds(seed)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def session(proto):
        return ort.InferenceSession(proto.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])

    expected = session(_hand_doubled(model, set(before), set(after))).run(None, feeds)
    with amanda.apply(Double(set(before), set(after), native)):
        instrumented = session(model)
    for _ in range(2):
        got = instrumented.run(None, feeds)
        assert all(same(e, g) for e, g in zip(expected, got)), (before, after)
