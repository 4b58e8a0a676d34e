"""Backend runtimes: lower instrumented programs back to each backend and run them.

Eager drivers are activated by :func:`amanda.apply` for every backend whose
framework the user has already imported, so importing amanda never imports a
framework.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

# framework module name -> module of its driver (exposes ``DRIVER`` with
# enter(session) / exit(session, restored)); graph-mode drivers included.
EAGER_DRIVERS = {
    "torch": "amanda.runtime.pytorch",
    "tensorflow": "amanda.runtime.tensorflow",
    "onnxruntime": "amanda.runtime.onnx",
}


def eager_drivers():
    """The drivers of the frameworks imported so far, loaded on first use."""
    drivers = []
    for framework, module in EAGER_DRIVERS.items():
        if framework in sys.modules:
            drivers.append(importlib.import_module(module).DRIVER)
    return drivers


# top-level module of a tensor's type -> runtime module exposing ``evaluate``
VALUE_RUNTIMES = {
    "torch": "amanda.runtime.pytorch",
    "tensorflow": "amanda.runtime.tensorflow",
    "onnx": "amanda.runtime.onnx",   # onnx.ValueInfoProto symbols of a model being instrumented
}


def evaluate(values):
    """Values of backend tensors as NumPy arrays, for analysis routines.

    A PyTorch tensor is read directly; a symbolic TensorFlow tensor (what
    ``get_inputs()`` returns in graph mode) is computed in the session or
    ``tf.function`` call being rewritten. Anything else goes through
    ``numpy.asarray``.

    Args:
        values: one tensor, or a list of tensors of one backend.

    Returns:
        One array, or a list of arrays.
    """
    sample = values[0] if isinstance(values, (list, tuple)) and values else values
    module = VALUE_RUNTIMES.get(type(sample).__module__.split(".")[0])
    if module is None:
        import numpy as np
        if isinstance(values, (list, tuple)):
            return [np.asarray(v) for v in values]
        return np.asarray(values)
    return importlib.import_module(module).evaluate(values)


def lazy_module(table, loaded, key):
    """The module ``table[key]`` names, imported on first use and kept in
    ``loaded``; None for a key the table lacks. The pattern of every
    per-backend table here: nothing is imported until a backend is used."""
    module = loaded.get(key)
    if module is None:
        name = table.get(key)
        if name is None:
            return None
        module = loaded[key] = importlib.import_module(name)
    return module


@contextlib.contextmanager
def swapped(holder, name, value):
    """Set ``holder.name`` to ``value`` for the block and restore the previous
    value (None when there was none) afterwards, also on error. Runtimes use
    it on their thread-local analysis state."""
    saved = getattr(holder, name, None)
    setattr(holder, name, value)
    try:
        yield
    finally:
        setattr(holder, name, saved)
