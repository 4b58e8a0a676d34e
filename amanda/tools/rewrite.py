"""Subgraph rewriting: patterns, rules, a bounded driver, a match explainer, example rules.

    from amanda.tools import rewrite
    from amanda.tools.rewrite import op

    def relu_of_add(a, b):
        return op.Relu(op("Add|AddV2", a, b, name="add"))

    pattern = rewrite.pattern(relu_of_add, commutative=["Add", "AddV2"])
    rule = rewrite.Rule(pattern, lambda m: [m.graph.create_op("AddRelu", m.inputs).outputs[0]])
    result = rewrite.rewrite(ir_graph, [rule])          # a RewriteResult; ir_graph untouched
    print(rewrite.explain(pattern, ir_graph, at="relu_3"))

Patterns are small IR graphs (`Pattern`), written directly or as plain Python
functions over symbolic ops (`pattern`, ``op``), with constraints: predicates on
the matched ops and on the tensors bound to wildcards. Matching, the order in
which non-overlapping matches are applied and the iteration bound are described
in `amanda.passes.rewrite`.

Rewriting works on any IR graph; to run the result, lower it back:

* PyTorch graph capture: ``program.rewrite(rules)`` on a
  `amanda.runtime.pytorch_graph.CapturedProgram`;
* TensorFlow: ``lower_to_graph_def(rewritten, base=tf_graph)``
  (`amanda.runtime.tensorflow_graphdef`);
* ONNX: ``amanda.runtime.onnx.lower(rewritten)``.

Example rules (per backend, since op vocabularies differ):
`fold_batchnorm_rules`, `gelu_tanh_rules`, `fake_quant_matmul_rules`.
"""

from __future__ import annotations

import math

from amanda.passes.rewrite import (ANY, Explanation, Match, Pattern, RewriteError, RewriteResult, Rule,
                                   apply_rules, constraint, explain, find_matches, inline_graph, op)

__all__ = [
    "ANY", "Explanation", "Match", "Pattern", "RewriteError", "RewriteResult", "Rule", "constraint",
    "explain", "fake_quant_matmul_rules", "find_matches", "fold_batchnorm_rules", "gelu_tanh_rules",
    "inline_graph", "op", "pattern", "rewrite",
]


def pattern(fn, constraints=None, commutative=(), name=None, namespace=""):
    """Builds a `Pattern` from a plain Python function over ``op`` (see `Pattern.trace`)."""
    return Pattern.trace(fn, constraints=constraints, commutative=commutative, name=name, namespace=namespace)


def rewrite(graph, rules, max_iterations=10, in_place=False):
    """Applies ``rules`` to an IR graph until nothing matches or ``max_iterations``.

    Args:
        graph: an `amanda.ir.Graph`.
        rules: a `Rule` or a list of them (tried in order at each op).
        max_iterations: the bound on full passes over the graph.
        in_place: rewrite ``graph`` itself rather than a copy.

    Returns:
        A `RewriteResult`: ``graph``, ``modified``, ``applied`` (rule, anchor,
        iteration), ``iterations``, ``converged``.
    """
    return apply_rules(graph, rules, max_iterations=max_iterations, in_place=in_place)


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def _per_channel(tensor, channels):
    """Whether a tensor's static shape is ``[C]`` or ``[1, ..., 1, C]`` (or ``[C, 1, 1]``)."""
    shape = tensor.attrs.get("shape")
    if shape is None or channels is None or None in shape:
        return False
    size = 1
    for d in shape:
        size *= d
    return size == channels and (shape[-1] == channels or shape[0] == channels or
                                 (len(shape) == 4 and shape[1] == channels))


def _like(made, reference):
    for t in made.outputs:
        t.attrs = {k: v for k, v in reference.attrs.items() if k in ("dtype", "shape")}
    return made


# ---------------------------------------------------------------------------
# PyTorch graph capture (aten ops lifted by amanda.frontends.pytorch_graph)
# ---------------------------------------------------------------------------


def _aten(graph, target, args, kwargs=None, name=None, like=None):
    """Creates one captured-PyTorch op: ``args``/``kwargs`` mix IR tensors and constants."""
    inputs = []

    def encode(value):
        if hasattr(value, "producer") and hasattr(value, "uses"):  # an IR tensor
            inputs.append(value)
            return {"$input": len(inputs) - 1}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        return value

    attrs = {"target": target, "args": encode(list(args)), "kwargs": encode(dict(kwargs or {}))}
    op_type = target.split(".")[1] if target.startswith("aten.") else target.rsplit(".", 1)[0]
    made = graph.create_op(op_type, inputs, attrs=attrs, name=name or op_type)
    if like is not None:
        _like(made, like)
    return made.outputs[0]


def _arg(g_op, position, default=None):
    """Argument ``position`` of a captured call: the IR tensor or the constant."""
    args = g_op.attrs.get("args", [])
    if position >= len(args):
        return default
    value = args[position]
    if isinstance(value, dict) and set(value) == {"$input"}:
        return g_op.inputs[value["$input"]]
    return value


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


def _onnx_constant(graph, name, value_float=None, value_ints=None):
    """An ONNX ``Constant`` holding a float32 scalar or an int64 vector (no onnx import needed)."""
    if value_ints is not None:
        made = graph.create_op("Constant", [], attrs={"value_ints": list(value_ints)}, name=name)
        made.outputs[0].attrs = {"dtype": "int64", "shape": [len(value_ints)]}
    else:
        made = graph.create_op("Constant", [], attrs={"value_float": float(value_float)}, name=name)
        made.outputs[0].attrs = {"dtype": "float32", "shape": []}
    return made.outputs[0]


def _onnx_attrs_of_new_op(attrs):
    """A copy of a node's attrs for a new node: the ONNX node name is not copied."""
    attrs = dict(attrs)
    if isinstance(attrs.get("_onnx"), dict):
        attrs["_onnx"] = {k: v for k, v in attrs["_onnx"].items() if k != "name"}
    return attrs


# ---------------------------------------------------------------------------
# Example rule sets
# ---------------------------------------------------------------------------


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


@constraint("gelu is exact (approximate='none')")
def _exact_gelu(g_op, match):
    approximate = g_op.attrs.get("kwargs", {}).get("approximate", _arg(g_op, 1, "none"))
    return approximate == "none"


def _torch_gelu_tanh(match):
    graph, gelu = match.graph, match["gelu"]
    x, base = match["x"], gelu.name
    cube = _aten(graph, "aten.pow.Tensor_Scalar", [x, 3], name=base + "_cube")
    inner = _aten(graph, "aten.add.Tensor", [x, _aten(graph, "aten.mul.Scalar", [cube, 0.044715], name=base + "_c")],
                  name=base + "_inner")
    tanh = _aten(graph, "aten.tanh.default", [_aten(graph, "aten.mul.Scalar", [inner, math.sqrt(2 / math.pi)],
                                                    name=base + "_scaled")], name=base + "_tanh")
    half = _aten(graph, "aten.mul.Scalar", [_aten(graph, "aten.add.Scalar", [tanh, 1.0], name=base + "_one_plus"), 0.5],
                 name=base + "_half")
    return [_aten(graph, "aten.mul.Tensor", [x, half], name=base + "_tanh_approx", like=gelu.outputs[0])]


def gelu_tanh_rules(backend="pytorch"):
    """Rules replacing exact ``gelu`` by its tanh approximation written out in
    elementary ops: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``.

    Args:
        backend: ``"pytorch"`` (graph capture).
    """
    if backend != "pytorch":
        raise RewriteError(f"gelu_tanh_rules: no rules for backend {backend!r} (pytorch)")
    p = pattern(lambda x: op.gelu(x, name="gelu", extra_inputs=True), constraints={"gelu": _exact_gelu},
                name="gelu_tanh")
    return [Rule(p, _torch_gelu_tanh)]


_FAKE_QUANT = "aten.fake_quantize_per_tensor_affine.default"


@constraint("input is not fake-quantized yet")
def _not_fake_quantized(tensor, match):
    return tensor.producer is None or tensor.producer.attrs.get("target") != _FAKE_QUANT


def fake_quant_matmul_rules(backend="pytorch", scale=1 / 64, zero_point=0, quant_min=-128, quant_max=127):
    """Rules inserting a fake-quant pair (one per operand) around every matrix product.

    ``matmul(a, b)`` and ``linear(a, b[, bias])`` read
    ``fake_quantize_per_tensor_affine`` of both operands afterwards. The
    constraint that an operand is not fake-quantized yet is what makes the
    driver converge (a rewritten product does not match again).

    Args:
        backend: ``"pytorch"`` (graph capture).
        scale, zero_point, quant_min, quant_max: the fake-quant parameters.
    """
    if backend != "pytorch":
        raise RewriteError(f"fake_quant_matmul_rules: no rules for backend {backend!r} (pytorch)")

    def fake_quantize(match):
        graph, product = match.graph, match["product"]
        quantized = [_aten(graph, _FAKE_QUANT, [t, scale, zero_point, quant_min, quant_max],
                           name=f"{product.name}_fq{i}", like=t)
                     for i, t in enumerate(product.inputs[:2])]
        made = graph.create_op(product.type, quantized + list(product.inputs[2:]), attrs=dict(product.attrs),
                               name=product.name + "_quantized")
        return [_like(made, product.outputs[0]).outputs[0]]

    p = pattern(lambda a, b: op("matmul|linear", a, b, name="product", extra_inputs=True),
                constraints={"a": _not_fake_quantized, "b": _not_fake_quantized}, name="fake_quant_matmul")
    return [Rule(p, fake_quantize)]
