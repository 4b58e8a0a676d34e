"""Dynamic channel pruning by feature boosting and suppression (Gao et al.,
ICLR'19), as an amanda tool (PyTorch only: its saliency predictors are torch
modules trained with the model: ``new_predictor``, ``fbs_saliency`` and the
winner-take-all ``wta_gate`` are in
:mod:`amanda.runtime.pytorch.pruning_feature_boosting`, reached through the
PyTorch tool-support module).

Algorithm: every convolution gets a small saliency predictor. For an input
``x`` of ``C`` channels, the predictor computes ``s = relu(W · avgpool(x) + b)``
(one saliency per output channel and sample); a winner-take-all keeps the
``round(density * C_out)`` largest saliencies of each sample and zeroes the
rest. The convolution's output is multiplied channel-wise by the kept
saliencies: the suppressed channels are zero (their computation can be
skipped) and the kept ones are boosted by their saliency. The predictors train
with the network (the gate is differentiated like model code).

The original edits each network's source (every conv becomes a gated conv);
this tool observes each convolution's input before the op and gates its output
after it, so it runs unchanged on any PyTorch model. The predictors are
created at each convolution's first execution; hand :meth:`parameters` to the
optimizer after a first forward.
"""

from __future__ import annotations

import amanda
from amanda.runtime.tool_support import for_value, support_for
from amanda.tools import mapping_rules
from amanda.tools.mapping import MappingTool

__all__ = ["FeatureBoosting"]


class FeatureBoosting(amanda.Tool):
    """Feature boosting and suppression on every 2-D convolution.

    Args:
        density: fraction of each convolution's output channels kept per sample.
        seed: seed of the predictors' initial weights.

    Attributes:
        predictors: op key -> the convolution's saliency predictor.
        masks: op key -> the channel mask of the last execution, ``(N, C_out)``.
    """

    def __init__(self, density=0.5, seed=0):
        super().__init__()
        self.density, self.seed = density, seed
        self.predictors, self.masks = {}, {}
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.add_inst_for_op(self.forward_analysis)

    def parameters(self):
        """The predictors' parameters (train them with the model's)."""
        return [p for predictor in self.predictors.values() for p in predictor.parameters()]

    def forward_analysis(self, context):
        if context.get("type") != "conv2d" or context.get_inputs()[1].dim() != 4:
            return
        key = (context.namespace, context.get_op_id())
        weight = context.get_inputs()[1]
        if key not in self.predictors:
            self.predictors[key] = support_for(context.namespace).new_predictor(
                weight.shape[1], weight.shape[0], len(self.predictors), self.seed)
        slot = {"key": key}
        with amanda.ad_enabled():     # the gate trains the predictor and the model
            context.insert_before_op(self.remember_input, inputs=[0], slot=slot)
            context.insert_after_op(self.gate_output, outputs=[0], slot=slot)

    def remember_input(self, x, slot):
        """Keep the convolution's input for the gate after it."""
        slot["input"] = x

    def gate_output(self, y, slot):
        """The convolution's output times the winner-take-all saliencies."""
        support = for_value(y)
        saliency = support.fbs_saliency(self.predictors[slot["key"]], slot.pop("input"))
        gate, mask = support.wta_gate(saliency, self.density)
        self.masks[slot["key"]] = mask.detach()
        return y * gate[:, :, None, None]
