"""Lower an amanda IR graph (lifted from TensorFlow, possibly rewritten) back to a ``GraphDef``.

    from amanda.frontends.tensorflow import lift_graph
    from amanda.runtime.tensorflow.graphdef import lower_to_graph_def

    ir = lift_graph(tf_graph)
    ...                                        # rewrite ir (amanda.tools.rewrite)
    graph_def = lower_to_graph_def(ir, base=tf_graph)

One ``NodeDef`` per IR op, in IR order, named like the op. An op that exists in
``base`` under the same name and type keeps that ``NodeDef``'s attrs and device
bit for bit (the frontend keeps only the dtype and shape of large constants, so
weights come from there); only its inputs are rewritten from the IR's wiring.
Any other op (one a rewrite created) gets its attrs converted from the IR attrs
through the op's registered ``OpDef``: ``type`` attrs from dtype names
(``"float32"``), ``shape`` from lists (None for unknown dims), ``tensor`` from a
NumPy array or the frontend's ``{"dtype", "shape", "value"}`` form, lists of
those, and scalars. Attrs the IR op lacks take the ``OpDef`` defaults. The
function library and versions are copied from ``base``.

``amanda.routine`` ops are not lowered here: instrumented TF graphs are built by
`amanda.instrument` / the TF runtime, which host routines as callbacks.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from amanda.errors import BackendError

__all__ = ["lower_to_graph_def"]

# IR attrs the frontend adds that are not NodeDef attrs.
_IR_ONLY_ATTRS = frozenset({"device", "call_function", "unresolved_control_inputs", "backward",
                            "forward_op"})


def lower_to_graph_def(graph, base=None):
    """Builds a ``GraphDef`` from an IR graph of TensorFlow ops.

    Args:
        graph: an `amanda.ir.Graph` (from `amanda.frontends.tensorflow.lift_graph`,
            possibly rewritten).
        base: the ``tf.Graph`` or ``GraphDef`` it was lifted from (or None):
            NodeDefs of unchanged ops are taken from it.

    Returns:
        A ``tf.compat.v1.GraphDef``.

    Raises:
        BackendError: an op is an ``amanda.routine``, its type is not a
            registered TF op and not in ``base``, or an attr cannot be converted;
            the message names the op.
    """
    if isinstance(base, tf.Graph):
        base = base.as_graph_def()
    originals = {node.name: node for node in base.node} if base is not None else {}
    result = tf.compat.v1.GraphDef()
    if base is not None:
        result.versions.CopyFrom(base.versions)
        result.library.CopyFrom(base.library)
    for op in graph:
        node = result.node.add()
        original = originals.get(op.name)
        if original is not None and original.op == op.type:
            node.CopyFrom(original)
            del node.input[:]
        else:
            _new_node(node, op)
        node.input.extend(_input_names(op))
    return result


def _input_names(op):
    names = []
    for tensor in op.inputs:
        producer = tensor.producer
        if producer is None:
            name = tensor.attrs.get("back_edge") or tensor.name
        else:
            name = producer.name if tensor.index == 0 else f"{producer.name}:{tensor.index}"
        names.append(name)
    controls = [c.name for c in op.control_inputs] + list(op.attrs.get("unresolved_control_inputs") or ())
    names.extend("^" + c for c in controls)
    return names


def _new_node(node, op):
    if op.type == "amanda.routine":
        raise BackendError(f"op {op.name!r} is an amanda.routine: lower instrumented TF graphs with "
                           "amanda.instrument, which hosts routines")
    op_def = op_def_registry.get(op.type)
    if op_def is None:
        raise BackendError(f"op {op.name!r}: {op.type!r} is not a registered TensorFlow op and is not in "
                           "the base graph")
    node.name, node.op = op.name, op.type
    if op.attrs.get("device"):
        node.device = op.attrs["device"]
    declared = {a.name: a.type for a in op_def.attr}
    for key, value in op.attrs.items():
        if key in _IR_ONLY_ATTRS or value is None:
            continue
        kind = declared.get(key)
        if kind is None:
            continue  # not an attr of this op (e.g. set by a pass for itself)
        try:
            node.attr[key].CopyFrom(_attr_value(kind, value))
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"op {op.name!r} ({op.type}): attr {key!r} = {value!r} is not a valid "
                               f"{kind}: {exc}") from exc


def _attr_value(kind, value):
    attr = tf.compat.v1.AttrValue()
    if kind.startswith("list("):
        inner = kind[5:-1]
        items = [_attr_value(inner, v) for v in value]
        field = {"int": "i", "float": "f", "bool": "b", "string": "s", "type": "type", "shape": "shape",
                 "tensor": "tensor"}.get(inner)
        if field is None:
            raise BackendError(f"cannot convert a {kind} attr")
        target = getattr(attr.list, field)
        for item in items:
            element = getattr(item, field)
            if field in ("shape", "tensor"):
                target.add().CopyFrom(element)
            else:
                target.append(element)
        attr.list.SetInParent()
        return attr
    if kind == "type":
        attr.type = tf.as_dtype(value).as_datatype_enum
    elif kind == "int":
        attr.i = int(value)
    elif kind == "float":
        attr.f = float(value)
    elif kind == "bool":
        attr.b = bool(value)
    elif kind == "string":
        attr.s = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    elif kind == "shape":
        attr.shape.CopyFrom(_shape_proto(value))
    elif kind == "tensor":
        attr.tensor.CopyFrom(_tensor_proto(value))
    else:
        raise BackendError(f"cannot convert a {kind} attr")
    return attr


def _shape_proto(value):
    if value is None:
        return tf.TensorShape(None).as_proto()
    return tf.TensorShape([None if d is None or d < 0 else int(d) for d in value]).as_proto()


def _tensor_proto(value):
    if isinstance(value, dict):
        if "value" not in value:
            raise BackendError("a constant lifted without its value (it was too large) cannot be rebuilt; "
                               "keep the op's name so the base graph's NodeDef is used")
        return tf.make_tensor_proto(np.asarray(value["value"]).astype(value["dtype"]),
                                    shape=value["shape"])
    return tf.make_tensor_proto(np.asarray(value))
