"""A fake-quant pair around every matrix product
(:func:`fake_quant_matmul_rules`), per backend.
"""

from __future__ import annotations

from amanda.passes.rewrite import RewriteError, Rule, constraint, op
from amanda.tools.rewrite_rules._common import (
    _aten,
    _like,
    _onnx_attrs_of_new_op,
    _onnx_constant,
    pattern,
)


_FAKE_QUANT = "aten.fake_quantize_per_tensor_affine.default"


@constraint("input is not fake-quantized yet")
def _not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.attrs.get("target") != _FAKE_QUANT


@constraint("operand is not fake-quantized yet")
def _tf_not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.type != "FakeQuantWithMinMaxArgs"


@constraint("operand is not fake-quantized yet (not read from DequantizeLinear)")
def _onnx_not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.type != "DequantizeLinear"


@constraint("operand is float32")
def _operand_float32(tensor, match):
    return tensor.attrs.get("dtype") == "float32"


def _requantized_product(match, quantize):
    """A copy of ``match["product"]`` reading ``quantize(operand, i)`` of its first two inputs."""
    graph, product = match.graph, match["product"]
    quantized = [quantize(t, i) for i, t in enumerate(product.inputs[:2])]
    attrs = _onnx_attrs_of_new_op(product.attrs)   # a plain copy on other backends
    made = graph.create_op(product.type, quantized + list(product.inputs[2:]), attrs=attrs,
                           name=product.name + "_quantized")
    return [_like(made, product.outputs[0]).outputs[0]]


def _fake_quant_pytorch(scale, zero_point, quant_min, quant_max):
    def fake_quantize(match):
        return _requantized_product(match, lambda t, i: _aten(
            match.graph, _FAKE_QUANT, [t, scale, zero_point, quant_min, quant_max],
            name=f"{match['product'].name}_fq{i}", like=t))

    p = pattern(lambda a, b: op("matmul|linear", a, b, name="product", extra_inputs=True),
                constraints={"a": _not_fake_quantized, "b": _not_fake_quantized}, name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]


_TF_PRODUCTS = "MatMul|BatchMatMul|BatchMatMulV2|BatchMatMulV3|Einsum"


def _fake_quant_tensorflow(scale, zero_point, quant_min, quant_max):
    levels = quant_max - quant_min + 1
    num_bits = levels.bit_length() - 1
    if levels != 1 << num_bits or not 2 <= num_bits <= 16:
        raise RewriteError(f"fake_quant_matmul_rules('tensorflow'): quant_max - quant_min + 1 = {levels} is not "
                           "a power of two between 4 and 65536 (FakeQuantWithMinMaxArgs has num_bits)")
    attrs = {"min": float((quant_min - zero_point) * scale), "max": float((quant_max - zero_point) * scale),
             "num_bits": num_bits, "narrow_range": False}

    def fake_quantize(match):
        def quantize(t, i):
            made = match.graph.create_op("FakeQuantWithMinMaxArgs", [t], attrs=dict(attrs),
                                         name=f"{match['product'].name}/fake_quant_{i}")
            return _like(made, t).outputs[0]

        return _requantized_product(match, quantize)

    p = pattern(lambda a, b: op(_TF_PRODUCTS, a, b, name="product"),
                constraints={"a": [_tf_not_fake_quantized, _operand_float32],
                             "b": [_tf_not_fake_quantized, _operand_float32]}, name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]


_QDQ_TYPES = {(-128, 127): ("int8", 3), (0, 255): ("uint8", 2)}  # dtype, TensorProto elem type


def _fake_quant_onnx(scale, zero_point, quant_min, quant_max):
    if (quant_min, quant_max) not in _QDQ_TYPES:
        raise RewriteError(f"fake_quant_matmul_rules('onnx'): range [{quant_min}, {quant_max}] is neither int8 "
                           "[-128, 127] nor uint8 [0, 255] (QuantizeLinear/DequantizeLinear)")
    dtype, elem_type = _QDQ_TYPES[(quant_min, quant_max)]

    def fake_quantize(match):
        graph, base = match.graph, match["product"].name + "/fake_quant"
        scale_t = _onnx_constant(graph, f"{base}/scale", value_float=scale)
        zero = graph.create_op("Constant", [], attrs={"value_int": int(zero_point)}, name=f"{base}/zero_point_i64")
        zero.outputs[0].attrs = {"dtype": "int64", "shape": []}
        zero = graph.create_op("Cast", zero.outputs, attrs={"to": elem_type}, name=f"{base}/zero_point")
        zero.outputs[0].attrs = {"dtype": dtype, "shape": []}

        def quantize(t, i):
            q = graph.create_op("QuantizeLinear", [t, scale_t, zero.outputs[0]], name=f"{base}/quantize_{i}")
            q.outputs[0].attrs = {"dtype": dtype, "shape": t.attrs.get("shape")}
            dq = graph.create_op("DequantizeLinear", [q.outputs[0], scale_t, zero.outputs[0]],
                                 name=f"{base}/dequantize_{i}")
            return _like(dq, t).outputs[0]

        return _requantized_product(match, quantize)

    operand = [_onnx_not_fake_quantized, _operand_float32]
    p = pattern(lambda a, b: op("MatMul|Gemm", a, b, name="product", extra_inputs=True),
                constraints={"a": operand, "b": operand}, name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]


_FAKE_QUANT_RULES = {"pytorch": _fake_quant_pytorch, "tensorflow": _fake_quant_tensorflow, "onnx": _fake_quant_onnx}


def fake_quant_matmul_rules(backend="pytorch", scale=1 / 64, zero_point=0, quant_min=-128, quant_max=127):
    """Rules inserting a fake-quant pair (one per operand) around every matrix product.

    Each operand of a product is quantized to ``clip(round(x / scale) +
    zero_point, quant_min, quant_max)`` and back. The constraint that an
    operand is not fake-quantized yet is what makes the driver converge (a
    rewritten product does not match again). All rules are named
    ``"fake_quant_matmul"``.

    Args:
        backend: ``"pytorch"`` (graph capture: ``matmul`` and ``linear`` read
            ``fake_quantize_per_tensor_affine``); ``"tensorflow"`` (``MatMul``,
            ``BatchMatMul[V2|V3]`` and two-operand ``Einsum`` on float32 read
            ``FakeQuantWithMinMaxArgs`` with ``min = (quant_min - zero_point)
            * scale``, ``max = (quant_max - zero_point) * scale``; TensorFlow
            rounds half up and nudges the range so that zero is exact, which
            changes nothing when ``scale`` is a power of two); ``"onnx"``
            (the first two inputs of ``MatMul`` and ``Gemm`` on float32 go
            through ``QuantizeLinear`` -> ``DequantizeLinear``, int8 or uint8
            by the range; ONNX rounds half to even).
        scale, zero_point, quant_min, quant_max: the fake-quant parameters.

    Returns:
        A list of `Rule`.
    """
    if backend not in _FAKE_QUANT_RULES:
        raise RewriteError(f"fake_quant_matmul_rules: no rules for backend {backend!r} "
                           f"({', '.join(_FAKE_QUANT_RULES)})")
    return _FAKE_QUANT_RULES[backend](scale, zero_point, quant_min, quant_max)
