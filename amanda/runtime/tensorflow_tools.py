"""TensorFlow knowledge for the built-in tools (see :mod:`amanda.runtime.tool_support`).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

__all__ = ["frozen_graph_def", "is_whole_graph", "module_path_from_op", "name_scope", "stable_op_id",
           "tf2onnx_converter"]


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
