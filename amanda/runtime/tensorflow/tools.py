"""TensorFlow knowledge for the built-in tools (see :mod:`amanda.runtime.tool_support`).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import math

__all__ = ["ANALYSED_PER_CALL_SITE", "COUNTS_AT_RUN_TIME", "MODULE_PATH_SEPARATOR",
           "OTHER_BACKWARD_FLOPS", "ROUTINES_ORDERED_BY_DATAFLOW", "accumulates_gradient",
           "backward_flop_factor", "backward_flop_operands", "frozen_graph_def",
           "is_weight_input", "is_whole_graph", "module_path_from_op", "name_scope",
           "operand_grad", "parameter_operand", "stable_op_id", "static_shape",
           "tf2onnx_converter", "trainable_parameters", "weight_value"]


def name_scope(op_name):
    """The name scope of a TF op name (``"dense_1"`` for ``"dense_1/MatMul"``), or None."""
    return (op_name or "").rpartition("/")[0] or None


def module_path_from_op(context):
    """The op's name scope; for a backward context without a forward op, the
    backward op's. None for an op outside every name scope."""
    op = context.get_op() if context.get_op() is not None else context.get_backward_op()
    return name_scope(getattr(op, "name", None))


def is_whole_graph(graph):
    """A lifted TF graph is always a whole graph."""
    return bool(graph.ops)


def stable_op_id(op):
    """Graph ops are identified by name."""
    return op.name


def frozen_graph_def(session, outputs):
    """The ``GraphDef`` of a ``tf.compat.v1`` session's graph with its
    variables frozen to constants, pruned to what ``outputs`` (tensor names,
    ``"y:0"``) need."""
    import tensorflow as tf
    return tf.compat.v1.graph_util.convert_variables_to_constants(
        session, session.graph.as_graph_def(), [name.split(":")[0] for name in outputs])


def tf2onnx_converter():
    """``convert(graph_def, inputs, outputs, opset) -> onnx.ModelProto`` by tf2onnx
    (TF tensor names kept).

    Raises:
        ImportError: tf2onnx is not installed.
    """
    import tf2onnx

    def convert(graph_def, inputs, outputs, opset):
        model, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=inputs,
                                                  output_names=outputs, opset=opset)
        return model

    return convert


#: How module paths (name scopes) are joined (``"model/dense_1"``).
MODULE_PATH_SEPARATOR = "/"

# Gradient ops that compute the gradients of a convolution / matrix product,
# and how many forward-FLOPs each is charged (FLOPs profiler).
_BACKWARD_FLOP_FACTORS = {"Conv2DBackpropInput": 1, "Conv2DBackpropFilter": 1,
                          "Conv2DBackpropInputV2": 1, "Conv2DBackpropFilterV2": 1,
                          "DepthwiseConv2dNativeBackpropInput": 1,
                          "DepthwiseConv2dNativeBackpropFilter": 1,
                          "MatMul": 1, "BatchMatMul": 1, "BatchMatMulV2": 1, "BatchMatMulV3": 1}

_VARIABLE_READS = ("ReadVariableOp", "VariableV2")


def backward_flop_factor(backward_op):
    """How many forward-FLOPs of its op a gradient ``tf.Operation`` is
    charged; 0 when it is not one of those counted."""
    return _BACKWARD_FLOP_FACTORS.get(getattr(backward_op, "type", None), 0)


def backward_flop_operands(backward_op):
    """None: each TF gradient op computes one gradient, and TensorFlow runs
    only those a fetch needs (``backward_flop_factor`` per op)."""
    return None


def trainable_parameters(inputs):
    """``{variable name: element count}`` of the inputs read from a variable
    (whose static shape is fully known)."""
    found = {}
    for value in inputs:
        producer = getattr(value, "op", None)
        if getattr(producer, "type", None) in _VARIABLE_READS:
            shape = _static_shape(value)
            if shape is not None:
                key = producer.inputs[0].name if producer.inputs else producer.name
                found[key] = math.prod(shape)
    return found


def _static_shape(value):
    """A graph tensor's fully known shape as a tuple, or None."""
    try:
        dims = list(value.shape)
    except TypeError:   # unknown rank
        return None
    dims = [getattr(d, "value", d) for d in dims]   # TF1 Dimension
    return None if None in dims else tuple(int(d) for d in dims)


def weight_value(context, position):
    """None: a TF weight is a variable's value, evaluated by the caller
    (``amanda.evaluate``) in the session or call being rewritten."""
    return None


def is_weight_input(tensor):
    """False: a lifted TF graph's inputs are its feeds; variables are read
    by ops (whose outputs the tools count as weights)."""
    return False


#: Whether an inserted routine runs in order with its op only through the
#: tensors it hands back (False: the runtime adds control dependencies).
ROUTINES_ORDERED_BY_DATAFLOW = False


#: FLOPs profiler: whether the backward formulas of ops other than products
#: (element-wise, normalisations, lookups...) apply to this backend's backward
#: ops (PyTorch: one autograd node per forward op).
OTHER_BACKWARD_FLOPS = False

#: Whether analysis runs once per call site, so that a later execution there
#: may have other shapes (the FLOPs profiler checks them at run time).
ANALYSED_PER_CALL_SITE = False

#: Whether ops whose shapes are not static are counted from the arrays their
#: routines receive (``hosted(value)`` says which values can reach one).
COUNTS_AT_RUN_TIME = False


def static_shape(value):
    """None: this backend's values carry their shape (``value.shape``)."""
    return None


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
