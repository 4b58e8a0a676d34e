"""Names of TensorFlow gradient ops: the rules ``tf.gradients`` and
``GradientTape`` follow when they name the ops they build, and the op
types that tell a gradient kernel or a backward function.

Used by `amanda.frontends.tensorflow.gradients` (which owner each gradient
op has) and `amanda.frontends.tensorflow.tape` (the tape's data-flow
rules).
"""

from __future__ import annotations

import re

from amanda.ir import Graph

_GRAD_ROOT = re.compile(r"gradients(_\d+)?\Z")
_GRAD_SCOPE = re.compile(r"(.+)_grad(_\d+)?\Z")
_GRAD_YS = re.compile(r"grad_ys_\d+\Z")
_TAPE_ROOT = "gradient_tape"
_GRAD_KERNEL = re.compile(r"(.+?)(?:BackpropInput|BackpropFilter|Backprop|GradWithArgmax|GradGrad|Grad)(?:V\d+)?\Z")
_VERSION_SUFFIX = re.compile(r"V\d+\Z")
_CALL_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_SEED_TYPES = frozenset({"Const", "Fill", "ZerosLike", "OnesLike"})
# Ops whose gradient makes no op (or that have none): never owners of tape ops.
_NO_GRADIENT_TYPES = frozenset({
    "Placeholder", "PlaceholderWithDefault", "Const", "NoOp", "VarHandleOp", "VariableV2",
    "ReadVariableOp", "Identity", "IdentityN", "StopGradient", "PreventGradient",
    "Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "VarIsInitializedOp",
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
})


def _tf_gradients_match(op_name, op_names):
    """``(root, owner)`` for a name in a ``tf.gradients`` scope, else None.

    ``tf.gradients`` names its ops ``[<scope>/]gradients[_<k>]/<forward op>_grad/...``
    (per forward op) or ``.../gradients[_<k>]/<op>`` (seed, aggregation).
    The owner is the first ``<prefix>_grad`` component under the root whose
    ``<prefix>`` names an existing op; None if there is none.
    """
    comps = op_name.split("/")
    for i in range(len(comps) - 1):
        if not _GRAD_ROOT.match(comps[i]):
            continue
        rest = comps[i + 1 :]
        root = "/".join(comps[: i + 1])
        for j in range(len(rest) - 1):
            match = _GRAD_SCOPE.match(rest[j])
            if match:
                candidate = "/".join(rest[:j] + [match.group(1)])
                if candidate != op_name and candidate in op_names:
                    return root, candidate
        return root, None
    return None


def forward_op_of(op_name, op_names):
    """The forward op a ``tf.gradients`` op differentiates, from names alone.

    ``gradients/conv1/Conv2D_grad/Conv2DBackpropFilter`` -> ``conv1/Conv2D``
    (also ``gradients_1/...`` and an enclosing name scope). The answer is
    always a member of ``op_names``.

    ``GradientTape`` ops (``gradient_tape/<forward name scope>/...``) name only
    the forward op's name scope, which several ops may share; their owners are
    found from data flow by `gradient_owners` / `map_gradients`, and this
    function returns None for them.

    Args:
        op_name: A TF op name.
        op_names: The names of the graph's ops (a set is fastest).

    Returns:
        The forward op name, or None.
    """
    if not isinstance(op_names, (set, frozenset, dict)):
        op_names = set(op_names)
    match = _tf_gradients_match(op_name, op_names)
    return None if match is None else match[1]


def _inside_a_gradient_function(name):
    """Whether ``name`` lies in the scope of one gradient function.

    ``gradient_tape/<scope>/...`` or ``[...]gradients[_<k>]/.../<op>_grad/...``;
    seeds (``ones``, ``gradients/grad_ys_0``, ``gradients/Fill``) do not.
    """
    comps = name.split("/")
    if comps[0] == _TAPE_ROOT:
        return len(comps) > 2
    return any(_GRAD_ROOT.match(c) for c in comps) and any(_GRAD_SCOPE.match(c) for c in comps[:-1])


def _grad_kernel_base(op_type):
    match = _GRAD_KERNEL.match(op_type)
    if match is None:
        return None
    return _VERSION_SUFFIX.sub("", match.group(1))


def _is_backward_function(value):
    if isinstance(value, Graph):
        name = value.name
    elif isinstance(value, dict):
        name = value.get("function", "")
    else:
        return False
    return "__backward_" in name
