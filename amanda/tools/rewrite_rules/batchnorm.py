"""Folding an inference batch norm into the convolution before it
(:func:`fold_batchnorm_rules`), per backend.

Each backend's variant lives in its package
(``amanda/runtime/<backend>/rewrite_rules.py``).
"""

from __future__ import annotations

from amanda.tools.rewrite_rules._common import variant


def fold_batchnorm_rules(backend):
    """Rules folding an inference batch norm into the convolution before it.

    ``conv(x, W) -> bn`` becomes ``conv(x, W * s) + (b - mean) * s + beta`` with
    ``s = gamma / sqrt(var + eps)`` per output channel. The new weight and bias
    are computed by ops in the graph from the model's own weights (backends fold
    those constant subgraphs when they compile the graph), so the rewritten graph
    still reads the model's variables and parameters.

    Args:
        backend: ``"pytorch"`` (graph capture: ``conv2d -> batch_norm`` with
            ``training=False``), ``"tensorflow"`` (Keras 3 batch norm lowered as
            ``Conv2D [-> BiasAdd] -> Mul(scale) -> AddV2(shift)`` with per-channel
            scale and shift) or ``"onnx"`` (``Conv -> BatchNormalization``).

    Returns:
        A list of `Rule`.
    """
    return variant("fold_batchnorm_rules", backend)()
