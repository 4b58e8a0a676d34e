"""Backend runtimes: lower instrumented programs back to each backend and run them.

The backend-free kernel lives here (the backend registry, the driver
lifecycle, the routine host, observation); each backend is a package beside
it (``pytorch/``, ``tensorflow/``, ``onnx/``) that declares its descriptor
(:mod:`amanda.runtime.backends`). Drivers are entered by :func:`amanda.apply`
for every backend whose framework the user has already imported, so
importing amanda never imports a framework.
"""

from __future__ import annotations

import contextlib

from amanda.runtime import backends


def eager_drivers():
    """The drivers of the backends whose framework the user has imported
    (:func:`amanda.runtime.backends.active`), loaded on first use."""
    return [backend.part("driver") for backend in backends.active()]


def evaluate(values):
    """Values of backend tensors as NumPy arrays, for analysis routines.

    A PyTorch tensor is read directly; a symbolic TensorFlow tensor (what
    ``get_inputs()`` returns in graph mode) is computed in the session or
    ``tf.function`` call being rewritten. Anything else goes through
    ``numpy.asarray``. The backend is the one whose descriptor names the
    tensor's module (:func:`amanda.runtime.backends.for_value`).

    Args:
        values: one tensor, or a list of tensors of one backend.

    Returns:
        One array, or a list of arrays.
    """
    sample = values[0] if isinstance(values, (list, tuple)) and values else values
    backend = backends.for_value(sample)
    if backend is None or backend.evaluate is None:
        import numpy as np
        if isinstance(values, (list, tuple)):
            return [np.asarray(v) for v in values]
        return np.asarray(values)
    return backend.part("evaluate")(values)


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
