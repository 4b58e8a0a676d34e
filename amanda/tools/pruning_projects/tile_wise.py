"""Tile-wise sparsity (Guo et al., SC'20), static, as an amanda tool.

Algorithm: a layer's weight is viewed as the GEMM matrix ``B`` of shape
``(K, N)`` — ``N`` output channels, ``K`` the rest (input channels times the
kernel window). The columns are cut into tiles of ``tile`` consecutive output
channels; inside each tile, the ``round(sparsity * K)`` rows whose L1 norm over
the tile's columns is smallest are pruned. Each tile keeps a dense
``(K', tile)`` sub-matrix, which is what lets a dense GEMM kernel skip the
pruned rows tile by tile. The importance score is the weight's magnitude (the
original also offers a Taylor score; the pattern is the same).

The tool is :class:`~amanda.tools.pruning.Pruner` with this mask: the weight is
masked as the op reads it and its gradient is masked, on PyTorch eager and on
TensorFlow graphs (where the original ran, through session hooks); the mask is
computed once, from the weight at the op's first execution / at rewrite time.
"""

from __future__ import annotations

import numpy as np

from amanda.tools.pruning import Pruner

__all__ = ["TileWisePruner", "tile_mask"]


def tile_mask(weight, sparsity, out_axis, tile=16):
    """The tile-wise mask of ``weight`` (NumPy, any layout).

    Args:
        weight: the weight array.
        sparsity: fraction of rows pruned in every tile.
        out_axis: the output-channel axis (the GEMM's ``N``).
        tile: output channels per tile (the last tile may be narrower).

    Returns:
        A float mask of ``weight``'s shape.
    """
    moved = np.moveaxis(np.abs(np.asarray(weight, np.float64)), out_axis, -1)
    matrix = moved.reshape(-1, moved.shape[-1])
    mask = np.ones(matrix.shape, np.float32)
    pruned = int(np.round(sparsity * matrix.shape[0]))
    for start in range(0, matrix.shape[1], tile):
        scores = matrix[:, start:start + tile].sum(axis=1)
        mask[np.argsort(scores, kind="stable")[:pruned], start:start + tile] = 0
    return np.moveaxis(mask.reshape(moved.shape), -1, out_axis).astype(
        weight.dtype if weight.dtype.kind == "f" else np.float32)


class TileWisePruner(Pruner):
    """Static tile-wise pruning of every convolution and linear layer.

    Args:
        sparsity: fraction of each tile's rows to prune.
        tile: output channels per tile.
        select: optional ``select(context) -> bool`` (e.g. keep the classifier).

    Example::

        pruner = TileWisePruner(sparsity=0.5, tile=16)
        with amanda.apply(pruner):
            session.run(train_op, feed)      # or: loss = model(x); loss.backward()
    """

    def __init__(self, sparsity=0.5, tile=16, select=None):
        super().__init__("unstructured", sparsity=sparsity, select=select)
        self.tile = tile
        self.pattern_name = f"tile-wise (tile {tile})"

    def compute_mask(self, weight, layer):
        return tile_mask(weight, self.sparsity, layer.axes[0], self.tile)
