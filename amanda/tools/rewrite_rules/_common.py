"""Helpers the example rule sets share: building patterns, reading
constants and shapes from graphs, creating captured-PyTorch and ONNX ops.
"""

from __future__ import annotations

from amanda.passes.rewrite import Pattern, constraint
from amanda.runtime.tool_support import support_for


def pattern(fn, constraints=None, commutative=(), name=None, namespace=""):
    """Builds a `Pattern` from a plain Python function over ``op`` (see `Pattern.trace`)."""
    return Pattern.trace(fn, constraints=constraints, commutative=commutative, name=name, namespace=namespace)



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
# PyTorch graph capture (aten ops lifted by amanda.frontends.pytorch.graph)
# ---------------------------------------------------------------------------


def _aten(graph, target, args, kwargs=None, name=None, like=None):
    """Creates one captured-PyTorch op: ``args``/``kwargs`` mix IR tensors and
    constants (encoded the way the capture frontend does, by the PyTorch
    support module)."""
    attrs, inputs = support_for("pytorch").call_attrs(target, args, kwargs)
    op_type = target.split(".")[1] if target.startswith("aten.") else target.rsplit(".", 1)[0]
    made = graph.create_op(op_type, inputs, attrs=attrs, name=name or op_type)
    if like is not None:
        _like(made, like)
    return made.outputs[0]


def _arg(g_op, position, default=None):
    """Argument ``position`` of a captured call: the IR tensor or the constant."""
    return support_for("pytorch").call_argument(g_op, position, default)


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
    """A copy of a node's attrs for a new node: the ONNX frontend's metadata
    without the node name (edited by the ONNX support module)."""
    return support_for("onnx").attrs_for_new_op(attrs)


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
