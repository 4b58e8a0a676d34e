"""Effective path: each backend's op parameters in the rules' canonical form, and the
values a step's routines kept (`StepValues`).

Each backend's vocabulary (:mod:`amanda.runtime.vocabulary`) maps a
canonical op type to a reader returning the parameters a rule of
:mod:`amanda.tools.effective_path_rules` needs (strides, pads, dilations,
axes...), whatever the backend calls them (its ``PARAM_READERS``);
:data:`PARAM_READERS` shows them by backend. :func:`_canonical_call` runs a
rule on canonical layouts and moves the masks back to the backend's.
"""

from __future__ import annotations

import numpy as np

from amanda.errors import ToolError
from amanda.runtime import vocabulary
from amanda.runtime.tool_support import support_for
from amanda.tools import mapping_tables
from amanda.tools.effective_path_rules import OpValues

__all__ = ["PARAM_READERS"]

#: ``backend -> {canonical type: reader(op, input values) -> params}``, the
#: readers of the backends' vocabularies (a namespace's backend is its first part)
PARAM_READERS = {name: vocabulary.of(name).PARAM_READERS
                 for name in vocabulary.backends_with_vocabulary()}


def _params(op, op_type, values):
    """The parameters of IR op ``op`` (of canonical type ``op_type``) its
    backend's reader gives, ``{}`` without one.

    Raises:
        ToolError: the op is in a form the readers do not cover.
    """
    words = vocabulary.of(op.namespace)
    if words is None:
        return {}
    try:
        words.check_params(op)
        reader = words.PARAM_READERS.get(op_type)
        return {} if reader is None else reader(op, values)
    except vocabulary.Unsupported as error:
        raise ToolError(f"effective path: {error}", op_name=op.name,
                        namespace=op.namespace) from None


# Where rules see weights: PyTorch's layouts.
_CANONICAL_WEIGHT = {4: "OIHW", 2: "OI"}


def _canonical_call(rule, v, layouts):
    """Run ``rule`` on canonical layouts (activations NCHW, weights OIHW/OI)
    and give input masks back in the backend's layouts; synapses stay
    canonical. ``layouts``: role (``input``, ``weight``) -> backend layout,
    from the mapping tables."""
    inputs = list(v.inputs)
    activation = layouts.get("input")
    moved = activation not in (None, "NCHW") and len(activation) == 4 and np.ndim(inputs[0]) == 4
    output, mask = v.output, v.mask
    if moved:
        inputs[0] = mapping_tables.convert_layout(inputs[0], activation, "NCHW")
        output = mapping_tables.convert_layout(output, activation, "NCHW")
        mask = mapping_tables.convert_layout(mask, activation, "NCHW")
    weight = layouts.get("weight")
    if weight == "HWIM" and len(inputs) > 1 and np.ndim(inputs[1]) == 4:
        # a depthwise filter (TF): output channel c * M + m reads channel c,
        # i.e. a grouped OIHW filter (C * M, 1, H, W), PyTorch's depthwise layout
        kh, kw, channels, multiplier = np.shape(inputs[1])
        inputs[1] = np.transpose(inputs[1], (2, 3, 0, 1)).reshape(
            channels * multiplier, 1, kh, kw)
    elif weight is not None and len(inputs) > 1 and np.ndim(inputs[1]) == len(weight):
        inputs[1] = mapping_tables.convert_layout(inputs[1], weight,
                                                  _CANONICAL_WEIGHT[len(weight)])
    result = rule(OpValues(v.op, v.type, inputs, output, mask, v.params, v.theta, v.constant))
    if result is not None and moved and 0 in result.inputs:
        result.inputs[0] = mapping_tables.convert_layout(result.inputs[0], "NCHW", activation)
    return result


def stable_op_key(op):
    """The stable op id of an IR op (what ``context.get_op_id()`` returned
    for it): the backend says; the op name by default."""
    support = support_for(op.namespace)
    return op.name if support is None else support.stable_op_id(op)


class StepValues:
    """``value_of`` for a step: the NumPy copies the tool's routines kept, by
    stable op id; graph inputs through the ops reading them."""

    def __init__(self, values):
        self.values = values
        self.cache = {}

    def __call__(self, tensor):
        found = self.cache.get(tensor)
        if found is not None:
            return found
        if tensor.producer is not None:
            entry = self.values.get(stable_op_key(tensor.producer))
            value = entry[1][tensor.index] if entry and tensor.index < len(entry[1]) else None
        else:
            value = None
            for op, position in tensor.uses:
                entry = self.values.get(stable_op_key(op))
                if entry and position < len(entry[0]):
                    value = entry[0][position]
                    break
        if value is not None:
            self.cache[tensor] = value
        return value
