"""Dynamic activation pruning, as an amanda tool (PyTorch only: its routines
build torch masks, with ``activation_mask`` of
:mod:`amanda.runtime.pytorch.pruning_activation`, reached through the PyTorch
tool-support module).

Algorithm: every activation (the output of each ReLU) is sparsified per
sample, at every step: with ``n`` values per sample, those whose magnitude is
not above the ``round(sparsity * n)``-th smallest magnitude of that sample are
zeroed (values tied with the threshold go too, so ReLU's exact zeros never
count against the budget). The same mask gates the activation's gradient in
the backward pass (the product ``x * mask`` is differentiated), so both
passes of the following layers see sparse tensors.

The original inserts a pruning call after every activation in each ResNet's
source; this tool finds the activations as ops and runs unchanged on any
PyTorch model.
"""

from __future__ import annotations

import amanda
from amanda.runtime.tool_support import for_value
from amanda.tools import mapping_rules
from amanda.tools.mapping import MappingTool

__all__ = ["ActivationPruner"]


class ActivationPruner(amanda.Tool):
    """Prune activations dynamically, forward and backward.

    Args:
        sparsity: fraction of each sample's activation values pruned (at least).
        op_types: canonical types whose output is pruned (ReLUs by default).

    Attributes:
        sparsities: op key -> the fraction of zeros of the last pruned output.
    """

    def __init__(self, sparsity=0.5, op_types=("relu",)):
        super().__init__()
        self.sparsity, self.op_types = sparsity, frozenset(op_types)
        self.sparsities = {}
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.add_inst_for_op(self.forward_analysis)

    def forward_analysis(self, context):
        if context.get("type") not in self.op_types:
            return
        with amanda.ad_enabled():   # the gradient is masked by the product's derivative
            context.insert_after_op(self.prune, outputs=[0],
                                    key=(context.namespace, context.get_op_id()))

    def prune(self, x, key):
        """``x`` with its pruned values zeroed."""
        pruned = x * for_value(x).activation_mask(x, self.sparsity)
        self.sparsities[key] = float((pruned == 0).float().mean())
        return pruned
