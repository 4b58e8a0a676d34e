"""Block-Skim-style attention pruning the original's way: BERT's attention
source edited (``modeling_bert.eager_attention_forward`` replaced by a copy
that skips key blocks of small attention mass)."""

import contextlib

import torch
from torch import nn
from transformers.models.bert import modeling_bert

MASKS = []


def skimmed_attention_forward(module, query, key, value, attention_mask, scaling=None,
                              dropout=0.0, block=4, threshold=0.5, **kwargs):
    """BERT's eager attention with the block-skim edit after the softmax."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    # -- the edit: skip key blocks with little attention mass
    batch, heads, queries, keys = attn_weights.shape
    share = attn_weights.detach().sum(dim=(1, 2)) / (heads * queries)
    mass = share.reshape(batch, keys // block, block).sum(-1)
    keep = (mass >= threshold * block / keys).to(attn_weights.dtype)
    keep = keep.repeat_interleave(block, dim=1).reshape(batch, 1, 1, keys)
    MASKS.append(keep)
    attn_weights = attn_weights * keep
    attn_weights = attn_weights / attn_weights.sum(-1, keepdim=True).clamp_min(1e-12)
    # -- end of the edit
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


@contextlib.contextmanager
def block_skim_bert(block=4, threshold=0.5):
    """BERT runs with the edited attention inside the block."""
    original = modeling_bert.eager_attention_forward

    def edited(*args, **kwargs):
        return skimmed_attention_forward(*args, block=block, threshold=threshold, **kwargs)

    modeling_bert.eager_attention_forward = edited
    try:
        yield MASKS
    finally:
        modeling_bert.eager_attention_forward = original
