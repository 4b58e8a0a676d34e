"""TensorFlow ops executed eagerly (op by op) inside ``apply``: amanda
instruments graphs (``Session.run``, ``tf.function`` and other concrete
functions called eagerly), not single eager ops, so it says so once per
scope instead of reporting counts that silently leave them out
(`watch` / `unwatch`, called by the driver for the thread's outermost scope).

The watch is one of TensorFlow's op callbacks (``op_callbacks``, the
mechanism ``tf.debugging.enable_check_numerics`` uses), registered on the
thread that entered ``apply``: TensorFlow calls it for every op executed
eagerly and for every op added to a graph while it is registered. It
returns None (outputs unchanged), and removes itself once it has warned.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import op_callbacks

from amanda import controls
from amanda.errors import NotInstrumentedWarning, user_stacklevel

_tls = threading.local()


def watch():
    """Start watching this thread's eager ops (its outermost scope opens)."""
    if getattr(_tls, "callback", None) is not None:
        return
    _tls.callback = _warn_once
    op_callbacks.add_op_callback(_warn_once)


def unwatch():
    """Stop watching (the thread's outermost scope closes)."""
    callback = getattr(_tls, "callback", None)
    _tls.callback = None
    if callback is not None:
        try:
            op_callbacks.remove_op_callback(callback)
        except KeyError:
            pass    # TensorFlow's own clear_op_callbacks() ran meanwhile


# Ops that compute nothing on tensors: resource handles and reads, tf.data
# pipelines and their iterators.
_HANDLING = frozenset(("VarHandleOp", "ReadVariableOp", "AssignVariableOp", "VarIsInitializedOp",
                       "DestroyResourceOp", "MakeIterator", "IteratorGetNext",
                       "DeleteIterator"))


def _plumbing(op_type):
    return (op_type in _HANDLING or op_type.endswith(("Dataset", "DatasetV2", "DatasetV3"))
            or "Iterator" in op_type or op_type.startswith("Optional"))


_KERAS_TRAINERS = (os.sep + os.path.join("keras", "src", "trainers") + os.sep,
                   os.sep + os.path.join("keras", "src", "backend", "tensorflow", "trainer.py"))


def _in_keras_trainer():
    """Whether Keras's ``fit``/``evaluate``/``predict`` made the call: their
    steps are ``tf.function``s (instrumented); what they run eagerly around
    the steps (metric results, callbacks) is bookkeeping, not the model."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _KERAS_TRAINERS[0] in name or name.endswith(_KERAS_TRAINERS[1]):
            return True
        frame = frame.f_back
    return False


def _warn_once(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    if graph is not None or controls.state.disabled or not controls.state.sessions:
        return None      # an op added to a graph, or a run amanda is not instrumenting
    if isinstance(op_type, bytes):
        # the eager fallback of a generated op (``_execute.execute(b"RestoreV2", ...)``,
        # e.g. restoring a SavedModel's variables) names the op in bytes: this
        # callback raised a TypeError into the user's call
        op_type = op_type.decode("utf-8", "replace")
    if _context.context().has_function(op_type):
        return None      # an eager call of a function: instrumented (tensorflow_functions)
    if _plumbing(op_type) or _in_keras_trainer():
        return None
    unwatch()
    warnings.warn(
        f"amanda: TensorFlow executed the op {op_type!r} eagerly (op by op) inside "
        "apply; amanda instruments graphs only (tf.compat.v1 Session.run, tf.function "
        "and other concrete functions), so eagerly executed ops get no instrumentation "
        "points. Wrap the computation in tf.function (a Keras model's fit/predict "
        "already are) to instrument it. See docs/tensorflow.md, Limits.",
        NotInstrumentedWarning,
        stacklevel=user_stacklevel(tf, *[m for m in (sys.modules.get("keras"),) if m]))
    return None
