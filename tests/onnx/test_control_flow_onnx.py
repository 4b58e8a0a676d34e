"""Ops inside If/Loop/Scan bodies are instrumentation points of their own.

Each body op has the id ``"<holding op>/<attribute>/<node name>"`` and its
routines run on every execution of the body (each Loop iteration, the taken
If branch only), in program order with the rest of the model; observe-only
tools stay bit-identical, replacements inside bodies change what the body
computes.
"""

import collections

import numpy as np
import pytest
from onnx import TensorProto

import amanda
import amanda.runtime.onnx
from amanda import portable
from amanda.errors import BackendError
from tests.onnx.conftest import helper, numpy_helper, onnx, ort, same, session

LEVELS = [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          ort.GraphOptimizationLevel.ORT_ENABLE_ALL]
TRIPS = 5


def _float(name, shape=None):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def control_model(trips=TRIPS):
    """x_in[3] -> Mul "scale" -> Loop "loop" (``trips`` iterations; its body
    holds If "branch": doubling on even iterations, adding one on odd ones, then
    adds x, read from the enclosing graph) -> ReduceSum -> If "sign" (Relu or
    Neg of the sum). Outputs: y (the If's) and v_final (the Loop's)."""
    even = helper.make_graph([helper.make_node("Mul", ["v_in", "two"], ["t_out"], name="double")],
                             "even", [], [_float("t_out", [3])])
    odd = helper.make_graph([helper.make_node("Add", ["v_in", "one"], ["e_out"], name="inc")],
                            "odd", [], [_float("e_out", [3])])
    body = helper.make_graph([
        helper.make_node("Mod", ["i", "two_i"], ["parity"], name="parity"),
        helper.make_node("Equal", ["parity", "zero_i"], ["even"], name="is_even"),
        helper.make_node("If", ["even"], ["stepped"], name="branch", then_branch=even,
                         else_branch=odd),
        helper.make_node("Add", ["stepped", "x"], ["v_out"], name="add_x"),
        helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"),
        helper.make_node("Identity", ["v_out"], ["scan_out"], name="emit")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), _float("v_in", [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _float("v_out", [3]),
         _float("scan_out", [3])])
    relu = helper.make_graph([helper.make_node("Relu", ["total"], ["p_out"], name="relu")],
                             "pos", [], [_float("p_out", [])])
    neg = helper.make_graph([helper.make_node("Neg", ["total"], ["n_out"], name="neg")],
                            "neg", [], [_float("n_out", [])])
    nodes = [
        helper.make_node("Mul", ["x_in", "one"], ["x"], name="scale"),
        helper.make_node("Loop", ["trips", "true", "x"], ["v_final", "history"], name="loop",
                         body=body),
        helper.make_node("ReduceSum", ["history"], ["total"], name="sum", keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"], name="positive"),
        helper.make_node("If", ["positive"], ["y"], name="sign", then_branch=relu,
                         else_branch=neg)]
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in (
        ("trips", trips, np.int64), ("true", True, np.bool_), ("two", 2, np.float32),
        ("one", 1, np.float32), ("zero", 0, np.float32), ("two_i", 2, np.int64),
        ("zero_i", 0, np.int64))]
    graph = helper.make_graph(nodes, "control", [_float("x_in", [3])],
                              [_float("y", []), _float("v_final", [3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def simulate(x, trips=TRIPS, double=lambda v: v * 2, after_add=lambda v: v):
    """NumPy version of `control_model`: (y, v_final, per-iteration values)."""
    v, history, steps = x.astype(np.float32), [], []
    for i in range(trips):
        stepped = double(v) if i % 2 == 0 else v + np.float32(1)
        v = after_add(stepped + x)
        steps.append((i, stepped, v))
        history.append(v)
    total = np.sum(np.stack(history))
    y = np.maximum(total, 0) if total > 0 else -total
    return np.float32(y), v, steps


def program_order(trips, positive=True):
    """(op id, point) of one run, in program order."""
    points = ["scale", "loop"]
    order = []
    for op in points:
        order.append((op, "before"))
        if op == "scale":
            order.append((op, "after"))
    for i in range(trips):
        for op in ["parity", "is_even", "branch"]:
            order.append((f"loop/body/{op}", "before"))
            if op != "branch":
                order.append((f"loop/body/{op}", "after"))
        inner = "then_branch/double" if i % 2 == 0 else "else_branch/inc"
        order += [(f"loop/body/branch/{inner}", "before"), (f"loop/body/branch/{inner}", "after"),
                  ("loop/body/branch", "after")]
        for op in ["add_x", "keep", "emit"]:
            order += [(f"loop/body/{op}", "before"), (f"loop/body/{op}", "after")]
    order.append(("loop", "after"))
    for op in ["sum", "positive"]:
        order += [(op, "before"), (op, "after")]
    inner = "sign/then_branch/relu" if positive else "sign/else_branch/neg"
    order += [("sign", "before"), (inner, "before"), (inner, "after"), ("sign", "after")]
    return order


class Record(amanda.Tool):
    """Records (op id, point, copies of the arrays) of every routine call."""

    def __init__(self, may_replace=False):
        super().__init__()
        self.log = []
        self.nodes = {}
        self.add_inst_for_op(self.analyse, require_outputs=True)
        self.look = self.look_inline if may_replace else self.look_side

    def analyse(self, context):
        self.nodes[context.get_op_id()] = context.get_op()
        context.insert_before_op(self.look, op=context.get_op_id(), point="before")
        context.insert_after_op(self.look, op=context.get_op_id(), point="after")

    def look_side(self, *arrays, op, point):
        self.log.append((op, point, [None if a is None else np.array(a) for a in arrays]))

    def look_inline(self, *arrays, op, point):
        self.log.append((op, point, [None if a is None else np.array(a) for a in arrays]))
        if not arrays:   # never: the code may return something, so it is in the dataflow
            return arrays
        return None


def instrumented_session(model, tool, level=None):
    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    with amanda.apply(tool):
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])


X = np.array([1, -2, 3], np.float32)


def test_every_body_op_is_a_point_with_its_own_id():
    model = control_model()
    tool = Record()
    instrumented_session(model, tool)
    body = model.graph.node[1].attribute[0].g
    branch = body.node[2]
    expected = {"scale": "Mul", "loop": "Loop", "sum": "ReduceSum", "positive": "Greater",
                "sign": "If", "sign/then_branch/relu": "Relu", "sign/else_branch/neg": "Neg",
                "loop/body/parity": "Mod", "loop/body/is_even": "Equal",
                "loop/body/branch": "If", "loop/body/add_x": "Add", "loop/body/keep": "Identity",
                "loop/body/emit": "Identity", "loop/body/branch/then_branch/double": "Mul",
                "loop/body/branch/else_branch/inc": "Add"}
    assert {k: n.op_type for k, n in tool.nodes.items()} == expected
    # get_op() is the model's own NodeProto, wherever it sits
    then_branch = next(a.g for a in branch.attribute if a.name == "then_branch")
    assert tool.nodes["loop/body/branch"] == branch
    assert tool.nodes["loop/body/branch/then_branch/double"] == then_branch.node[0]


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_body_routines_run_per_iteration_in_program_order_and_observe_exactly(level):
    model = control_model()
    tool = Record()
    instrumented = instrumented_session(model, tool, level)
    plain = session(model, level)
    for x in (X, -X):
        tool.log.clear()
        got = instrumented.run(None, {"x_in": x})
        assert all(same(a, b) for a, b in zip(plain.run(None, {"x_in": x}), got))
        y, v_final, steps = simulate(x)
        assert [(op, point) for op, point, _ in tool.log] == program_order(TRIPS, y == np.sum(
            [s[2] for s in steps]))
        counts = collections.Counter(op for op, point, _ in tool.log if point == "before")
        assert counts["loop/body/add_x"] == TRIPS and counts["loop"] == 1
        assert counts["loop/body/branch/then_branch/double"] == (TRIPS + 1) // 2
        assert counts["loop/body/branch/else_branch/inc"] == TRIPS // 2
        # what each iteration's routines received
        seen = [arrays for op, point, arrays in tool.log
                if (op, point) == ("loop/body/add_x", "before")]
        for (i, stepped, v), (got_stepped, got_x) in zip(steps, seen):
            np.testing.assert_array_equal(got_stepped, stepped)
            np.testing.assert_array_equal(got_x, x)
        parities = [arrays[0] for op, point, arrays in tool.log
                    if (op, point) == ("loop/body/parity", "before")]
        assert [int(p) for p in parities] == list(range(TRIPS))
        (final,) = [arrays for op, point, arrays in tool.log if (op, point) == ("loop", "after")]
        np.testing.assert_array_equal(final[0], v_final)


def test_a_negative_sum_takes_the_else_branch():
    model = control_model()
    tool = Record()
    instrumented = instrumented_session(model, tool)
    x = np.array([-5, -5, -5], np.float32)
    y, _, _ = simulate(x)
    got = instrumented.run(None, {"x_in": x})
    assert got[0] == y
    assert [(op, point) for op, point, _ in tool.log] == program_order(TRIPS, positive=False)


def test_routines_in_the_bodies_dataflow_are_bit_identical_at_disable_all():
    model = control_model()
    tool = Record(may_replace=True)
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    instrumented = instrumented_session(model, tool, level)
    got = instrumented.run(None, {"x_in": X})
    assert all(same(a, b) for a, b in zip(session(model, level).run(None, {"x_in": X}), got))
    assert [(op, point) for op, point, _ in tool.log] == program_order(TRIPS)


class Replace(amanda.Tool):
    """Replaces what the body's ``add_x`` computes (negates it) and what the
    inner If's ``double`` reads (its factor: 3 instead of 2)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        if context.get_op_id() == "loop/body/add_x":
            context.insert_after_op(self.negate)
        if context.get_op_id() == "loop/body/branch/then_branch/double":
            context.insert_before_op(self.triple, inputs=[1])

    def negate(self, v):
        return -v

    def triple(self, factor):
        return factor * np.float32(1.5)


def test_replacements_inside_bodies_change_what_the_bodies_compute():
    model = control_model()
    with pytest.warns(UserWarning, match="replace"):
        instrumented = instrumented_session(model, Replace())
    y, v_final, _ = simulate(X, double=lambda v: v * 3, after_add=lambda v: -v)
    got = instrumented.run(None, {"x_in": X})
    np.testing.assert_allclose(got[1], v_final)
    np.testing.assert_allclose(got[0], y)


def test_amanda_instrument_hosts_body_routines_and_export_lowers_portable_ones():
    model = control_model()
    tool = Record()
    instrumented = amanda.instrument(model, tool)
    onnx.checker.check_model(instrumented)
    got = amanda.runtime.onnx.inference_session(instrumented).run(None, {"x_in": X})
    assert all(same(a, b) for a, b in zip(session(model).run(None, {"x_in": X}), got))
    assert [(op, point) for op, point, _ in tool.log] == program_order(TRIPS)

    class Negate(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            if context.get_op_id() == "loop/body/add_x":
                context.insert_after_op(self.negate)

        @portable.routine
        def negate(self, v):
            return -v

    exported = amanda.runtime.onnx.export(model, Negate())
    onnx.checker.check_model(exported, full_check=True)
    y, v_final, _ = simulate(X, after_add=lambda v: -v)
    got = session(exported).run(None, {"x_in": X})   # a plain onnxruntime session
    np.testing.assert_allclose(got[1], v_final)
    np.testing.assert_allclose(got[0], y)


def scan_model(length=6):
    """Scan "scan" summing the rows of s[length, 2]: body Add "acc" + Identity."""
    body = helper.make_graph(
        [helper.make_node("Add", ["sum_in", "row"], ["sum_out"], name="acc"),
         helper.make_node("Identity", ["sum_out"], ["partial"], name="emit")], "scan_body",
        [_float("sum_in", [2]), _float("row", [2])], [_float("sum_out", [2]), _float("partial", [2])])
    graph = helper.make_graph(
        [helper.make_node("Scan", ["init", "s"], ["total", "partials"], name="scan",
                          num_scan_inputs=1, body=body)], "scan",
        [_float("init", [2]), _float("s", [length, 2])],
        [_float("total", [2]), _float("partials", [length, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_scan_body_ops_run_once_per_row():
    model = scan_model()
    tool = Record()
    instrumented = instrumented_session(model, tool)
    feeds = {"init": np.zeros(2, np.float32),
             "s": np.arange(12, dtype=np.float32).reshape(6, 2)}
    got = instrumented.run(None, feeds)
    assert all(same(a, b) for a, b in zip(session(model).run(None, feeds), got))
    rows = [arrays[1] for op, point, arrays in tool.log if (op, point) == ("scan/body/acc", "before")]
    np.testing.assert_array_equal(np.stack(rows), feeds["s"])
    assert [op for op, point, _ in tool.log if point == "before"] == \
        ["scan"] + ["scan/body/acc", "scan/body/emit"] * 6


def test_evaluate_refuses_a_body_value_with_a_clear_error():
    model = control_model()

    class Evaluate(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_id() == "loop/body/add_x":
                amanda.evaluate(context.get_inputs()[0])

    with pytest.raises(BackendError, match="inside a body of Loop 'loop'"):
        amanda.instrument(model, Evaluate())


def _control_flow_cases():
    """onnx's own node test cases whose graphs hold If/Loop/Scan (in memory:
    ``onnx.backend.test.case``; about 38 of them: Loop, If, Scan, and
    functions expanded into them, e.g. Range, SequenceMap, AffineGrid)."""
    import warnings
    from onnx.backend.test.case.node import collect_testcases

    def holds(graph):
        return any(n.op_type in ("Loop", "If", "Scan")
                   or any(a.HasField("g") and holds(a.g) for a in n.attribute)
                   for n in graph.node)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    return {c.name: c for c in cases if holds(c.model.graph)}


CASES = _control_flow_cases()


def _case(name):
    case = CASES[name]
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    model.ir_version = min(model.ir_version, amanda.runtime.onnx.MAX_IR_VERSION)
    names = [i.name for i in model.graph.input]
    feeds = [dict(zip(names, inputs)) for inputs, _ in case.data_sets]
    try:
        plain = session(model)
        expected = [plain.run(None, f) for f in feeds]
    except Exception as error:   # noqa: BLE001 - kernels this onnxruntime lacks
        pytest.skip(f"onnxruntime cannot run {name}: {str(error)[:120]}")
    return model, feeds, expected


def _body_ops(graph, prefix=""):
    ids = []
    for node in graph.node:
        for attribute in node.attribute:
            subs = ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)
            for k, sub in enumerate(subs):
                where = f"{attribute.name}" + (f"[{k}]" if not attribute.HasField("g") else "")
                inner = f"{prefix}{node.name or node.op_type}/{where}/"
                ids += [inner + (n.name or n.op_type) for n in sub.node
                        if n.name]   # unnamed ones get numbered: not predictable here
                ids += _body_ops(sub, inner)
    return ids


def _same(a, b):
    """`same`, also for sequence outputs (lists of arrays)."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and \
            all(_same(x, y) for x, y in zip(a, b))
    return same(a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_control_flow_cases_observed_and_identity(name):
    model, feeds, expected = _case(name)
    observer = Record()
    instrumented = instrumented_session(model, observer)
    for f, want in zip(feeds, expected):
        assert all(_same(a, b) for a, b in zip(want, instrumented.run(None, f)))
    assert set(_body_ops(model.graph)) <= set(observer.nodes)
    assert any("/" in op for op, _, _ in observer.log)   # some body op ran
    identity = Record(may_replace=True)
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = session(model, level)
    try:
        instrumented = instrumented_session(model, identity, level)
    except BackendError as error:
        # the LinearAttention expansions: Scan bodies without declared shapes
        assert "whose outputs' shapes the model does not declare" in str(error)
        assert name.startswith("test_linear_attention")
        return
    for f in feeds:
        assert all(_same(a, b) for a, b in zip(plain.run(None, f), instrumented.run(None, f)))
    # the same points run in the same order, observed or in the dataflow
    assert [(op, point) for op, point, _ in identity.log] == \
        [(op, point) for op, point, _ in observer.log]


def test_replacing_routines_in_a_scan_body_of_unknown_shapes_are_a_clear_error():
    model = scan_model()
    body = next(a.g for a in model.graph.node[0].attribute if a.name == "body")
    for value in list(body.input) + list(body.output):
        value.type.tensor_type.ClearField("shape")   # onnx cannot infer them either
    feeds = {"init": np.zeros(2, np.float32),
             "s": np.arange(12, dtype=np.float32).reshape(6, 2)}
    with pytest.raises(BackendError, match="inside the body of Scan 'scan'.*declare"):
        instrumented_session(model, Record(may_replace=True))
    observer = Record()   # observing still works there
    got = instrumented_session(model, observer).run(None, feeds)
    assert all(same(a, b) for a, b in zip(session(model).run(None, feeds), got))
    assert sum(op == "scan/body/acc" for op, _, _ in observer.log) == 12
