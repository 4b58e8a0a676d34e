"""Instrumenting ONNX models: sessions inside apply, amanda.instrument, export.

Differential tests against the uninstrumented model and against references
computed by hand in NumPy.
"""

import os

import numpy as np
import pytest

import amanda
import amanda.runtime.onnx as onnx_runtime
from amanda import portable
from amanda.tools.identity import IdentityTool
from tests.onnx.conftest import light_feeds, light_models, mlp, onnx, ort, same, session


class Prune(amanda.Tool):
    """Masks the weight of every Gemm/Conv with a portable routine."""

    def __init__(self, masks=None, threshold=None):
        super().__init__()
        self.masks = masks or {}
        self.threshold = threshold
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().op_type in ("Gemm", "Conv"):
            mask = self.masks.get(context.get_op_id())
            if mask is None:   # magnitude pruning from the weight's value
                weight = amanda.evaluate(context.get_inputs()[1])
                mask = (np.abs(weight) > self.threshold).astype(weight.dtype)
                self.masks[context.get_op_id()] = mask
            context.insert_before_op(self.mask_weight, inputs=[1], mask=mask)

    @portable.routine
    def mask_weight(self, weight, mask):
        return weight * mask


class FakeQuant(amanda.Tool):
    """Fake-quantizes the output of every op of ``op_type`` (portable)."""

    def __init__(self, op_type, scale, zero_point, qmin=-128, qmax=127):
        super().__init__()
        self.op_type, self.params = op_type, dict(scale=scale, zero_point=zero_point,
                                                  qmin=qmin, qmax=qmax)
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        if context.get_op_name() == self.op_type:
            context.insert_after_op(self.quantize, outputs=[0], **self.params)

    @portable.routine
    def quantize(self, x, scale, zero_point, qmin, qmax):
        return portable.fake_quant(x, scale, zero_point, qmin, qmax)


class Count(amanda.Tool):
    """A Python routine (not portable) before every op: counts executions."""

    def __init__(self):
        super().__init__()
        self.calls = {}
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.count, op=context.get_op_id())

    def count(self, *arrays, op):
        self.calls[op] = self.calls.get(op, 0) + 1


def fake_quant_reference(x, scale, zero_point, qmin, qmax):
    scale = np.float32(scale)
    return ((np.clip(np.round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale
            ).astype(np.float32)


def test_weight_mask_exports_as_onnx_nodes_equal_to_numpy(mlp_model, x24):
    mask = (np.random.default_rng(2).random((4, 3)) > 0.5).astype(np.float32)
    before = mlp_model.SerializeToString()
    exported = onnx_runtime.export(mlp_model, Prune({"fc": mask}))
    assert mlp_model.SerializeToString() == before
    onnx.checker.check_model(exported, full_check=True)
    assert [n.op_type for n in exported.graph.node] == ["Mul", "Gemm", "Relu"]
    weight, bias = (onnx.numpy_helper.to_array(t) for t in mlp_model.graph.initializer)
    reference = np.maximum(x24 @ (weight * mask) + bias, 0)
    np.testing.assert_allclose(session(exported).run(None, {"x": x24})[0], reference,
                               rtol=1e-6, atol=1e-6)


def test_fake_quant_exports_as_qdq_pair_equal_to_numpy(mlp_model, x24):
    exported = onnx_runtime.export(mlp_model, FakeQuant("Relu", 0.05, 3))
    onnx.checker.check_model(exported, full_check=True)
    types = [n.op_type for n in exported.graph.node]
    assert types == ["Gemm", "Relu", "QuantizeLinear", "DequantizeLinear"]
    hidden = session(mlp_model).run(None, {"x": x24})[0]
    got = session(exported).run(None, {"x": x24})[0]
    assert same(got, fake_quant_reference(hidden, 0.05, 3, -128, 127))


def test_fake_quant_with_other_range_uses_arithmetic(mlp_model, x24):
    exported = onnx_runtime.export(mlp_model, FakeQuant("Relu", 0.1, 0, qmin=-8, qmax=7))
    onnx.checker.check_model(exported, full_check=True)
    assert "Round" in [n.op_type for n in exported.graph.node]
    hidden = session(mlp_model).run(None, {"x": x24})[0]
    assert same(session(exported).run(None, {"x": x24})[0],
                fake_quant_reference(hidden, 0.1, 0, -8, 7))


def test_session_inside_apply_runs_instrumented_model_and_scope_restores(mlp_model, x24):
    original_init = ort.InferenceSession.__init__
    tool = Prune(threshold=0.5)
    with amanda.apply(tool):
        assert ort.InferenceSession.__init__ is not original_init
        instrumented = ort.InferenceSession(mlp_model.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
    assert ort.InferenceSession.__init__ is original_init
    weight, bias = (onnx.numpy_helper.to_array(t) for t in mlp_model.graph.initializer)
    assert same(tool.masks["fc"], (np.abs(weight) > 0.5).astype(np.float32))
    reference = np.maximum(x24 @ (weight * tool.masks["fc"]) + bias, 0)
    np.testing.assert_allclose(instrumented.run(None, {"x": x24})[0], reference, rtol=1e-6)
    plain = ort.InferenceSession(mlp_model.SerializeToString(),
                                 providers=["CPUExecutionProvider"])
    assert same(plain.run(None, {"x": x24})[0], session(mlp_model).run(None, {"x": x24})[0])


def test_scope_restores_after_a_tool_error(mlp_model):
    class Broken(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda context: 1 / 0)

    original_init = ort.InferenceSession.__init__
    with pytest.raises(amanda.ToolError, match="ZeroDivisionError.*Gemm"):
        with amanda.apply(Broken()):
            ort.InferenceSession(mlp_model.SerializeToString())
    assert ort.InferenceSession.__init__ is original_init


def test_python_callback_counts_executions(mlp_model, x24):
    tool = Count()
    with amanda.apply(tool):
        instrumented = ort.InferenceSession(mlp_model.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
    assert tool.calls == {}
    for run in range(3):
        assert same(instrumented.run(None, {"x": x24})[0],
                    session(mlp_model).run(None, {"x": x24})[0])
        assert tool.calls == {"fc": run + 1, "relu": run + 1}


def test_instrument_returns_new_model_with_hosted_callbacks(mlp_model, x24):
    before = mlp_model.SerializeToString()
    tool = Count()
    instrumented = amanda.instrument(mlp_model, tool)
    assert isinstance(instrumented, onnx.ModelProto)
    assert mlp_model.SerializeToString() == before
    onnx.checker.check_model(instrumented, full_check=True)
    assert any(n.domain == onnx_runtime.CALLBACK_DOMAIN for n in instrumented.graph.node)
    result = onnx_runtime.inference_session(instrumented).run(None, {"x": x24})[0]
    assert same(result, session(mlp_model).run(None, {"x": x24})[0])
    assert tool.calls == {"fc": 1, "relu": 1}


def test_replacing_routine_and_routine_errors(mlp_model, x24):
    class Replace(amanda.Tool):
        def __init__(self, fail=False):
            super().__init__()
            self.fail = fail
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "Relu":
                context.replace_op(self.leaky)

        def leaky(self, x):
            if self.fail:
                raise ValueError("bad routine")
            return np.where(x > 0, x, 0.1 * x)

    hidden = np.asarray(x24 @ onnx.numpy_helper.to_array(mlp_model.graph.initializer[0])
                        + onnx.numpy_helper.to_array(mlp_model.graph.initializer[1]))
    with amanda.apply(Replace()):
        replaced = ort.InferenceSession(mlp_model.SerializeToString())
    np.testing.assert_allclose(replaced.run(None, {"x": x24})[0],
                               np.where(hidden > 0, hidden, 0.1 * hidden), rtol=1e-6, atol=1e-6)
    with amanda.apply(Replace(fail=True)):
        failing = ort.InferenceSession(mlp_model.SerializeToString())
    with pytest.raises(amanda.AmandaError, match=r"ValueError: bad routine.*Replace\.leaky.*Relu"):
        failing.run(None, {"x": x24})


def test_export_names_a_routine_that_cannot_leave_python(mlp_model):
    with pytest.raises(amanda.BackendError, match=r"Count\.count.*cannot call back into Python"):
        onnx_runtime.export(mlp_model, Count())


def test_portable_routine_beyond_the_opset_falls_back_or_fails(x24):
    old = mlp(opset=9, ir_version=4)
    with pytest.raises(amanda.BackendError, match="Round needs ONNX opset 11, the model uses 9"):
        onnx_runtime.export(old, FakeQuant("Relu", 0.05, 3))
    with pytest.warns(UserWarning, match="Python callback"):
        hosted = amanda.instrument(old, FakeQuant("Relu", 0.05, 3))
    hidden = session(old).run(None, {"x": x24})[0]
    got = onnx_runtime.inference_session(hosted).run(None, {"x": x24})[0]
    assert same(got, fake_quant_reference(hidden, 0.05, 3, -128, 127))


def test_instrumented_models_are_cached_per_session(mlp_model):
    tool = Count()
    analysed = []
    tool.add_inst_for_op(lambda context: analysed.append(context.get_op_id()))
    data = mlp_model.SerializeToString()
    with amanda.apply(tool):
        ort.InferenceSession(data)
    with amanda.apply(tool):
        ort.InferenceSession(data)
    assert analysed == ["fc", "relu"]


def test_contexts_see_node_protos_and_symbols(mlp_model):
    seen = []

    class Inspect(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            op = context.get_op()
            assert isinstance(op, onnx.NodeProto)
            inputs = context.get_inputs()
            seen.append((context.namespace, op.name, [v.name for v in inputs],
                         [v.name for v in context.get_outputs()],
                         amanda.evaluate(inputs[-1]).shape if op.op_type == "Gemm" else None))

    amanda.instrument(mlp_model, Inspect())
    assert seen == [("onnx/13/graph", "fc", ["x", "W", "B"], ["h"], (3,)),
                    ("onnx/13/graph", "relu", ["h"], ["y"], None)]


def test_evaluate_needs_example_feeds_for_activations(mlp_model, x24):
    values = {}

    class Activation(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            if context.get_op_name() == "Relu":
                values["relu"] = amanda.evaluate(context.get_outputs()[0])

    with pytest.raises(amanda.BackendError, match="depends on graph input.*'x'"):
        amanda.instrument(mlp_model, Activation())
    with onnx_runtime.example_feeds({"x": x24}):
        amanda.instrument(mlp_model, Activation())
    assert same(values["relu"], session(mlp_model).run(None, {"x": x24})[0])


@pytest.mark.slow
@pytest.mark.parametrize("path", light_models(), ids=os.path.basename)
def test_identity_on_every_op_of_light_models_is_exact(path):
    """Python identity routines before and after every op (weights included).

    Bit-identical with onnxruntime's graph optimizations up to EXTENDED on
    both sides. At the default level (ALL) onnxruntime also rewrites layouts
    (NCHWc) across ops, which routines between the ops prevent: DenseNet-121
    then differs in the last bit, so the default level is checked to 1e-6.
    """
    model = onnx.load(path)
    feeds = light_feeds(model)
    tool = IdentityTool(backward=False)
    with amanda.apply(tool):
        instrumented = ort.InferenceSession(model.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
    default = instrumented.run(None, feeds)[0]
    ops = len(model.graph.node)
    assert tool.calls["before_op"] == tool.calls["after_op"] == ops
    np.testing.assert_allclose(default, session(model).run(None, feeds)[0], rtol=1e-6, atol=1e-7)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    exported = amanda.instrument(model, tool)
    options = onnx_runtime.session_options(ort.SessionOptions())
    options.graph_optimization_level = level
    got = onnx_runtime.inference_session(exported, options).run(None, feeds)[0]
    assert same(got, session(model, level).run(None, feeds)[0])


def test_routine_output_reaches_a_subgraph_that_captures_the_tensor():
    """An If branch reads the Relu output from the enclosing graph; doubling
    that output after Relu must change what the branch sees."""
    from tests.onnx.conftest import TensorProto, helper

    then = helper.make_graph([helper.make_node("Neg", ["r"], ["t"], name="neg")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Abs", ["r"], ["e"], name="abs")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [3])])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then,
                          else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8

    class Double(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            if context.get_op_name() == "Relu":
                context.insert_after_op(self.double)

        @portable.routine
        def double(self, r):
            return r * 2.0

    exported = onnx_runtime.export(model, Double())
    onnx.checker.check_model(exported, full_check=True)
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    for condition, sign in ((True, -1), (False, 1)):
        got = session(exported).run(None, {"x": x, "c": np.array(condition)})[0]
        assert same(got, (sign * 2 * np.maximum(x, 0)).astype(np.float32))
