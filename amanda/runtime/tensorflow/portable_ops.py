"""The TensorFlow side of :mod:`amanda.portable`: its vocabulary on TF tensors.

:mod:`amanda.portable` dispatches each op on its arguments' framework and
calls the functions here for TensorFlow tensors and variables (this module
is loaded only then, so TensorFlow is already imported).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["binary", "cast", "fake_quant", "identity", "is_tensor", "like", "reshape", "unary",
           "where"]

#: portable name -> path of the TF function under ``tf``
_UNARY = {"abs": "abs", "floor": "math.floor", "ceil": "math.ceil", "sqrt": "math.sqrt",
          "exp": "math.exp", "log": "math.log", "sign": "math.sign", "round": "math.round"}


def is_tensor(value):
    return isinstance(value, (tf.Tensor, tf.Variable))


def like(value, reference):
    """``value`` (a tensor, scalar or array) as a tensor of ``reference``'s dtype."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.cast(value, reference.dtype)
    return tf.constant(np.asarray(value), dtype=reference.dtype)


def unary(name, x):
    function = tf
    for part in _UNARY[name].split("."):
        function = getattr(function, part)
    return function(x)


def identity(x):
    """An ``Identity`` op, so an inserted no-op is visible in the graph."""
    return tf.identity(x)


def binary(name, a, b):
    """``minimum``/``maximum`` of two tensors."""
    return getattr(tf, name)(a, b)


def where(condition, a, b):
    return tf.where(condition, a, b)


def cast(x, dtype):
    return tf.cast(x, dtype)


def reshape(value, shape):
    return tf.reshape(value, shape)


def fake_quant(x, scale, zero_point, qmin, qmax, axis, to_numpy, shape_probe):
    """None: TF graphs compute fake-quant element-wise."""
    return None
