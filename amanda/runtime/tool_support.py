"""Backend knowledge the built-in tools need, reached by namespace.

Tools are written against canonical keys and the public API; where they must
know something only a backend knows (where an op sits in the model, how a
frontend encoded an op's arguments, which ONNX element types a hosted
routine can receive), they ask the backend's *tool-support module* through
:func:`support_for`. One module per backend, named by the ``tool_support``
part of its descriptor (:mod:`amanda.runtime.backends`) and imported on
first use: a context of a backend only exists once its framework is loaded,
and the support modules themselves import their framework only inside the
functions that need it.

Every support module exposes:

* ``module_path_from_op(context)`` -> str or None: the module path of the
  context's op where the runtime recorded none (see :func:`module_path_from_op`);
* ``MODULE_PATH_SEPARATOR``: how module paths are joined (``.``, TF ``/``);
* ``is_whole_graph(graph)`` -> bool: whether a lifted IR graph is a whole
  program rather than a step traced op by op;
* ``stable_op_id(op)``: the id ``context.get_op_id()`` gives the IR op;
* ``backward_flop_factor(backward_op)`` -> int: forward-FLOPs a backward op
  is charged (0: not counted);
* ``backward_flop_operands(backward_op)`` -> tuple or None: the positions of
  the backward op's gradients that each cost the forward op's FLOPs when
  computed (PyTorch: a product's operands, of which autograd computes only
  those some input needs); None: the fixed factor applies;
* ``OTHER_BACKWARD_FLOPS``, ``ANALYSED_PER_CALL_SITE``,
  ``COUNTS_AT_RUN_TIME``: how the FLOPs profiler counts on this backend (the
  backward formulas of ops other than products apply to its backward ops;
  analysis runs once per call site, so counts are checked against each
  execution's shapes; ops without static shapes are counted from the arrays
  their routines receive, ``hosted(value)`` saying which can reach one);
* ``static_shape(value)`` -> tuple or None: the static shape of a value
  without a ``shape`` attribute (an ONNX ``ValueInfoProto``);
* ``trainable_parameters(inputs)`` -> ``{key: element count}`` of the op
  inputs that are trainable parameters;
* ``weight_value(context, position)`` -> ``(NumPy copy, as_tensor)`` of
  the weight the op reads at input ``position`` where the backend reads it
  itself (a PyTorch parameter, an ONNX initializer), else None (the caller
  evaluates it);
* ``accumulates_gradient(backward_op)`` -> bool: whether a backward op only
  stores a leaf's gradient (PyTorch's ``AccumulateGrad``): no arithmetic of
  the op that used the leaf (FLOPs, the op profiler's own row);
* ``parameter_operand(context, position)`` -> ``(NumPy copy, as_tensor)``
  of a matrix product's operand that is a 2-D parameter, else None, and
  ``operand_grad(backward_op)`` -> the position of its gradient (pruning);
* ``is_weight_input(tensor)`` -> bool: whether a lifted graph's input is a
  weight (an ONNX initializer, a captured PyTorch parameter);
* ``ROUTINES_ORDERED_BY_DATAFLOW``: whether a routine runs in order with
  its op only through the tensors it hands back (ONNX).

What a backend's ops are (canonical types, input roles, layouts, attribute
names) is its *vocabulary*, a module of its own (:mod:`amanda.runtime.vocabulary`).

Backend-specific helpers (``pytorch.tools.call_arguments``,
``onnx.tools.node_attribute``, ...) are documented in each module.
"""

from __future__ import annotations

from amanda.runtime import backends

__all__ = ["for_value", "module_path_from_op", "provider", "support_for"]


def support_for(namespace):
    """The tool-support module of a backend, or None for an unknown one.

    Args:
        namespace: a context namespace (``"onnx/21/graph"``) or a backend
            name (``"onnx"``); None or ``""`` is unknown.

    Returns:
        The module (imported on first use), or None.
    """
    backend = backends.for_namespace(namespace)
    return None if backend is None else backend.part("tool_support")


def for_value(value):
    """The tool-support module of the backend whose tensor (or model)
    ``value`` is (``torch.Tensor``, ``torch.nn.Module``: PyTorch's), or
    None for a NumPy array or any value no backend claims."""
    backend = backends.for_value(value)
    return None if backend is None else backend.part("tool_support")


def provider(name):
    """The tool-support module of the first registered backend offering
    ``name``, a capability only some backend has (PyTorch's
    ``kernel_profiler``, ONNX's ``tensor_values``), or None. Loading the
    modules imports no framework."""
    for backend in backends.all_backends():
        support = None if backend.tool_support is None else backend.part("tool_support")
        if support is not None and hasattr(support, name):
            return support
    return None


def module_path_from_op(context):
    """The module path the backend derives from the context's op, for
    :meth:`amanda.OpContext.get_module_path` when the runtime recorded none.

    - PyTorch: None (the runtime records the path of every op run inside a
      module, so an op without one is outside every module).
    - TensorFlow: the op's name scope, ``/``-separated (``"dense_1"`` for
      ``"dense_1/MatMul"``); for a backward context without a forward op,
      the backward op's name scope.
    - ONNX: the module path a PyTorch exporter encoded in the node name
      (``onnx.tools.onnx_module_path``).

    Args:
        context: an :class:`amanda.OpContext`, forward or backward.

    Returns:
        The path, or None when the op is outside any module or the backend
        is unknown.
    """
    support = support_for(context.namespace)
    return None if support is None else support.module_path_from_op(context)
