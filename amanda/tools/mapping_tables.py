"""Mapping tables: one common op set across the PyTorch, TensorFlow and ONNX namespaces.

For each canonical op type the table says, per backend, which backend ops it
covers, where its tensors sit (``input``, ``weight``, ``bias``...), in which
layout (``NCHW``/``NHWC`` activations, ``OIHW``/``HWIO`` filters, ``(out, in)``
or ``(in, out)`` matrices), and what its attributes are called. Mapping rules
(:mod:`amanda.tools.mapping_rules`) read it, so a tool written against
canonical names needs one line per backend::

    MappingTool(rules=mapping_rules.RULES)          # pytorch, tensorflow, onnx

and a tool that wants more than the canonical type asks the table directly::

    spec = mapping_tables.lookup("onnx", "Conv")
    spec.canonical, spec.position("weight"), spec.layout("weight"), spec.attr("stride")
    # -> "conv2d", 1, "OIHW", "strides"

The rows are each backend's own op facts, kept in its package
(``amanda/runtime/<backend>/vocabulary.py``, reached through the backend's
descriptor); this module reads them through :mod:`amanda.runtime.vocabulary`.
Names a row leaves ambiguous (a TF ``MatMul`` is ``linear`` or ``matmul``, an
ONNX ``Conv`` may be depthwise) read as the first row naming them
(``lookup("onnx", "Conv")`` is ``conv2d``; ``lookup("onnx", "Conv",
"depthwise_conv2d")`` gives the depthwise row); see each vocabulary module.

Layouts are strings of axis letters; :func:`convert_layout` moves an array
between two of them (e.g. a TF ``HWIO`` filter to PyTorch's ``OIHW``).
"""

from __future__ import annotations

import numpy as np

from amanda.runtime import vocabulary
from amanda.runtime.vocabulary import OpSpec, backend_ops, lookup, specs

__all__ = ["BACKENDS", "TABLE", "OpSpec", "backend_ops", "channel_axes", "convert_layout",
           "lookup", "specs"]

#: the backends with a vocabulary (the built-in ones: PyTorch, TensorFlow, ONNX)
BACKENDS = vocabulary.backends_with_vocabulary()

#: canonical type -> backend -> :class:`OpSpec`, as the backends' vocabularies
#: stood when this module was imported (:func:`lookup` reads them as they are)
TABLE = vocabulary.table()


def convert_layout(array, source, target):
    """Transpose ``array`` from one layout to another (same axis letters).

    >>> convert_layout(np.zeros((3, 3, 16, 32)), "HWIO", "OIHW").shape
    (32, 16, 3, 3)
    """
    if sorted(source) != sorted(target):
        raise ValueError(f"layouts {source!r} and {target!r} do not have the same axes")
    return np.transpose(np.asarray(array), [source.index(axis) for axis in target])


def channel_axes(layout):
    """``(output-channel axis, input-channel axis)`` of a weight layout, or
    None for None: the ``O`` and ``I`` axes; a depthwise filter (``M``, its
    depth multiplier) has its channels on ``I`` and no input axis of its own.

    >>> channel_axes("HWIO"), channel_axes("OI"), channel_axes("HWIM")
    ((3, 2), (0, 1), (2, None))
    """
    if layout is None:
        return None
    if "M" in layout:
        return layout.index("I"), None
    return layout.index("O"), layout.index("I")
