"""PyTorch's variants of the example rule sets (:mod:`amanda.tools.rewrite_rules`),
over graphs captured with ``torch.export`` (aten ops lifted by
:mod:`amanda.frontends.pytorch.graph`). Importing this module does not import torch.
"""

from __future__ import annotations

from amanda.passes.rewrite import Rule, constraint, op
from amanda.passes.rewrite_helpers import (TANH_CUBIC, TANH_SCALE, like, pattern,
                                           requantized_product)
from amanda.runtime.pytorch.tools import call_argument, call_attrs

__all__ = ["fake_quant_matmul_rules", "fold_batchnorm_rules", "gelu_tanh_rules"]


def _aten(graph, target, args, kwargs=None, name=None, like_tensor=None):
    """Creates one captured-PyTorch op: ``args``/``kwargs`` mix IR tensors and
    constants (encoded the way the capture frontend does)."""
    attrs, inputs = call_attrs(target, args, kwargs)
    op_type = target.split(".")[1] if target.startswith("aten.") else target.rsplit(".", 1)[0]
    made = graph.create_op(op_type, inputs, attrs=attrs, name=name or op_type)
    if like_tensor is not None:
        like(made, like_tensor)
    return made.outputs[0]


def _arg(g_op, position, default=None):
    """Argument ``position`` of a captured call: the IR tensor or the constant."""
    return call_argument(g_op, position, default)


# -- conv2d -> batch_norm folded -------------------------------------------------------


def _fold_bn(match):
    graph, conv, bn = match.graph, match["conv"], match["bn"]
    x, w, conv_b = _arg(conv, 0), _arg(conv, 1), _arg(conv, 2)
    gamma, beta, mean, var, eps = _arg(bn, 1), _arg(bn, 2), _arg(bn, 3), _arg(bn, 4), _arg(bn, 7)
    base = bn.name
    inv = _aten(graph, "aten.rsqrt.default",
                [_aten(graph, "aten.add.Scalar", [var, eps], name=base + "_var_eps")],
                name=base + "_inv_std")
    scale = inv if gamma is None else _aten(graph, "aten.mul.Tensor", [gamma, inv],
                                            name=base + "_scale")
    weight = _aten(graph, "aten.mul.Tensor",
                   [w, _aten(graph, "aten.reshape.default", [scale, [-1, 1, 1, 1]],
                             name=base + "_scale4d")],
                   name=base + "_folded_weight", like_tensor=w)
    centred = (_aten(graph, "aten.neg.default", [mean], name=base + "_neg_mean") if conv_b is None
               else _aten(graph, "aten.sub.Tensor", [conv_b, mean], name=base + "_centred"))
    bias = _aten(graph, "aten.mul.Tensor", [centred, scale], name=base + "_folded_bias")
    if beta is not None:
        bias = _aten(graph, "aten.add.Tensor", [bias, beta], name=base + "_folded_shift")
    rest = list(conv.attrs["args"][3:])
    return [_aten(graph, "aten.conv2d.default", [x, weight, bias] + rest, name=conv.name + "_folded",
                  like_tensor=bn.outputs[0])]


def _conv_bn(x, w, gamma, beta, mean, var):
    return op.batch_norm(op.conv2d(x, w, name="conv", extra_inputs=True), gamma, beta, mean, var,
                         name="bn")


@constraint("batch_norm runs in inference mode (training=False)")
def _bn_inference(g_op, match):
    return _arg(g_op, 5) is False


@constraint("conv2d has no bias, or the bias is its third input")
def _conv_plain(g_op, match):
    return len(g_op.inputs) == 2 or (len(g_op.inputs) == 3 and _arg(g_op, 2) is g_op.inputs[2])


def fold_batchnorm_rules():
    """``conv2d -> batch_norm`` with ``training=False``."""
    p = pattern(_conv_bn, constraints={"bn": _bn_inference, "conv": _conv_plain},
                name="fold_batchnorm")
    return [Rule(p, _fold_bn)]


# -- exact gelu -> tanh approximation ------------------------------------------------


@constraint("gelu is exact (approximate='none')")
def _exact_gelu(g_op, match):
    approximate = g_op.attrs.get("kwargs", {}).get("approximate", _arg(g_op, 1, "none"))
    return approximate == "none"


def _gelu_tanh(match):
    graph, gelu = match.graph, match["gelu"]
    x, base = match["x"], gelu.name
    cube = _aten(graph, "aten.pow.Tensor_Scalar", [x, 3], name=base + "_cube")
    inner = _aten(graph, "aten.add.Tensor",
                  [x, _aten(graph, "aten.mul.Scalar", [cube, TANH_CUBIC], name=base + "_c")],
                  name=base + "_inner")
    tanh = _aten(graph, "aten.tanh.default",
                 [_aten(graph, "aten.mul.Scalar", [inner, TANH_SCALE], name=base + "_scaled")],
                 name=base + "_tanh")
    half = _aten(graph, "aten.mul.Scalar",
                 [_aten(graph, "aten.add.Scalar", [tanh, 1.0], name=base + "_one_plus"), 0.5],
                 name=base + "_half")
    return [_aten(graph, "aten.mul.Tensor", [x, half], name=base + "_tanh_approx",
                  like_tensor=gelu.outputs[0])]


def gelu_tanh_rules():
    """``gelu`` with ``approximate='none'``, replaced by ``pow``/``tanh``/``mul``/``add``."""
    p = pattern(lambda x: op.gelu(x, name="gelu", extra_inputs=True),
                constraints={"gelu": _exact_gelu}, name="gelu_tanh")
    return [Rule(p, _gelu_tanh)]


# -- fake quantization around matrix products -----------------------------------------

_FAKE_QUANT = "aten.fake_quantize_per_tensor_affine.default"


@constraint("input is not fake-quantized yet")
def _not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.attrs.get("target") != _FAKE_QUANT


def fake_quant_matmul_rules(scale, zero_point, quant_min, quant_max):
    """``matmul`` and ``linear`` read ``fake_quantize_per_tensor_affine``."""
    def fake_quantize(match):
        return requantized_product(match, lambda t, i: _aten(
            match.graph, _FAKE_QUANT, [t, scale, zero_point, quant_min, quant_max],
            name=f"{match['product'].name}_fq{i}", like_tensor=t))

    p = pattern(lambda a, b: op("matmul|linear", a, b, name="product", extra_inputs=True),
                constraints={"a": _not_fake_quantized, "b": _not_fake_quantized},
                name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]
