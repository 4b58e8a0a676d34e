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

Keys set by `type_rule` (``RULES``), on every backend with a vocabulary:

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

Added by `weight_rule` (``WEIGHT_RULES``), in forward contexts of ops with
a weight:

* ``"weight"``: the weight's current value, a NumPy array in the backend's
  layout (PyTorch ``OIHW`` and ``(out, in)``; TF ``HWIO`` and ``(in, out)``).
* ``"as_tensor"``: a function converting a NumPy array to what the
  backend's instrumentation routines receive (a torch tensor on the weight's
  device and dtype; a NumPy array of the weight's dtype in TF), so a routine
  like ``lambda weight, mask: weight * mask`` works on both.

What only a backend knows (which op names are which canonical type, how a
``MatMul`` is told from a ``linear``, where a weight's gradient leaves a
backward op, how a weight is read) comes from the backend's vocabulary
(:mod:`amanda.runtime.vocabulary`, one module per backend in its package)
and tool support (:mod:`amanda.runtime.tool_support`), asked with the
context's namespace; weights no backend reads directly (TF variables) are
read with ``amanda.evaluate``. The rules import no framework.
The per-backend names of earlier versions (``pytorch_rule``,
``tensorflow_weight_rule``...) are the same two rules.
"""

from __future__ import annotations

import numpy as np

from amanda.runtime import vocabulary
from amanda.runtime.tool_support import support_for

__all__ = [
    "RULES", "WEIGHT_INPUTS", "WEIGHT_RULES", "canonical_type", "onnx_rule", "onnx_weight_rule",
    "pytorch_rule", "pytorch_weight_rule", "tensorflow_rule", "tensorflow_weight_rule",
    "type_rule", "weight_rule",
]

#: Canonical types whose op takes a weight, and its input position.
WEIGHT_INPUTS = {"conv2d": 1, "depthwise_conv2d": 1, "linear": 1}


def canonical_type(name, table):
    """The canonical type for a backend op name.

    Args:
        name: the backend's op name (``"conv2d"``, ``"Conv2D"``).
        table: a name -> type table (a backend vocabulary's ``TYPES``).

    Returns:
        The table's entry, else ``name`` in snake case.
    """
    found = table.get(name)
    return found if found is not None else vocabulary.snake_case(name)


def type_rule(context):
    """Set ``type``, ``weight_input``, ``weight_layout`` and, in backward
    contexts, ``backward_type`` and ``weight_grad``, from the vocabulary of
    the context's backend (nothing on a backend without one)."""
    words = vocabulary.of(context.namespace)
    if words is None:
        return
    op = context.get_op()
    op_type = None if op is None else words.op_type(context, op)
    context["type"] = op_type
    context["weight_input"] = WEIGHT_INPUTS.get(op_type)
    layout = None
    if op_type in WEIGHT_INPUTS:
        spec = vocabulary.row(context.namespace, op_type)
        layout = words.weight_layout(op, op_type, None if spec is None else spec.layout("weight"))
    context["weight_layout"] = layout
    if context.is_backward():
        context["backward_type"] = None if op_type is None else f"{op_type}_backward"
        context["weight_grad"] = words.weight_grad(op_type, op, context.get_backward_op())


def weight_rule(context):
    """Set ``weight`` (a NumPy copy of its current value, in the backend's
    layout) and ``as_tensor`` on forward contexts of ops with a weight. The
    backend reads the weight where it can (a PyTorch parameter, an ONNX
    initializer); otherwise it is evaluated (``amanda.evaluate``, in the
    session or ``tf.function`` call being rewritten). Runs after `type_rule`."""
    position = context.get("weight_input")
    if context.is_backward() or position is None or "weight" in context:
        return
    support = support_for(context.namespace)
    read = None if support is None else support.weight_value(context, position)
    if read is None:
        import amanda
        weight = np.asarray(amanda.evaluate(context.get_inputs()[position]))
        dtype = weight.dtype
        read = weight, (lambda array: np.asarray(array, dtype=dtype))
    context["weight"], context["as_tensor"] = read


#: the rules of earlier versions, one per backend: the same two rules
pytorch_rule = tensorflow_rule = onnx_rule = type_rule
pytorch_weight_rule = tensorflow_weight_rule = onnx_weight_rule = weight_rule

#: Types and positions for every backend: ``MappingTool(rules=RULES)``
#: (the empty namespace prefix matches every context).
RULES = [["", type_rule]]

#: `RULES` plus weight values: ``MappingTool(rules=WEIGHT_RULES)``.
WEIGHT_RULES = RULES + [["", weight_rule]]
