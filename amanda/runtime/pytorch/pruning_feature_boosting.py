"""The PyTorch part of the feature boosting and suppression project
(:mod:`amanda.tools.pruning_projects.feature_boosting`): its saliency
predictors are torch modules. Reached through
:func:`amanda.runtime.tool_support.support_for` (``"pytorch"``); counted with
the tool in the project's lines of code (``benchmarks/pruning_projects.py``).
Importing this module does not import torch.
"""

from __future__ import annotations

__all__ = ["new_predictor", "wta_gate", "fbs_saliency"]


def new_predictor(in_channels, out_channels, index, seed=0):
    """The saliency predictor of the ``index``-th gated convolution: a linear
    layer with a uniform(±1/sqrt(in)) weight from a generator seeded with
    ``seed + index`` and a bias of 1 (every channel starts salient)."""
    import torch
    generator = torch.Generator().manual_seed(seed + index)
    predictor = torch.nn.Linear(in_channels, out_channels)
    with torch.no_grad():
        bound = in_channels ** -0.5
        predictor.weight.copy_(torch.rand(out_channels, in_channels, generator=generator)
                               * 2 * bound - bound)
        predictor.bias.fill_(1.0)
    return predictor


def wta_gate(saliency, density):
    """Winner-take-all: the saliencies with all but the ``round(density * C)``
    largest of each row zeroed; returns ``(gate, mask)``."""
    import torch
    keep = max(1, round(density * saliency.shape[1]))
    top = saliency.topk(keep, dim=1).indices
    mask = torch.zeros_like(saliency).scatter_(1, top, 1.0)
    return saliency * mask, mask


def fbs_saliency(predictor, x):
    """``relu(predictor(avgpool(x)))``: one saliency per output channel and
    sample of a convolution whose input is ``x`` ``(N, C, H, W)``."""
    import torch
    return torch.relu(predictor(x.mean((2, 3))))
