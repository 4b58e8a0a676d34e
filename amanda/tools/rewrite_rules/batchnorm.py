"""Folding an inference batch norm into the convolution before it
(:func:`fold_batchnorm_rules`), per backend.
"""

from __future__ import annotations

from amanda.passes.rewrite import RewriteError, Rule, constraint, op
from amanda.tools.rewrite_rules._common import (
    _arg,
    _aten,
    _like,
    _onnx_attrs_of_new_op,
    _onnx_constant,
    _per_channel,
    pattern,
)


# ---------------------------------------------------------------------------
# PyTorch graph capture (aten ops lifted by amanda.frontends.pytorch.graph)
# ---------------------------------------------------------------------------


def _torch_fold_bn(match):
    graph, conv, bn = match.graph, match["conv"], match["bn"]
    x, w, conv_b = _arg(conv, 0), _arg(conv, 1), _arg(conv, 2)
    gamma, beta, mean, var, eps = _arg(bn, 1), _arg(bn, 2), _arg(bn, 3), _arg(bn, 4), _arg(bn, 7)
    base = bn.name
    inv = _aten(graph, "aten.rsqrt.default", [_aten(graph, "aten.add.Scalar", [var, eps], name=base + "_var_eps")],
                name=base + "_inv_std")
    scale = inv if gamma is None else _aten(graph, "aten.mul.Tensor", [gamma, inv], name=base + "_scale")
    weight = _aten(graph, "aten.mul.Tensor",
                   [w, _aten(graph, "aten.reshape.default", [scale, [-1, 1, 1, 1]], name=base + "_scale4d")],
                   name=base + "_folded_weight", like=w)
    centred = (_aten(graph, "aten.neg.default", [mean], name=base + "_neg_mean") if conv_b is None
               else _aten(graph, "aten.sub.Tensor", [conv_b, mean], name=base + "_centred"))
    bias = _aten(graph, "aten.mul.Tensor", [centred, scale], name=base + "_folded_bias")
    if beta is not None:
        bias = _aten(graph, "aten.add.Tensor", [bias, beta], name=base + "_folded_shift")
    rest = list(conv.attrs["args"][3:])
    return [_aten(graph, "aten.conv2d.default", [x, weight, bias] + rest, name=conv.name + "_folded",
                  like=bn.outputs[0])]


def _torch_conv_bn(x, w, gamma, beta, mean, var):
    return op.batch_norm(op.conv2d(x, w, name="conv", extra_inputs=True), gamma, beta, mean, var, name="bn")


@constraint("batch_norm runs in inference mode (training=False)")
def _torch_bn_inference(g_op, match):
    return _arg(g_op, 5) is False


@constraint("conv2d has no bias, or the bias is its third input")
def _torch_conv_plain(g_op, match):
    return len(g_op.inputs) == 2 or (len(g_op.inputs) == 3 and _arg(g_op, 2) is g_op.inputs[2])


# ---------------------------------------------------------------------------
# TensorFlow (Keras 3 batch normalization: x * scale + shift, scale and shift per channel)
# ---------------------------------------------------------------------------


def _tf_conv_scale_shift(with_bias):
    def conv_bn(x, w, b, scale, shift):
        y = op.Conv2D(x, w, name="conv")
        if with_bias:
            y = op.BiasAdd(y, b, name="bias")
        return op("AddV2|Add", op.Mul(y, scale, name="mul"), shift, name="bn")

    def conv_bn_nobias(x, w, scale, shift):
        return op("AddV2|Add", op.Mul(op.Conv2D(x, w, name="conv"), scale, name="mul"), shift, name="bn")

    return conv_bn if with_bias else conv_bn_nobias


def _tf_channels(match):
    shape = match["conv"].outputs[0].attrs.get("shape")
    return shape[-1] if shape and match["conv"].attrs.get("data_format", "NHWC") == "NHWC" else None


@constraint("the scale is per output channel of the conv ([C] or [1, 1, 1, C])")
def _tf_scale_per_channel(tensor, match):
    return _per_channel(tensor, _tf_channels(match)) and tensor.attrs.get("shape")[-1] == _tf_channels(match)


@constraint("the shift is per output channel of the conv ([C] or [1, 1, 1, C])")
def _tf_shift_per_channel(tensor, match):
    return _per_channel(tensor, _tf_channels(match)) and tensor.attrs.get("shape")[-1] == _tf_channels(match)


def _tf_fold_bn(match):
    graph, conv, bn = match.graph, match["conv"], match["bn"]
    x, w, scale, shift = match["x"], match["w"], match["scale"], match["shift"]
    dtype = {"T": conv.attrs.get("T", "float32")}

    def tf_op(op_type, inputs, suffix, like=None):
        made = graph.create_op(op_type, inputs, attrs=dict(dtype), name=f"{bn.name}/folded/{suffix}")
        return (_like(made, like) if like is not None else made).outputs[0]

    weight = tf_op("Mul", [w, scale], "weight", like=w)
    folded = graph.create_op("Conv2D", [x, weight], attrs=dict(conv.attrs), name=f"{bn.name}/folded/conv")
    _like(folded, conv.outputs[0])
    try:
        b = match["b"]
        shift = tf_op("AddV2", [tf_op("Mul", [b, scale], "bias_scaled"), shift], "bias", like=shift)
    except KeyError:
        pass
    return [tf_op("AddV2", [folded.outputs[0], shift], "output", like=bn.outputs[0])]


# ---------------------------------------------------------------------------
# ONNX (Conv -> BatchNormalization in inference form)
# ---------------------------------------------------------------------------


def _onnx_conv_bn(x, w, scale, beta, mean, var):
    return op.BatchNormalization(op.Conv(x, w, name="conv", extra_inputs=True), scale, beta, mean, var, name="bn")


@constraint("BatchNormalization has one output (inference form)")
def _onnx_bn_inference(g_op, match):
    return len(g_op.outputs) == 1 and not g_op.attrs.get("training_mode")


def _onnx_fold_bn(match):
    graph, conv, bn = match.graph, match["conv"], match["bn"]
    x, w, gamma, beta, mean, var = (match[n] for n in ("x", "w", "scale", "beta", "mean", "var"))
    eps = float(bn.attrs.get("epsilon", 1e-5))
    base = bn.name

    def onnx_op(op_type, inputs, suffix, attrs=None):
        return graph.create_op(op_type, inputs, attrs=dict(attrs or {}), name=f"{base}/folded/{suffix}").outputs[0]

    eps_t = _onnx_constant(graph, f"{base}/folded/eps", value_float=eps)
    scale = onnx_op("Mul", [gamma, onnx_op("Reciprocal", [onnx_op("Sqrt", [onnx_op("Add", [var, eps_t], "var_eps")],
                                                                      "std")], "inv_std")], "scale")
    axes = _onnx_constant(graph, f"{base}/folded/axes", value_ints=[1, 2, 3])
    weight = onnx_op("Mul", [w, onnx_op("Unsqueeze", [scale, axes], "scale4d")], "weight")
    centred = (onnx_op("Sub", [conv.inputs[2], mean], "centred") if len(conv.inputs) > 2
               else onnx_op("Neg", [mean], "neg_mean"))
    bias = onnx_op("Add", [onnx_op("Mul", [centred, scale], "bias_scaled"), beta], "bias")
    folded = graph.create_op("Conv", [x, weight, bias], attrs=_onnx_attrs_of_new_op(conv.attrs),
                             name=f"{base}/folded/conv")
    _like(folded, bn.outputs[0])
    return [folded.outputs[0]]


def fold_batchnorm_rules(backend):
    """Rules folding an inference batch norm into the convolution before it.

    ``conv(x, W) -> bn`` becomes ``conv(x, W * s) + (b - mean) * s + beta`` with
    ``s = gamma / sqrt(var + eps)`` per output channel. The new weight and bias
    are computed by ops in the graph from the model's own weights (backends fold
    those constant subgraphs when they compile the graph), so the rewritten graph
    still reads the model's variables and parameters.

    Args:
        backend: ``"pytorch"`` (graph capture: ``conv2d -> batch_norm`` with
            ``training=False``), ``"tensorflow"`` (Keras 3 batch norm lowered as
            ``Conv2D [-> BiasAdd] -> Mul(scale) -> AddV2(shift)`` with per-channel
            scale and shift) or ``"onnx"`` (``Conv -> BatchNormalization``).

    Returns:
        A list of `Rule`.
    """
    if backend == "pytorch":
        p = pattern(_torch_conv_bn, constraints={"bn": _torch_bn_inference, "conv": _torch_conv_plain},
                    name="fold_batchnorm")
        return [Rule(p, _torch_fold_bn)]
    if backend == "tensorflow":
        constraints = {"scale": _tf_scale_per_channel, "shift": _tf_shift_per_channel}
        rules = []
        for with_bias in (True, False):
            p = pattern(_tf_conv_scale_shift(with_bias), constraints=constraints, commutative=("Mul", "AddV2", "Add"),
                        name="fold_batchnorm" + ("" if with_bias else "_nobias"))
            rules.append(Rule(p, _tf_fold_bn))
        return rules
    if backend == "onnx":
        p = pattern(_onnx_conv_bn, constraints={"bn": _onnx_bn_inference}, name="fold_batchnorm")
        return [Rule(p, _onnx_fold_bn)]
    raise RewriteError(f"fold_batchnorm_rules: no rules for backend {backend!r} (pytorch, tensorflow, onnx)")
