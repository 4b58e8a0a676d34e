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

from amanda.passes.rewrite import (
    ANY,
    Explanation,
    Match,
    Pattern,
    RewriteError,
    RewriteResult,
    Rule,
    apply_rules,
    constraint,
    explain,
    find_matches,
    inline_graph,
    op,
)

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


# ---------------------------------------------------------------------------
# Constants read from graphs (TF Const, ONNX Constant or initializer)
# ---------------------------------------------------------------------------


def _scalar_value(tensor):
    """The value of a one-element constant tensor as a float, or None if it is not one.

    Reads a TensorFlow ``Const`` (lifted value dict or array), an ONNX
    ``Constant`` (``value`` tensor, ``value_float``) or an ONNX initializer.
    """
    producer = tensor.producer
    if producer is None:
        value = tensor.attrs.get("initializer")
    elif producer.type == "Const":
        value = producer.attrs.get("value")
        if isinstance(value, dict):
            value = value.get("value")
    elif producer.type == "Constant":
        value = producer.attrs.get("value", producer.attrs.get("value_float"))
    else:
        return None
    if hasattr(value, "to_numpy"):  # an ONNX TensorProto kept by the frontend
        value = value.to_numpy()
    if hasattr(value, "tolist"):
        value = value.tolist()
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _is_scalar(expected, what):
    @constraint(f"{what} is the constant {expected:.8g}")
    def check(tensor, match):
        value = _scalar_value(tensor)
        return value is not None and abs(value - expected) <= 1e-6 * abs(expected)

    return check


_SQRT2 = math.sqrt(2.0)


@constraint("the erf argument is x / sqrt(2) (or x * 1/sqrt(2))")
def _erf_scale(tensor, match):
    value = _scalar_value(tensor)
    expected = _SQRT2 if match["scaled"].type in ("Div", "RealDiv") else 1 / _SQRT2
    return value is not None and abs(value - expected) <= 1e-6 * expected


def _gelu_trees(core):
    """The three ways ``0.5 * x * core(x)`` multiplies out (with Mul commutative, that is all of them).

    Yields ``(suffix, fn)`` where ``fn(x, half, *rest)`` records the pattern;
    ``core(x, *rest)`` records ``1 + erf(x / sqrt 2)`` (or its erfc spelling).
    Where either operand may differ, the order is chosen for explanations: in
    ``1 + erf`` the constant comes first (a Tanh in place of Erf is then the
    failure reported), in ``-x * c`` the Neg (a wrong constant is reported).
    """
    def half_outside(x, half, c, *one):  # (x * core) * 0.5: torch.onnx (TorchScript)
        return op.Mul(half, op.Mul(x, core(x, c, *one), name="mul"), name="gelu")

    def x_outside(x, half, c, *one):  # x * (0.5 * core): torch.onnx (dynamo)
        return op.Mul(x, op.Mul(half, core(x, c, *one), name="mul"), name="gelu")

    def core_outside(x, half, c, *one):  # (0.5 * x) * core: TensorFlow, hand-written gelu
        return op.Mul(op.Mul(half, x, name="mul"), core(x, c, *one), name="gelu")

    return [("half_outside", half_outside), ("x_outside", x_outside), ("core_outside", core_outside)]


def _with_one(tree):
    def fn(x, half, c, one):  # the parameters name the wildcards
        return tree(x, half, c, one)
    return fn


def _without_one(tree):
    def fn(x, half, c):
        return tree(x, half, c)
    return fn


def _gelu_erf_patterns(div_types, add_types, with_one, extra_constraints=None):
    """Patterns of exact gelu spelled with elementary ops.

    ``with_one``: ``0.5 * x * (1 + erf(x / sqrt 2))`` (div_types name the
    division, add_types the addition); otherwise TensorFlow's
    ``0.5 * x * erfc(-x * 1/sqrt 2)``.
    """
    def erf_core(x, c, one):
        return op(add_types, one, op.Erf(op(div_types, x, c, name="scaled"), name="erf"), name="one_plus")

    def erfc_core(x, c):
        return op.Erfc(op.Mul(op.Neg(x, name="neg"), c, name="scaled"), name="erfc")

    constraints = {"half": _is_scalar(0.5, "the factor"), "c": _erf_scale}
    if with_one:
        constraints["one"] = _is_scalar(1.0, "the addend")
    constraints.update(extra_constraints or {})
    commutative = ["Mul"] + add_types.split("|")
    patterns = []
    for suffix, tree in _gelu_trees(erf_core if with_one else erfc_core):
        fn = _with_one(tree) if with_one else _without_one(tree)
        patterns.append(pattern(fn, constraints=dict(constraints), commutative=commutative,
                                name=f"gelu_{'erf' if with_one else 'erfc'}_{suffix}"))
    return patterns


# ---------------------------------------------------------------------------
# gelu -> tanh approximation
# ---------------------------------------------------------------------------

# 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
_TANH_SCALE = math.sqrt(2 / math.pi)
_TANH_CUBIC = 0.044715


@constraint("gelu is exact (approximate='none')")
def _exact_gelu(g_op, match):
    approximate = g_op.attrs.get("kwargs", {}).get("approximate", _arg(g_op, 1, "none"))
    return approximate == "none"


def _torch_gelu_tanh(match):
    graph, gelu = match.graph, match["gelu"]
    x, base = match["x"], gelu.name
    cube = _aten(graph, "aten.pow.Tensor_Scalar", [x, 3], name=base + "_cube")
    inner = _aten(graph, "aten.add.Tensor", [x, _aten(graph, "aten.mul.Scalar", [cube, _TANH_CUBIC], name=base + "_c")],
                  name=base + "_inner")
    tanh = _aten(graph, "aten.tanh.default", [_aten(graph, "aten.mul.Scalar", [inner, _TANH_SCALE],
                                                    name=base + "_scaled")], name=base + "_tanh")
    half = _aten(graph, "aten.mul.Scalar", [_aten(graph, "aten.add.Scalar", [tanh, 1.0], name=base + "_one_plus"), 0.5],
                 name=base + "_half")
    return [_aten(graph, "aten.mul.Tensor", [x, half], name=base + "_tanh_approx", like=gelu.outputs[0])]


def _tanh_gelu_ops(x, const, binary, tanh):
    """Writes the tanh approximation with backend callbacks: ``const(value, suffix)``,
    ``binary(type_key, a, b, suffix)`` (``"mul"``/``"add"``) and ``tanh(t, suffix)``."""
    cube = binary("mul", x, binary("mul", x, x, "square"), "cube")
    inner = binary("add", x, binary("mul", const(_TANH_CUBIC, "cubic_coef"), cube, "cubic"), "inner")
    t = tanh(binary("mul", const(_TANH_SCALE, "sqrt_2_over_pi"), inner, "scaled"), "tanh")
    one_plus = binary("add", const(1.0, "one"), t, "one_plus")
    return binary("mul", binary("mul", const(0.5, "half"), x, "half_x"), one_plus, "output")


def _tf_gelu_tanh(match):
    graph, gelu, x = match.graph, match["gelu"], match["x"]
    dtype = gelu.attrs.get("T", "float32")
    base = f"{gelu.name}/tanh_approx"

    def const(value, suffix):
        made = graph.create_op("Const", [], attrs={"dtype": dtype, "value": {"dtype": dtype, "shape": [],
                                                                             "value": value}},
                               name=f"{base}/{suffix}")
        made.outputs[0].attrs = {"dtype": dtype, "shape": []}
        return made.outputs[0]

    def binary(kind, a, b, suffix):
        made = graph.create_op({"mul": "Mul", "add": "AddV2"}[kind], [a, b], attrs={"T": dtype},
                               name=f"{base}/{suffix}")
        return _like(made, x).outputs[0]

    def tanh(t, suffix):
        return _like(graph.create_op("Tanh", [t], attrs={"T": dtype}, name=f"{base}/{suffix}"), x).outputs[0]

    return [_tanh_gelu_ops(x, const, binary, tanh)]


def _onnx_gelu_tanh(match):
    graph, gelu, x = match.graph, match["gelu"], match["x"]
    base = f"{gelu.name}/tanh_approx"

    def const(value, suffix):
        return _onnx_constant(graph, f"{base}/{suffix}", value_float=value)

    def binary(kind, a, b, suffix):
        made = graph.create_op({"mul": "Mul", "add": "Add"}[kind], [a, b], name=f"{base}/{suffix}")
        return _like(made, x).outputs[0]

    def tanh(t, suffix):
        return _like(graph.create_op("Tanh", [t], name=f"{base}/{suffix}"), x).outputs[0]

    return [_tanh_gelu_ops(x, const, binary, tanh)]


def _onnx_gelu_op_tanh(match):
    """``Gelu(approximate='none')`` (opset 20) becomes ``Gelu(approximate='tanh')``."""
    gelu = match["gelu"]
    attrs = _onnx_attrs_of_new_op(gelu.attrs)
    attrs["approximate"] = "tanh"
    made = match.graph.create_op("Gelu", [match["x"]], attrs=attrs, name=f"{gelu.name}/tanh_approx")
    return [_like(made, gelu.outputs[0]).outputs[0]]


@constraint("Gelu is exact (approximate='none')")
def _onnx_exact_gelu(g_op, match):
    return g_op.attrs.get("approximate", "none") == "none"


@constraint("x is float32 (the replacement's constants are float32)")
def _float32(tensor, match):
    return tensor.attrs.get("dtype") == "float32"


def _gelu_tanh_pytorch():
    p = pattern(lambda x: op.gelu(x, name="gelu", extra_inputs=True), constraints={"gelu": _exact_gelu},
                name="gelu_tanh")
    return [Rule(p, _torch_gelu_tanh)]


def _gelu_tanh_tensorflow():
    patterns = (_gelu_erf_patterns("RealDiv|Mul", "AddV2|Add", with_one=False)
                + _gelu_erf_patterns("RealDiv|Mul", "AddV2|Add", with_one=True))
    return [Rule(p, _tf_gelu_tanh, name="gelu_tanh", prune=("Const",)) for p in patterns]


def _gelu_tanh_onnx():
    gelu_op = pattern(lambda x: op.Gelu(x, name="gelu"), constraints={"gelu": _onnx_exact_gelu}, name="gelu_op")
    patterns = _gelu_erf_patterns("Div|Mul", "Add", with_one=True, extra_constraints={"x": _float32})
    return [Rule(gelu_op, _onnx_gelu_op_tanh, name="gelu_tanh")] + [
        Rule(p, _onnx_gelu_tanh, name="gelu_tanh", prune=("Constant",)) for p in patterns]


_GELU_TANH = {"pytorch": _gelu_tanh_pytorch, "tensorflow": _gelu_tanh_tensorflow, "onnx": _gelu_tanh_onnx}


def gelu_tanh_rules(backend="pytorch"):
    """Rules replacing exact gelu by its tanh approximation
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``.

    All rules are named ``"gelu_tanh"`` (so ``result.counts()`` sums them);
    their patterns spell exact gelu the ways each backend writes it, and
    `explain` takes the whole list to say why none matches.

    Args:
        backend: ``"pytorch"`` (graph capture: ``gelu`` with
            ``approximate='none'``, replaced by ``pow``/``tanh``/``mul``/``add``
            ops); ``"tensorflow"`` (GraphDef: ``tf.nn.gelu`` and Keras
            ``activation="gelu"`` give ``0.5 * x * erfc(-x / sqrt 2)`` in
            TF 2.21, older TensorFlow and hand-written models
            ``0.5 * x * (1 + erf(x / sqrt 2))``; every association order of the
            two products is matched, and the constants 0.5, 1 and sqrt 2 are
            checked; replaced by ``Mul``/``AddV2``/``Tanh`` in the gelu's dtype);
            ``"onnx"`` (``Gelu`` with ``approximate='none'`` at opset 20 becomes
            ``Gelu`` with ``approximate='tanh'``; the ``Div``/``Erf``/``Add``/
            ``Mul``/``Mul`` subgraph that torch.onnx writes below opset 20, in
            the orders of both exporters, becomes ``Mul``/``Add``/``Tanh`` on
            float32).

    Returns:
        A list of `Rule`.
    """
    if backend not in _GELU_TANH:
        raise RewriteError(f"gelu_tanh_rules: no rules for backend {backend!r} ({', '.join(_GELU_TANH)})")
    return _GELU_TANH[backend]()


# ---------------------------------------------------------------------------
# Fake-quant pair around every matrix product
# ---------------------------------------------------------------------------

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
    attrs = _onnx_attrs_of_new_op(product.attrs) if "_onnx" in product.attrs else dict(product.attrs)
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
