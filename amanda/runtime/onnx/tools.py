"""ONNX knowledge for the built-in tools (see :mod:`amanda.runtime.tool_support`).

Protobuf fields of ``onnx.NodeProto``/``ValueInfoProto``, the ONNX
frontend's metadata (``attrs["_onnx"]``) and the element types the runtime
can hand to a Python routine are read here, so tools never touch them.
Importing this module imports neither onnx nor onnxruntime.
"""

from __future__ import annotations

__all__ = ["ANALYSED_PER_CALL_SITE", "COUNTS_AT_RUN_TIME", "HOSTED_DTYPES",
           "MODULE_PATH_SEPARATOR", "OTHER_BACKWARD_FLOPS", "ROUTINES_ORDERED_BY_DATAFLOW",
           "accumulates_gradient", "attrs_for_new_op", "backward_flop_factor",
           "backward_flop_operands", "current_run", "hosted", "initializer", "int_attribute",
           "is_weight_input", "is_whole_graph", "load_model", "module_path_from_op",
           "node_attribute", "onnx_module_path", "operand_grad", "parameter_operand",
           "stable_op_id", "static_shape", "tensor_values",
           "trainable_parameters", "weight_value"]

#: The dtypes whose tensors the ONNX runtime can hand to a hosted Python
#: routine, with their ONNX element types: the keys of
#: ``amanda.runtime.onnx.host._HOSTED_DTYPES`` (float16 and bfloat16 are
#: not supported by onnxruntime-extensions' Python ops). Kept as codes so
#: that reading them loads neither onnx nor the extensions.
HOSTED_DTYPES = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6,
                 "int64": 7, "bool": 9, "float64": 11, "uint32": 12, "uint64": 13}
_HOSTED_ELEM_TYPES = frozenset(HOSTED_DTYPES.values())


def module_path_from_op(context):
    """The module path a PyTorch exporter encoded in the node's name, or None."""
    return onnx_module_path(getattr(context.get_op(), "name", None) or "")


def onnx_module_path(node_name):
    """The module path a PyTorch exporter encoded in an ONNX node's name, or None.

    ``"/encoder/stages.0/layer/layer.1/conv/Conv"`` -> ``"encoder.stages.0.layer.1.conv"``:
    the last segment is the op, and a called container's segment (``layer``)
    is followed by its child's as ``layer.1``, which replaces it.
    """
    segments = [s for s in node_name.split("/") if s][:-1]
    if not segments:
        return None
    path = []
    for segment in segments:
        if path and segment.startswith(path[-1] + "."):
            path[-1] = segment
        else:
            path.append(segment)
    return ".".join(path)


def is_whole_graph(graph):
    """A lifted ONNX model is always a whole graph."""
    return bool(graph.ops)


def stable_op_id(op):
    """Nodes are identified by name."""
    return op.name


def node_attribute(node, name, default):
    """The value of attribute ``name`` of an ``onnx.NodeProto``, or ``default``."""
    for attr in node.attribute:
        if attr.name == name:
            import onnx
            return onnx.helper.get_attribute_value(attr)
    return default


def int_attribute(node, name, default=0):
    """The integer field of attribute ``name`` of a node (anything with
    ``attribute``), or ``default`` when it has none."""
    for attr in getattr(node, "attribute", ()):
        if attr.name == name:
            return attr.i
    return default


def static_shape(value):
    """The static shape of an ``onnx.ValueInfoProto`` (duck-typed), or None
    when its rank or a dimension is unknown or symbolic."""
    tensor_type = getattr(getattr(value, "type", None), "tensor_type", None)
    if tensor_type is None or not value.type.HasField("tensor_type") \
            or not tensor_type.HasField("shape"):
        return None
    sizes = []
    for d in tensor_type.shape.dim:
        if not d.HasField("dim_value"):
            return None
        sizes.append(int(d.dim_value))
    return tuple(sizes)


def hosted(value):
    """Whether a tensor (an ``onnx.ValueInfoProto``) can be handed to a
    hosted Python routine: its element type is one of :data:`HOSTED_DTYPES`."""
    return value is not None and value.type.tensor_type.elem_type in _HOSTED_ELEM_TYPES


def attrs_for_new_op(attrs):
    """A copy of a lifted node's attrs for a new node: the frontend's
    metadata is kept but for the node name, which must stay unique."""
    attrs = dict(attrs)
    if isinstance(attrs.get("_onnx"), dict):
        attrs["_onnx"] = {k: v for k, v in attrs["_onnx"].items() if k != "name"}
    return attrs


def current_run():
    """The ONNX run (``session.run`` call) the calling routine belongs to
    (see ``amanda.runtime.onnx.current_run``); the runtime is loaded here,
    when a routine of an ONNX model asks."""
    from amanda.runtime.onnx import current_run as run_of_caller
    return run_of_caller()


def load_model(model):
    """An ``onnx.ModelProto`` as given, or loaded from a path."""
    import onnx
    return model if isinstance(model, onnx.ModelProto) else onnx.load(model)


def tensor_values(model, feeds, names=(), max_ir_version=None):
    """Run an ONNX model in onnxruntime (CPU) and return intermediate tensors too.

    onnxruntime only returns a model's declared outputs; the named tensors are
    declared as extra outputs of a copy (the model is not modified).

    Args:
        model: an ``onnx.ModelProto``.
        feeds: input name -> array.
        names: names of node outputs to return besides the model's outputs.
        max_ir_version: lower the copy's IR version to at most this (for an
            onnxruntime older than the onnx package that wrote the model).

    Returns:
        A dict tensor name -> array holding the model's outputs and ``names``.
    """
    import onnx
    import onnxruntime as ort
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    if max_ir_version is not None:
        probed.ir_version = min(probed.ir_version, max_ir_version)
    declared = {o.name for o in probed.graph.output}
    wanted = [o.name for o in model.graph.output]
    for name in names:
        if name not in declared:
            probed.graph.output.append(onnx.ValueInfoProto(name=name))
            declared.add(name)
            wanted.append(name)
    session = ort.InferenceSession(probed.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return dict(zip(wanted, session.run(wanted, feeds)))


#: How module paths are joined (the exporter's scopes, as dotted paths).
MODULE_PATH_SEPARATOR = "."


def backward_flop_factor(backward_op):
    """0: ONNX graphs are inference graphs, without backward ops."""
    return 0


def backward_flop_operands(backward_op):
    """None: ONNX graphs have no backward ops."""
    return None


def trainable_parameters(inputs):
    """``{}``: weights of an ONNX graph are initializers, not inputs the
    routines see as parameters."""
    return {}


def initializer(tensor):
    """The initializer (the frontend's holder of an ``onnx.TensorProto``,
    with ``to_numpy()``) an IR tensor was lifted from, or None."""
    return tensor.attrs.get("initializer")


def weight_value(context, position):
    """``(value, as_tensor)`` of the initializer feeding input ``position``
    of the context's node, or None when it is no initializer (the caller
    evaluates it)."""
    ir_op = context.get_ir_op()
    found = None if ir_op is None or position >= len(ir_op.inputs) else \
        initializer(ir_op.inputs[position])
    if found is None:
        return None
    import numpy as np
    weight = np.asarray(found.to_numpy())
    dtype = weight.dtype
    return weight, (lambda array: np.asarray(array, dtype=dtype))


def is_weight_input(tensor):
    """Whether a graph input is a weight: an initializer."""
    return "initializer" in tensor.attrs


#: Whether an inserted routine runs in order with its op only through the
#: tensors it hands back (True: onnxruntime orders nodes by dataflow alone).
ROUTINES_ORDERED_BY_DATAFLOW = True


#: FLOPs profiler: whether the backward formulas of ops other than products
#: (element-wise, normalisations, lookups...) apply to this backend's backward
#: ops (PyTorch: one autograd node per forward op).
OTHER_BACKWARD_FLOPS = False

#: Whether analysis runs once per call site, so that a later execution there
#: may have other shapes (the FLOPs profiler checks them at run time).
ANALYSED_PER_CALL_SITE = False

#: Whether ops whose shapes are not static are counted from the arrays their
#: routines receive (``hosted(value)`` says which values can reach one).
COUNTS_AT_RUN_TIME = True


def parameter_operand(context, position):
    """None: no matrix product of this backend reads a parameter the
    pruning tool prunes as an operand (weights are ``weight_input``)."""
    return None


def operand_grad(backward_op):
    """None (see ``parameter_operand``)."""
    return None


def accumulates_gradient(backward_op):
    """False: no backward op of this backend only stores a gradient."""
    return False
