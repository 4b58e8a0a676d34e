"""The PyTorch part of the activation-pruning project
(:mod:`amanda.tools.pruning_projects.activation`), reached through
:func:`amanda.runtime.tool_support.support_for` (``"pytorch"``). Counted with
the tool in the project's lines of code (``benchmarks/pruning_projects.py``).
Importing this module does not import torch.
"""

from __future__ import annotations

__all__ = ["activation_mask"]


def activation_mask(x, sparsity):
    """Per-sample mask of ``x`` (first axis = samples) keeping the values
    whose magnitude is above the ``round(sparsity * n)``-th smallest."""
    import torch
    flat = x.detach().abs().flatten(1)
    k = round(sparsity * flat.shape[1])
    if k < 1:
        return torch.ones_like(x)
    threshold = flat.kthvalue(k, dim=1, keepdim=True).values
    return (flat > threshold).to(x.dtype).view_as(x)
