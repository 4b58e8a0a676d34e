"""The PyTorch side of :mod:`amanda.portable`: its vocabulary on torch tensors.

:mod:`amanda.portable` dispatches each op on its arguments' framework and
calls the functions here for ``torch.Tensor`` values (this module is loaded
only then, so torch is already imported).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["binary", "cast", "fake_quant", "identity", "is_tensor", "like", "reshape", "unary",
           "where"]

#: portable name -> torch function name
_UNARY = {"abs": "abs", "floor": "floor", "ceil": "ceil", "sqrt": "sqrt", "exp": "exp",
          "log": "log", "sign": "sign", "round": "round"}


def is_tensor(value):
    return isinstance(value, torch.Tensor)


def like(value, reference):
    """``value`` (a tensor, scalar or array) as a tensor of ``reference``'s dtype (and device)."""
    if isinstance(value, torch.Tensor):
        return value.to(reference.dtype)
    return torch.as_tensor(np.asarray(value), device=reference.device).to(reference.dtype)


def unary(name, x):
    return getattr(torch, _UNARY[name])(x)


def identity(x):
    return x


def binary(name, a, b):
    """``minimum``/``maximum`` of two tensors."""
    return getattr(torch, name)(a, b)


def where(condition, a, b):
    return torch.where(condition, a, b)


def cast(x, dtype):
    return x.to(getattr(torch, dtype))


def reshape(value, shape):
    return value.reshape(shape)


def fake_quant(x, scale, zero_point, qmin, qmax, axis, to_numpy, shape_probe):
    """torch's fused fake-quant while tracing for export (the ONNX exporter
    writes it as a QuantizeLinear/DequantizeLinear pair) for an 8-bit range;
    None otherwise (the caller computes it element-wise).

    Args:
        axis: the channel axis of a per-channel ``scale``/``zero_point``, or None.
        to_numpy: converts a non-torch constant to a NumPy array.
        shape_probe: an array of a value's shape (scalars: the value).
    """
    if not torch.jit.is_tracing():
        return None
    qmin, qmax = int(qmin), int(qmax)
    if (qmin, qmax) not in ((-128, 127), (0, 255)):
        return None

    def as_torch(value, dtype, shape):
        # torch values stay torch values: converting them to NumPy while
        # tracing would bake them in with a TracerWarning
        if isinstance(value, torch.Tensor):
            value = value.detach()
            value = value.round() if dtype == torch.int32 else value
            return value.to(dtype).reshape(shape)
        array = np.asarray(to_numpy(value))
        array = np.round(array) if dtype == torch.int32 else array
        return torch.as_tensor(array.astype(np.float32 if dtype == torch.float32 else np.int32)
                               ).reshape(shape)

    if axis is None or np.ndim(shape_probe(scale)) == 0:
        return torch.fake_quantize_per_tensor_affine(
            x, as_torch(scale, torch.float32, ()), as_torch(zero_point, torch.int32, ()),
            qmin, qmax)
    return torch.fake_quantize_per_channel_affine(
        x, as_torch(scale, torch.float32, (-1,)), as_torch(zero_point, torch.int32, (-1,)),
        axis % x.dim(), qmin, qmax)
