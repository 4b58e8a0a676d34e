"""Reusable mapping rules: backend-neutral op types, weights and weight gradients.

Give them to a :class:`~amanda.tools.mapping.MappingTool` that your tool
depends on, and write the tool once against the keys below::

    from amanda.tools import mapping_rules
    from amanda.tools.mapping import MappingTool

    class MyTool(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.depends_on(MappingTool(rules=mapping_rules.WEIGHT_RULES))
            ...

Keys set by `pytorch_rule` / `tensorflow_rule` / `onnx_rule` (``RULES``):

* ``"type"``: the forward op's canonical type: ``"conv2d"``, ``"linear"`` (a
  matrix product with a weight: PyTorch ``linear``, a TF ``MatMul`` whose
  second input is read from a variable), ``"matmul"`` (other matrix
  products), ``"relu"``, ``"add"``, ``"max_pool2d"``... and otherwise the
  backend's op name in snake case (``"Rsqrt"`` -> ``"rsqrt"``). In a backward
  context, the type of the forward op that owns the backward op (None if no
  forward op owns it).
* ``"weight_input"``: the position of the weight among the forward op's
  inputs (``1`` for ``conv2d``, ``depthwise_conv2d`` and ``linear`` in both
  backends), None for ops without a weight.
* ``"weight_layout"``: the weight's layout in this backend, from
  :mod:`amanda.tools.mapping_tables` (``"OIHW"``, ``"HWIO"``, ``"OI"``,
  ``"IO"``...), None for ops without a weight. Use
  :func:`~amanda.tools.mapping_tables.convert_layout` to compare weights
  across backends.
* ``"backward_type"`` (backward contexts): ``"<type>_backward"``, e.g.
  ``"conv2d_backward"`` for every backward op of a convolution
  (``ConvolutionBackward0``; ``Conv2DBackpropFilter`` and
  ``Conv2DBackpropInput``).
* ``"weight_grad"`` (backward contexts): the position, among the backward
  op's outputs (``get_grad_inputs()``), of the gradient with respect to the
  forward op's weight, or None when this backward op does not compute it.
  PyTorch: output 1 of ``ConvolutionBackward0``, output 0 of a linear layer's
  ``TBackward0``. TensorFlow: output 0 of ``Conv2DBackpropFilter``, output 0
  of the ``MatMul`` that reads the forward ``MatMul``'s activation input.

Added by `pytorch_weight_rule` / `tensorflow_weight_rule` (``WEIGHT_RULES``),
in forward contexts of ops with a weight:

* ``"weight"``: the weight's current value, a NumPy array in the backend's
  layout (PyTorch ``OIHW`` and ``(out, in)``; TF ``HWIO`` and ``(in, out)``).
* ``"as_tensor"``: a function converting a NumPy array to what the
  backend's instrumentation routines receive (a torch tensor on the weight's
  device and dtype; a NumPy array of the weight's dtype in TF), so a routine
  like ``lambda weight, mask: weight * mask`` works on both.

Only the public API is used: ``context.get_op()``, ``get_backward_op()``,
``get_inputs()``, ``is_backward()``, ``namespace``, and for TF weight values
``amanda.evaluate``. Frameworks are imported lazily, when a
rule for them runs.
"""

from __future__ import annotations

import re

import numpy as np

from amanda.runtime.tool_support import support_for
from amanda.tools import mapping_tables

__all__ = [
    "RULES", "WEIGHT_RULES", "canonical_type", "onnx_rule", "onnx_weight_rule", "pytorch_rule",
    "pytorch_weight_rule", "tensorflow_rule", "tensorflow_weight_rule",
]

#: PyTorch op names (``get_op().__name__``) -> canonical type.
PYTORCH_TYPES = {
    "conv2d": "conv2d", "linear": "linear", "matmul": "matmul", "mm": "matmul",
    "bmm": "matmul", "relu": "relu", "relu_": "relu", "add": "add", "__add__": "add",
    "__radd__": "add", "add_": "add", "__iadd__": "add", "mul": "mul", "__mul__": "mul",
    "max_pool2d": "max_pool2d", "avg_pool2d": "avg_pool2d", "softmax": "softmax",
    "reshape": "reshape", "view": "reshape", "flatten": "flatten",
    "layer_norm": "layer_norm", "batch_norm": "batch_norm",
}

#: TensorFlow op types -> canonical type (``MatMul`` is decided by its inputs).
TENSORFLOW_TYPES = {
    "Conv2D": "conv2d", "DepthwiseConv2dNative": "depthwise_conv2d",
    "BatchMatMul": "matmul", "BatchMatMulV2": "matmul", "BatchMatMulV3": "matmul",
    "Relu": "relu", "AddV2": "add", "Add": "add", "Mul": "mul", "MaxPool": "max_pool2d",
    "AvgPool": "avg_pool2d", "Softmax": "softmax", "Reshape": "reshape",
    "FusedBatchNormV3": "batch_norm", "BiasAdd": "bias_add",
}

#: Canonical types whose op takes a weight, and its input position.
WEIGHT_INPUTS = {"conv2d": 1, "depthwise_conv2d": 1, "linear": 1}

# TF backward ops computing a convolution's filter gradient (output 0).
_TF_FILTER_GRADS = frozenset({"Conv2DBackpropFilter", "Conv2DBackpropFilterV2",
                              "DepthwiseConv2dNativeBackpropFilter"})
# Ops a TF weight passes through between its variable and its reader.
_TF_VARIABLE_READS = frozenset({"ReadVariableOp", "VariableV2", "VarHandleOp"})
_TF_PASS_THROUGH = frozenset({"Identity", "Cast"})


def _weight_layout(backend, op_type):
    if WEIGHT_INPUTS.get(op_type) is None:
        return None
    spec = mapping_tables.TABLE.get(op_type, {}).get(backend)
    return None if spec is None else spec.layout("weight")


def canonical_type(name, table):
    """The canonical type for a backend op name.

    Args:
        name: the backend's op name (``"conv2d"``, ``"Conv2D"``).
        table: that backend's name -> type table.

    Returns:
        The table's entry, else ``name`` in snake case.
    """
    found = table.get(name)
    if found is not None:
        return found
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


# -- PyTorch -------------------------------------------------------------------------


def pytorch_rule(context):
    """Set ``type``, ``weight_input`` and, in backward contexts,
    ``backward_type`` and ``weight_grad`` on a PyTorch context."""
    op = context.get_op()
    op_type = None if op is None else canonical_type(op.__name__, PYTORCH_TYPES)
    context["type"] = op_type
    context["weight_input"] = WEIGHT_INPUTS.get(op_type)
    context["weight_layout"] = _weight_layout("pytorch", op_type)
    if context.is_backward():
        context["backward_type"] = None if op_type is None else f"{op_type}_backward"
        context["weight_grad"] = _pytorch_weight_grad(op_type, context.get_backward_op().__name__)


def _pytorch_weight_grad(op_type, backward_name):
    # ConvolutionBackward0 returns (input, weight, bias) gradients; a linear
    # layer's weight gradient leaves AddmmBackward0/MmBackward0 transposed
    # and TBackward0 turns it back into the weight's layout.
    if op_type == "conv2d" and backward_name == "ConvolutionBackward0":
        return 1
    if op_type == "linear" and backward_name == "TBackward0":
        return 0
    return None


def pytorch_weight_rule(context):
    """Set ``weight`` (NumPy copy) and ``as_tensor`` on forward PyTorch
    contexts of ops with a weight. Runs after `pytorch_rule`."""
    position = context.get("weight_input")
    if context.is_backward() or position is None or "weight" in context:
        return
    weight = context.get_inputs()[position]
    context["weight"] = weight.detach().cpu().numpy().copy()
    context["as_tensor"] = support_for("pytorch").as_tensor_like(weight)


# -- TensorFlow ----------------------------------------------------------------------


def tensorflow_rule(context):
    """Set ``type``, ``weight_input`` and, in backward contexts,
    ``backward_type`` and ``weight_grad`` on a TensorFlow context."""
    op = context.get_op()
    op_type = None if op is None else _tf_type(op)
    context["type"] = op_type
    context["weight_input"] = WEIGHT_INPUTS.get(op_type)
    layout = _weight_layout("tensorflow", op_type)
    if op_type == "linear" and op.get_attr("transpose_b"):
        layout = "OI"
    context["weight_layout"] = layout
    if context.is_backward():
        context["backward_type"] = None if op_type is None else f"{op_type}_backward"
        context["weight_grad"] = _tf_weight_grad(op_type, op, context.get_backward_op())


def _tf_type(op):
    if op.type == "MatMul":
        return "linear" if _reads_variable(op.inputs[1]) else "matmul"
    return canonical_type(op.type, TENSORFLOW_TYPES)


def _reads_variable(tensor):
    """Whether ``tensor`` is a variable's value (through Identity/Cast)."""
    op = tensor.op
    while op.type in _TF_PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op.type in _TF_VARIABLE_READS


def _tf_weight_grad(op_type, forward, backward):
    if op_type in ("conv2d", "depthwise_conv2d") and backward.type in _TF_FILTER_GRADS:
        return 0
    if op_type == "linear" and backward.type == "MatMul":
        # MatMul's gradient function makes two MatMuls: the one reading the
        # activation (input 0) computes the weight's gradient, the one reading
        # the weight computes the activation's
        # (names, not ``in``: ``==`` on a graph tensor would add an op)
        reads = {t.name for t in backward.inputs}
        if forward.inputs[0].name in reads and forward.inputs[1].name not in reads:
            return 0
    return None


def tensorflow_weight_rule(context):
    """Set ``weight`` and ``as_tensor`` on forward TensorFlow contexts of ops
    with a weight, evaluating the weight in the session (or ``tf.function``
    call) being rewritten. Runs after `tensorflow_rule`."""
    position = context.get("weight_input")
    if context.is_backward() or position is None or "weight" in context:
        return
    import amanda
    weight = np.asarray(amanda.evaluate(context.get_inputs()[position]))
    context["weight"] = weight
    dtype = weight.dtype
    context["as_tensor"] = lambda array: np.asarray(array, dtype=dtype)


# -- ONNX ----------------------------------------------------------------------------

#: ONNX op types -> canonical type (``MatMul``/``Gemm``/``Gather`` are decided
#: by whether their weight input is an initializer).
ONNX_TYPES = {name: spec.canonical for name, spec in mapping_tables.backend_ops("onnx").items()}
ONNX_TYPES.update({"Relu": "relu", "Add": "add", "Mul": "mul"})


def _onnx_initializer(context, position):
    """The initializer (an ``onnx.TensorProto`` holder) feeding input
    ``position`` of the context's node, or None."""
    ir_op = context.get_ir_op()
    if ir_op is None or position >= len(ir_op.inputs):
        return None
    return support_for("onnx").initializer(ir_op.inputs[position])


def onnx_rule(context):
    """Set ``type``, ``weight_input`` and ``weight_layout`` on an ONNX context
    (ONNX graphs are inference graphs: there are no backward contexts)."""
    node = context.get_op()
    op_type = None if node is None else _onnx_type(context, node)
    context["type"] = op_type
    context["weight_input"] = WEIGHT_INPUTS.get(op_type)
    layout = _weight_layout("onnx", op_type)
    if op_type == "linear" and node.op_type == "Gemm" and _onnx_attr(node, "transB", 0):
        layout = "OI"
    context["weight_layout"] = layout
    if context.is_backward():
        context["backward_type"] = None if op_type is None else f"{op_type}_backward"
        context["weight_grad"] = None


def _onnx_attr(node, name, default):
    return support_for("onnx").node_attribute(node, name, default)


def _onnx_type(context, node):
    if node.op_type in ("MatMul", "Gemm"):
        return "linear" if _onnx_initializer(context, 1) is not None else "matmul"
    if node.op_type == "Gather":
        return "embedding" if _onnx_initializer(context, 0) is not None else "gather"
    return canonical_type(node.op_type, ONNX_TYPES)


def onnx_weight_rule(context):
    """Set ``weight`` (the initializer's value) and ``as_tensor`` on ONNX
    contexts of ops with a weight. Runs after `onnx_rule`."""
    position = context.get("weight_input")
    if context.is_backward() or position is None or "weight" in context:
        return
    initializer = _onnx_initializer(context, position)
    if initializer is not None:
        weight = np.asarray(initializer.to_numpy())
    else:
        import amanda
        weight = np.asarray(amanda.evaluate(context.get_inputs()[position]))
    context["weight"] = weight
    dtype = weight.dtype
    context["as_tensor"] = lambda array: np.asarray(array, dtype=dtype)


#: Types and positions for every backend: ``MappingTool(rules=RULES)``.
RULES = [["pytorch", pytorch_rule], ["tensorflow", tensorflow_rule], ["onnx", onnx_rule]]

#: `RULES` plus weight values: ``MappingTool(rules=WEIGHT_RULES)``.
WEIGHT_RULES = RULES + [["pytorch", pytorch_weight_rule], ["tensorflow", tensorflow_weight_rule],
                        ["onnx", onnx_weight_rule]]
