"""Running an ONNX model for its intermediate tensors, and comparing two
values: what both numeric diffs (:mod:`amanda.tools.diff`, PyTorch vs ONNX;
:mod:`amanda.tools.diff_tf`, TensorFlow vs ONNX) share.
"""

from __future__ import annotations

import numpy as np

from amanda.runtime.tool_support import provider

__all__ = ["onnx_tensor_values"]

_ORT_IR_VERSION = 10   # onnxruntime 1.31 reads IR versions up to 13; onnx writes 14


def onnx_tensor_values(model, feeds, names=()):
    """`amanda.runtime.onnx.tools.tensor_values` for this onnxruntime: a
    dict tensor name -> array of the model's outputs and ``names``."""
    return provider("tensor_values").tensor_values(model, feeds, names,
                                                   max_ir_version=_ORT_IR_VERSION)


def _errors(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    return float(diff.max(initial=0.0)), float((diff / (np.abs(a) + 1e-12)).max(initial=0.0))


def _close(a, b, rtol, atol):
    return np.shape(a) == np.shape(b) and np.allclose(a, b, rtol=rtol, atol=atol)
