"""Vector-wise 2:4 pruning as NVIDIA APEX's ASP does it, as an amanda tool.

Algorithm (ASP's ``m4n2_1d``): the weight is cut into vectors of 4
consecutive input channels (for a convolution, at each output channel and
kernel position); of the six ways to keep 2 of 4, ASP keeps the one with the
largest sum of magnitudes (the first such pattern on ties). ASP prunes only
layers with a supported module type whose output dimension is a multiple of
8 and input dimension a multiple of 16 (what sparse tensor cores accept); the
rest stay dense. Masks are computed once, from the trained weights.

ASP edits the weights in place and patches ``optimizer.step`` to re-apply the
masks; this tool instead masks each weight as its op reads it and masks its
gradient (:class:`~amanda.tools.pruning.Pruner`), so it needs neither the
module API nor the optimizer and runs on every model and backend the mapping
rules cover, TensorFlow graphs included.
"""

from __future__ import annotations

import itertools

import numpy as np

from amanda.tools.pruning import Pruner

__all__ = ["VectorWisePruner", "m4n2_mask", "PATTERNS"]

#: the six 2-of-4 patterns, in ASP's order
PATTERNS = np.array([[1.0 if i in keep else 0.0 for i in range(4)]
                     for keep in itertools.combinations(range(4), 2)])


def m4n2_mask(weight, in_axis):
    """ASP's 2:4 mask along ``in_axis`` (NumPy, any layout; its length must
    be a multiple of 4)."""
    weight = np.asarray(weight)
    moved = np.moveaxis(np.abs(weight), in_axis, -1)
    groups = moved.reshape(-1, 4).astype(np.float64)
    mask = PATTERNS[np.argmax(groups @ PATTERNS.T, axis=1)]
    return np.moveaxis(mask.reshape(moved.shape), -1, in_axis).astype(np.float32)


class VectorWisePruner(Pruner):
    """2:4 vector-wise pruning of the layers ASP supports.

    Args:
        select: optional ``select(context) -> bool`` restricting the layers.

    Attributes:
        skipped: layers ASP's shape rule leaves dense, with the reason.
    """

    def __init__(self, select=None):
        super().__init__("2:4", select=select)
        self.pattern_name = "2:4 vector-wise (ASP)"

    def compute_mask(self, weight, layer):
        out_axis, in_axis = layer.axes
        if in_axis is None or weight.shape[out_axis] % 8 or weight.shape[in_axis] % 16:
            return None
        return m4n2_mask(weight, in_axis)
