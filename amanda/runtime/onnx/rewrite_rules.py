"""ONNX's variants of the example rule sets (:mod:`amanda.tools.rewrite_rules`),
over lifted models. Importing this module imports neither onnx nor onnxruntime.
"""

from __future__ import annotations

from amanda.passes.rewrite import RewriteError, Rule, constraint, op
from amanda.passes.rewrite_helpers import (float32, gelu_erf_patterns, like, operand_float32,
                                           pattern, requantized_product, tanh_gelu_ops)
from amanda.runtime.onnx.tools import attrs_for_new_op

__all__ = ["fake_quant_matmul_rules", "fold_batchnorm_rules", "gelu_tanh_rules"]


def _constant(graph, name, value_float=None, value_ints=None):
    """A ``Constant`` holding a float32 scalar or an int64 vector."""
    if value_ints is not None:
        made = graph.create_op("Constant", [], attrs={"value_ints": list(value_ints)}, name=name)
        made.outputs[0].attrs = {"dtype": "int64", "shape": [len(value_ints)]}
    else:
        made = graph.create_op("Constant", [], attrs={"value_float": float(value_float)}, name=name)
        made.outputs[0].attrs = {"dtype": "float32", "shape": []}
    return made.outputs[0]


# -- Conv -> BatchNormalization (inference form) folded ----------------------------------


def _conv_bn(x, w, scale, beta, mean, var):
    return op.BatchNormalization(op.Conv(x, w, name="conv", extra_inputs=True), scale, beta, mean,
                                 var, name="bn")


@constraint("BatchNormalization has one output (inference form)")
def _bn_inference(g_op, match):
    return len(g_op.outputs) == 1 and not g_op.attrs.get("training_mode")


def _fold_bn(match):
    graph, conv, bn = match.graph, match["conv"], match["bn"]
    x, w, gamma, beta, mean, var = (match[n] for n in ("x", "w", "scale", "beta", "mean", "var"))
    eps = float(bn.attrs.get("epsilon", 1e-5))
    base = bn.name

    def onnx_op(op_type, inputs, suffix, attrs=None):
        return graph.create_op(op_type, inputs, attrs=dict(attrs or {}),
                               name=f"{base}/folded/{suffix}").outputs[0]

    eps_t = _constant(graph, f"{base}/folded/eps", value_float=eps)
    scale = onnx_op("Mul", [gamma, onnx_op("Reciprocal", [onnx_op(
        "Sqrt", [onnx_op("Add", [var, eps_t], "var_eps")], "std")], "inv_std")], "scale")
    axes = _constant(graph, f"{base}/folded/axes", value_ints=[1, 2, 3])
    weight = onnx_op("Mul", [w, onnx_op("Unsqueeze", [scale, axes], "scale4d")], "weight")
    centred = (onnx_op("Sub", [conv.inputs[2], mean], "centred") if len(conv.inputs) > 2
               else onnx_op("Neg", [mean], "neg_mean"))
    bias = onnx_op("Add", [onnx_op("Mul", [centred, scale], "bias_scaled"), beta], "bias")
    folded = graph.create_op("Conv", [x, weight, bias], attrs=attrs_for_new_op(conv.attrs),
                             name=f"{base}/folded/conv")
    like(folded, bn.outputs[0])
    return [folded.outputs[0]]


def fold_batchnorm_rules():
    """``Conv -> BatchNormalization``."""
    p = pattern(_conv_bn, constraints={"bn": _bn_inference}, name="fold_batchnorm")
    return [Rule(p, _fold_bn)]


# -- exact gelu -> tanh approximation ------------------------------------------------


def _gelu_tanh(match):
    graph, gelu, x = match.graph, match["gelu"], match["x"]
    base = f"{gelu.name}/tanh_approx"

    def const(value, suffix):
        return _constant(graph, f"{base}/{suffix}", value_float=value)

    def binary(kind, a, b, suffix):
        made = graph.create_op({"mul": "Mul", "add": "Add"}[kind], [a, b], name=f"{base}/{suffix}")
        return like(made, x).outputs[0]

    def tanh(t, suffix):
        return like(graph.create_op("Tanh", [t], name=f"{base}/{suffix}"), x).outputs[0]

    return [tanh_gelu_ops(x, const, binary, tanh)]


def _gelu_op_tanh(match):
    """``Gelu(approximate='none')`` (opset 20) becomes ``Gelu(approximate='tanh')``."""
    gelu = match["gelu"]
    attrs = attrs_for_new_op(gelu.attrs)
    attrs["approximate"] = "tanh"
    made = match.graph.create_op("Gelu", [match["x"]], attrs=attrs, name=f"{gelu.name}/tanh_approx")
    return [like(made, gelu.outputs[0]).outputs[0]]


@constraint("Gelu is exact (approximate='none')")
def _exact_gelu(g_op, match):
    return g_op.attrs.get("approximate", "none") == "none"


def gelu_tanh_rules():
    """``Gelu(approximate='none')`` becomes ``Gelu(approximate='tanh')``; the
    ``Div``/``Erf``/``Add``/``Mul``/``Mul`` subgraph torch.onnx writes below
    opset 20 becomes ``Mul``/``Add``/``Tanh`` on float32."""
    gelu_op = pattern(lambda x: op.Gelu(x, name="gelu"), constraints={"gelu": _exact_gelu},
                      name="gelu_op")
    patterns = gelu_erf_patterns("Div|Mul", "Add", with_one=True, extra_constraints={"x": float32})
    return [Rule(gelu_op, _gelu_op_tanh, name="gelu_tanh")] + [
        Rule(p, _gelu_tanh, name="gelu_tanh", prune=("Constant",)) for p in patterns]


# -- fake quantization around matrix products -----------------------------------------

_QDQ_TYPES = {(-128, 127): ("int8", 3), (0, 255): ("uint8", 2)}  # dtype, TensorProto elem type


@constraint("operand is not fake-quantized yet (not read from DequantizeLinear)")
def _not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.type != "DequantizeLinear"


def fake_quant_matmul_rules(scale, zero_point, quant_min, quant_max):
    """The first two inputs of ``MatMul`` and ``Gemm`` on float32 go through
    ``QuantizeLinear`` -> ``DequantizeLinear``, int8 or uint8 by the range.

    Raises:
        RewriteError: the range is neither int8 nor uint8.
    """
    if (quant_min, quant_max) not in _QDQ_TYPES:
        raise RewriteError(f"fake_quant_matmul_rules('onnx'): range [{quant_min}, {quant_max}] is "
                           "neither int8 [-128, 127] nor uint8 [0, 255] "
                           "(QuantizeLinear/DequantizeLinear)")
    dtype, elem_type = _QDQ_TYPES[(quant_min, quant_max)]

    def fake_quantize(match):
        graph, base = match.graph, match["product"].name + "/fake_quant"
        scale_t = _constant(graph, f"{base}/scale", value_float=scale)
        zero = graph.create_op("Constant", [], attrs={"value_int": int(zero_point)},
                               name=f"{base}/zero_point_i64")
        zero.outputs[0].attrs = {"dtype": "int64", "shape": []}
        zero = graph.create_op("Cast", zero.outputs, attrs={"to": elem_type}, name=f"{base}/zero_point")
        zero.outputs[0].attrs = {"dtype": dtype, "shape": []}

        def quantize(t, i):
            q = graph.create_op("QuantizeLinear", [t, scale_t, zero.outputs[0]],
                                name=f"{base}/quantize_{i}")
            q.outputs[0].attrs = {"dtype": dtype, "shape": t.attrs.get("shape")}
            dq = graph.create_op("DequantizeLinear", [q.outputs[0], scale_t, zero.outputs[0]],
                                 name=f"{base}/dequantize_{i}")
            return like(dq, t).outputs[0]

        return requantized_product(match, quantize, attrs_for_new_op)

    operand = [_not_fake_quantized, operand_float32]
    p = pattern(lambda a, b: op("MatMul|Gemm", a, b, name="product", extra_inputs=True),
                constraints={"a": operand, "b": operand}, name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]
