"""Helpers for writing rewrite rules over the IR (:mod:`amanda.passes.rewrite`):
patterns from plain functions, constants and shapes read from graphs, and
the pieces the example rule sets of several backends share
(:mod:`amanda.tools.rewrite_rules`; each backend's variants live in its
package, ``amanda/runtime/<backend>/rewrite_rules.py``). Framework-free.
"""

from __future__ import annotations

import math

from amanda.passes.rewrite import Pattern, constraint, op

__all__ = ["TANH_CUBIC", "TANH_SCALE", "erf_scale", "float32", "gelu_erf_patterns", "is_scalar",
           "like", "operand_float32", "pattern", "per_channel", "requantized_product",
           "scalar_value", "tanh_gelu_ops"]


def pattern(fn, constraints=None, commutative=(), name=None, namespace=""):
    """Builds a `Pattern` from a plain Python function over ``op`` (see `Pattern.trace`)."""
    return Pattern.trace(fn, constraints=constraints, commutative=commutative, name=name,
                         namespace=namespace)


def per_channel(tensor, channels):
    """Whether a tensor's static shape is ``[C]`` or ``[1, ..., 1, C]`` (or ``[C, 1, 1]``)."""
    shape = tensor.attrs.get("shape")
    if shape is None or channels is None or None in shape:
        return False
    size = 1
    for d in shape:
        size *= d
    return size == channels and (shape[-1] == channels or shape[0] == channels or
                                 (len(shape) == 4 and shape[1] == channels))


def like(made, reference):
    """``made`` with its outputs given ``reference``'s dtype and shape attrs."""
    for t in made.outputs:
        t.attrs = {k: v for k, v in reference.attrs.items() if k in ("dtype", "shape")}
    return made


def scalar_value(tensor):
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


def is_scalar(expected, what):
    """A constraint: the tensor is the constant ``expected`` (``what`` names it)."""
    @constraint(f"{what} is the constant {expected:.8g}")
    def check(tensor, match):
        value = scalar_value(tensor)
        return value is not None and abs(value - expected) <= 1e-6 * abs(expected)

    return check


# -- fake quantization ---------------------------------------------------------------


@constraint("operand is float32")
def operand_float32(tensor, match):
    return tensor.attrs.get("dtype") == "float32"


def requantized_product(match, quantize, copy_attrs=dict):
    """A copy of ``match["product"]`` reading ``quantize(operand, i)`` of its
    first two inputs; ``copy_attrs`` copies the product's attrs for the new op."""
    graph, product = match.graph, match["product"]
    quantized = [quantize(t, i) for i, t in enumerate(product.inputs[:2])]
    made = graph.create_op(product.type, quantized + list(product.inputs[2:]),
                           attrs=copy_attrs(product.attrs), name=product.name + "_quantized")
    return [like(made, product.outputs[0]).outputs[0]]


# -- exact gelu spelled with elementary ops, and its tanh approximation --------------

_SQRT2 = math.sqrt(2.0)

# 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
TANH_SCALE = math.sqrt(2 / math.pi)
TANH_CUBIC = 0.044715


@constraint("the erf argument is x / sqrt(2) (or x * 1/sqrt(2))")
def erf_scale(tensor, match):
    value = scalar_value(tensor)
    expected = _SQRT2 if match["scaled"].type in ("Div", "RealDiv") else 1 / _SQRT2
    return value is not None and abs(value - expected) <= 1e-6 * expected


@constraint("x is float32 (the replacement's constants are float32)")
def float32(tensor, match):
    return tensor.attrs.get("dtype") == "float32"


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


def gelu_erf_patterns(div_types, add_types, with_one, extra_constraints=None):
    """Patterns of exact gelu spelled with elementary ops.

    ``with_one``: ``0.5 * x * (1 + erf(x / sqrt 2))`` (div_types name the
    division, add_types the addition); otherwise TensorFlow's
    ``0.5 * x * erfc(-x * 1/sqrt 2)``.
    """
    def erf_core(x, c, one):
        return op(add_types, one, op.Erf(op(div_types, x, c, name="scaled"), name="erf"),
                  name="one_plus")

    def erfc_core(x, c):
        return op.Erfc(op.Mul(op.Neg(x, name="neg"), c, name="scaled"), name="erfc")

    constraints = {"half": is_scalar(0.5, "the factor"), "c": erf_scale}
    if with_one:
        constraints["one"] = is_scalar(1.0, "the addend")
    constraints.update(extra_constraints or {})
    commutative = ["Mul"] + add_types.split("|")
    patterns = []
    for suffix, tree in _gelu_trees(erf_core if with_one else erfc_core):
        fn = _with_one(tree) if with_one else _without_one(tree)
        patterns.append(pattern(fn, constraints=dict(constraints), commutative=commutative,
                                name=f"gelu_{'erf' if with_one else 'erfc'}_{suffix}"))
    return patterns


def tanh_gelu_ops(x, const, binary, tanh):
    """Writes the tanh approximation with backend callbacks: ``const(value, suffix)``,
    ``binary(type_key, a, b, suffix)`` (``"mul"``/``"add"``) and ``tanh(t, suffix)``."""
    cube = binary("mul", x, binary("mul", x, x, "square"), "cube")
    inner = binary("add", x, binary("mul", const(TANH_CUBIC, "cubic_coef"), cube, "cubic"), "inner")
    t = tanh(binary("mul", const(TANH_SCALE, "sqrt_2_over_pi"), inner, "scaled"), "tanh")
    one_plus = binary("add", const(1.0, "one"), t, "one_plus")
    return binary("mul", binary("mul", const(0.5, "half"), x, "half_x"), one_plus, "output")
