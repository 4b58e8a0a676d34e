"""Attention pruning in the style of Block-Skim (Guan et al., HPCA'22), as an
amanda tool.

Algorithm: in every self-attention layer, the key sequence is cut into blocks
of ``block`` tokens. A block's *attention mass* is the share of the layer's
attention that lands on it: the attention probabilities summed over heads,
queries and the block's keys, divided by ``heads * queries``. Blocks whose
mass is below ``threshold`` times a uniform block's share (``block / keys``)
are skipped for that sample: their attention probabilities become zero and
each query's remaining probabilities are renormalised, as if the block's
tokens had been removed from the layer's keys. Decisions are per sample and
per layer, at every step, and differentiated like model code in training.

The original edits each transformer's attention source; this tool finds the
attention probabilities as the output of a softmax over a square
``(batch, heads, queries, keys)`` score tensor, so one tool covers BERT,
RoBERTa, DistilBERT and ALBERT (with the eager attention).
"""

from __future__ import annotations

import amanda
from amanda.tools import mapping_rules
from amanda.tools.mapping import MappingTool

__all__ = ["BlockSkim", "skim_mask"]


def skim_mask(probs, block, threshold):
    """The kept-key mask ``(batch, 1, 1, keys)`` of attention ``probs``
    ``(batch, heads, queries, keys)``: 0 on the keys of skipped blocks."""
    batch, heads, queries, keys = probs.shape
    share = probs.detach().sum(dim=(1, 2)) / (heads * queries)
    mass = share.reshape(batch, keys // block, block).sum(-1)
    keep = (mass >= threshold * block / keys).to(probs.dtype)
    return keep.repeat_interleave(block, dim=1).reshape(batch, 1, 1, keys)


class BlockSkim(amanda.Tool):
    """Skip attention blocks with little attention mass.

    Args:
        block: tokens per block (layers whose length is not a multiple are left alone).
        threshold: a block is skipped when its mass is below ``threshold``
            times a uniform block's share.

    Attributes:
        masks: op key -> the kept-key mask of the last execution.
    """

    def __init__(self, block=4, threshold=0.5):
        super().__init__()
        self.block, self.threshold = block, threshold
        self.masks = {}
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.add_inst_for_op(self.forward_analysis, require_outputs=True)

    def forward_analysis(self, context):
        probs = context.get_outputs()[0] if context.get("type") == "softmax" else None
        if probs is None or probs.dim() != 4 or probs.shape[-1] != probs.shape[-2] \
                or probs.shape[-1] % self.block:
            return
        with amanda.ad_enabled():
            context.insert_after_op(self.skim, outputs=[0],
                                    key=(context.namespace, context.get_op_id()))

    def skim(self, probs, key):
        """The probabilities with skipped blocks removed and rows renormalised."""
        mask = skim_mask(probs, self.block, self.threshold)
        self.masks[key] = mask
        kept = probs * mask
        return kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)

    def skipped_fraction(self):
        """Fraction of (sample, layer, block) triples skipped at the last step."""
        masks = list(self.masks.values())
        return sum(float((m == 0).sum()) for m in masks) / max(1, sum(m.numel() for m in masks))
