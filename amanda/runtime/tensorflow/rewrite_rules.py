"""TensorFlow's variants of the example rule sets (:mod:`amanda.tools.rewrite_rules`),
over lifted GraphDefs. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from amanda.passes.rewrite import RewriteError, Rule, constraint, op
from amanda.passes.rewrite_helpers import (gelu_erf_patterns, like, operand_float32, pattern,
                                           per_channel, requantized_product, tanh_gelu_ops)

__all__ = ["fake_quant_matmul_rules", "fold_batchnorm_rules", "gelu_tanh_rules"]


# -- Keras 3 batch normalization (x * scale + shift, per channel) folded into Conv2D ----


def _conv_scale_shift(with_bias):
    def conv_bn(x, w, b, scale, shift):
        y = op.Conv2D(x, w, name="conv")
        if with_bias:
            y = op.BiasAdd(y, b, name="bias")
        return op("AddV2|Add", op.Mul(y, scale, name="mul"), shift, name="bn")

    def conv_bn_nobias(x, w, scale, shift):
        return op("AddV2|Add", op.Mul(op.Conv2D(x, w, name="conv"), scale, name="mul"), shift,
                  name="bn")

    return conv_bn if with_bias else conv_bn_nobias


def _channels(match):
    shape = match["conv"].outputs[0].attrs.get("shape")
    return shape[-1] if shape and match["conv"].attrs.get("data_format", "NHWC") == "NHWC" else None


@constraint("the scale is per output channel of the conv ([C] or [1, 1, 1, C])")
def _scale_per_channel(tensor, match):
    return per_channel(tensor, _channels(match)) and tensor.attrs.get("shape")[-1] == _channels(match)


@constraint("the shift is per output channel of the conv ([C] or [1, 1, 1, C])")
def _shift_per_channel(tensor, match):
    return per_channel(tensor, _channels(match)) and tensor.attrs.get("shape")[-1] == _channels(match)


def _fold_bn(match):
    graph, conv, bn = match.graph, match["conv"], match["bn"]
    x, w, scale, shift = match["x"], match["w"], match["scale"], match["shift"]
    dtype = {"T": conv.attrs.get("T", "float32")}

    def tf_op(op_type, inputs, suffix, like_tensor=None):
        made = graph.create_op(op_type, inputs, attrs=dict(dtype), name=f"{bn.name}/folded/{suffix}")
        return (like(made, like_tensor) if like_tensor is not None else made).outputs[0]

    weight = tf_op("Mul", [w, scale], "weight", like_tensor=w)
    folded = graph.create_op("Conv2D", [x, weight], attrs=dict(conv.attrs),
                             name=f"{bn.name}/folded/conv")
    like(folded, conv.outputs[0])
    try:
        b = match["b"]
        shift = tf_op("AddV2", [tf_op("Mul", [b, scale], "bias_scaled"), shift], "bias",
                      like_tensor=shift)
    except KeyError:
        pass
    return [tf_op("AddV2", [folded.outputs[0], shift], "output", like_tensor=bn.outputs[0])]


def fold_batchnorm_rules():
    """``Conv2D [-> BiasAdd] -> Mul(scale) -> AddV2(shift)`` with per-channel
    scale and shift (Keras 3 batch norm lowered)."""
    constraints = {"scale": _scale_per_channel, "shift": _shift_per_channel}
    rules = []
    for with_bias in (True, False):
        p = pattern(_conv_scale_shift(with_bias), constraints=constraints,
                    commutative=("Mul", "AddV2", "Add"),
                    name="fold_batchnorm" + ("" if with_bias else "_nobias"))
        rules.append(Rule(p, _fold_bn))
    return rules


# -- exact gelu -> tanh approximation ------------------------------------------------


def _gelu_tanh(match):
    graph, gelu, x = match.graph, match["gelu"], match["x"]
    dtype = gelu.attrs.get("T", "float32")
    base = f"{gelu.name}/tanh_approx"

    def const(value, suffix):
        made = graph.create_op("Const", [], attrs={"dtype": dtype, "value": {
            "dtype": dtype, "shape": [], "value": value}}, name=f"{base}/{suffix}")
        made.outputs[0].attrs = {"dtype": dtype, "shape": []}
        return made.outputs[0]

    def binary(kind, a, b, suffix):
        made = graph.create_op({"mul": "Mul", "add": "AddV2"}[kind], [a, b], attrs={"T": dtype},
                               name=f"{base}/{suffix}")
        return like(made, x).outputs[0]

    def tanh(t, suffix):
        return like(graph.create_op("Tanh", [t], attrs={"T": dtype}, name=f"{base}/{suffix}"),
                    x).outputs[0]

    return [tanh_gelu_ops(x, const, binary, tanh)]


def gelu_tanh_rules():
    """``0.5 * x * erfc(-x / sqrt 2)`` (``tf.nn.gelu``, Keras ``gelu`` in TF
    2.21) and ``0.5 * x * (1 + erf(x / sqrt 2))``, in every association
    order, replaced by ``Mul``/``AddV2``/``Tanh`` in the gelu's dtype."""
    patterns = (gelu_erf_patterns("RealDiv|Mul", "AddV2|Add", with_one=False)
                + gelu_erf_patterns("RealDiv|Mul", "AddV2|Add", with_one=True))
    return [Rule(p, _gelu_tanh, name="gelu_tanh", prune=("Const",)) for p in patterns]


# -- fake quantization around matrix products -----------------------------------------

_PRODUCTS = "MatMul|BatchMatMul|BatchMatMulV2|BatchMatMulV3|Einsum"


@constraint("operand is not fake-quantized yet")
def _not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.type != "FakeQuantWithMinMaxArgs"


def fake_quant_matmul_rules(scale, zero_point, quant_min, quant_max):
    """Products on float32 read ``FakeQuantWithMinMaxArgs``.

    Raises:
        RewriteError: the range is not a power of two of 4 to 65536 levels.
    """
    levels = quant_max - quant_min + 1
    num_bits = levels.bit_length() - 1
    if levels != 1 << num_bits or not 2 <= num_bits <= 16:
        raise RewriteError(f"fake_quant_matmul_rules('tensorflow'): quant_max - quant_min + 1 = "
                           f"{levels} is not a power of two between 4 and 65536 "
                           "(FakeQuantWithMinMaxArgs has num_bits)")
    attrs = {"min": float((quant_min - zero_point) * scale),
             "max": float((quant_max - zero_point) * scale),
             "num_bits": num_bits, "narrow_range": False}

    def fake_quantize(match):
        def quantize(t, i):
            made = match.graph.create_op("FakeQuantWithMinMaxArgs", [t], attrs=dict(attrs),
                                         name=f"{match['product'].name}/fake_quant_{i}")
            return like(made, t).outputs[0]

        return requantized_product(match, quantize)

    p = pattern(lambda a, b: op(_PRODUCTS, a, b, name="product"),
                constraints={"a": [_not_fake_quantized, operand_float32],
                             "b": [_not_fake_quantized, operand_float32]},
                name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]
