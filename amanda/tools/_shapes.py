"""Shapes of tensors of any backend, for tools that read them (duck-typed:
no framework is imported)."""

from __future__ import annotations


def dims(value):
    """A tensor's shape as a list of ints, None for an unknown dimension; None
    when ``value`` has no shape or its rank is unknown (a TF ``TensorShape``
    of unknown rank). Works for torch, TF (including TF1 ``Dimension``
    objects) and NumPy values."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        items = list(shape)
    except TypeError:   # a TF TensorShape of unknown rank
        return None
    result = []
    for d in items:
        d = getattr(d, "value", d)   # TF1 Dimension
        result.append(None if d is None else int(d))
    return result
