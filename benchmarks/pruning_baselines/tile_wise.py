"""Tile-wise pruning the original's way: a TensorFlow ``SessionRunHook`` that
zeroes the pruned kernel entries in the variables after the session is
created and again after every training step (the Keras VGG-style model)."""

import numpy as np
import tensorflow as tf


def tile_mask_hwio(kernel, sparsity, tile):
    """Mask of a Keras kernel (HWIO conv or (in, out) dense): rows of the
    (K, N) GEMM matrix pruned tile by tile by their L1 norm."""
    matrix = np.abs(kernel.astype(np.float64)).reshape(-1, kernel.shape[-1])
    mask = np.ones(matrix.shape, np.float32)
    count = int(np.round(sparsity * matrix.shape[0]))
    for start in range(0, matrix.shape[1], tile):
        order = np.argsort(matrix[:, start:start + tile].sum(axis=1), kind="stable")
        mask[order[:count], start:start + tile] = 0
    return mask.reshape(kernel.shape)


class TileWiseHook(tf.compat.v1.train.SessionRunHook):
    """Prunes ``kernels`` (tf.Variables) tile-wise and keeps them pruned."""

    def __init__(self, kernels, sparsity=0.5, tile=16):
        self.kernels, self.sparsity, self.tile = kernels, sparsity, tile
        self.masks = None

    def begin(self):
        self.mask_inputs = [tf.compat.v1.placeholder(k.dtype, k.shape) for k in self.kernels]
        self.apply_ops = [k.assign(k * m) for k, m in zip(self.kernels, self.mask_inputs)]

    def after_create_session(self, session, coord):
        values = session.run(self.kernels)
        self.masks = [tile_mask_hwio(v, self.sparsity, self.tile) for v in values]
        self._apply(session)

    def after_run(self, run_context, run_values):
        self._apply(run_context.session)

    def _apply(self, session):
        session.run(self.apply_ops, dict(zip(self.mask_inputs, self.masks)))
