"""Exact gelu replaced by its tanh approximation (:func:`gelu_tanh_rules`),
per backend.
"""

from __future__ import annotations

import math

from amanda.passes.rewrite import RewriteError, Rule, constraint, op
from amanda.tools.rewrite_rules._common import (
    _arg,
    _aten,
    _is_scalar,
    _like,
    _onnx_attrs_of_new_op,
    _onnx_constant,
    _scalar_value,
    pattern,
)


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
