"""The analysis-time probe: what ``evaluate`` reads while analysis routines run.

Analysis routines of graph backends see symbols (a TF graph's ``tf.Tensor``,
an ONNX ``ValueInfoProto``), not values. While a backend runs the analysis
of a program, it installs a *probe* for it on the thread (`probing`); the
backend's ``evaluate`` asks that probe (`evaluate`) and refuses outside
analysis. One contract for every backend (imports no framework):

* a probe has ``evaluate(items) -> list`` of NumPy arrays, one per item, in
  order; what an item is (a symbolic tensor, a tensor name) is the
  backend's business;
* a probe may answer more (TensorFlow's has ``session()``); `current`
  hands it to the backend for that.

Probes are per thread and per backend: a probe is installed for the span of
one analysis and the previous one is restored afterwards, also on errors, so
analyses nest (a TF function body inside a graph) and one backend's probe is
never asked about another backend's tensors. PyTorch eager tensors hold
their values: its ``evaluate`` needs no probe.
"""

from __future__ import annotations

import threading

from amanda.errors import BackendError
from amanda.runtime import swapped

_probes = threading.local()   # backend name -> the probe of the analysis under way


def probing(backend, probe):
    """A context manager: ``probe`` answers ``backend``'s `evaluate` on this
    thread for the block (None: no analysis)."""
    return swapped(_probes, backend, probe)


def current(backend):
    """The probe of ``backend``'s analysis under way on this thread, or None."""
    return getattr(_probes, backend, None)


def evaluate(backend, values, outside, item=None):
    """Values of one symbol or a list of them, read by ``backend``'s probe.

    Args:
        backend: the probe's backend name (``"tensorflow"``, ``"onnx"``).
        values: a symbol, or a list or tuple of them.
        outside: the message of the `BackendError` raised when no analysis
            of that backend is under way on this thread.
        item: ``item(symbol)``: what the probe is handed per symbol (the
            symbol itself when None).

    Returns:
        One array for one symbol, a list of arrays for a list.
    """
    probe = getattr(_probes, backend, None)
    if probe is None:
        raise BackendError(outside)
    single = not isinstance(values, (list, tuple))
    items = [values] if single else list(values)
    if item is not None:
        items = [item(v) for v in items]
    result = probe.evaluate(items)
    return result[0] if single else list(result)
