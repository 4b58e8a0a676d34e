"""The routine host: hosted Python routines called inside a backend's run.

A routine that does not lower to the backend's own ops (it is not
portable) runs as a callback inside the run: TensorFlow's
``tf.numpy_function`` (:mod:`amanda.runtime.tensorflow.hosting`) and
onnxruntime-extensions' custom ops (:mod:`amanda.runtime.onnx.host`). The
backend adapters do the plumbing (how arrays get in and out, how an error
reaches the caller's thread); this module is what they share, on NumPy
arrays (imports no framework):

* `call_muted`: the routine runs inside ``controls.muted()`` (its own
  tensor calls and sessions are not instrumented), and any error becomes an
  amanda error (`amanda_error`) handed to the backend's ``failed`` (TF
  raises it into TensorFlow, ONNX keeps it: nothing may cross into
  onnxruntime);
* `spread` and `observe`: a before/after routine receives its selection
  with None for the tensors that do not reach Python, and what it returns
  is checked (`amanda.runtime.routines.call_routine`: its form; each
  replacement keeps its tensor's shape and dtype; no replacement for a
  tensor it did not receive);
* `replace`: a replace routine receives the op's inputs and returns one
  array per output of the op, each of that output's dtype (and shape, where
  the backend knows it).

Every call goes through `amanda.runtime.routines.invoke` (errors name tool,
routine and op).
"""

from __future__ import annotations

import numpy as np

from amanda import controls
from amanda.errors import AmandaError
from amanda.runtime.routines import call_routine, check_replacements, invoke, routine_error


def is_array(value):
    """Whether ``value`` is a NumPy array or scalar (what routines exchange)."""
    return isinstance(value, (np.ndarray, np.generic))


def read_only(array):
    """A view the routine cannot write through: the array may share memory
    with a buffer of the backend (a variable's, even), which an in-place
    update would silently change for every other reader."""
    if isinstance(array, np.ndarray) and array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def meta(array):
    """``(shape, dtype)`` of an array, for the replacement checks."""
    return tuple(array.shape), array.dtype


#: the `ToolError` about a routine (`amanda.runtime.routines.routine_error`)
tool_error = routine_error


def amanda_error(action, where, exc):
    """``exc`` if it is an amanda error (a routine's error, already a
    `ToolError` from ``invoke``), else a `ToolError` naming the routine with
    ``exc`` as its cause (amanda's own bug while hosting it)."""
    if isinstance(exc, AmandaError):
        return exc
    error = tool_error(action, where, f"failed in amanda: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def call_muted(action, where, run, arrays, failed, catch=Exception):
    """``run(arrays)`` inside ``controls.muted()``.

    Args:
        action, where: the action and ``(op name, op id, namespace)``.
        run: the backend's call of the routine.
        arrays: what the backend handed over.
        failed: ``failed(error, arrays)`` for an error (`amanda_error` of
            it): raises it towards the caller, or returns what the backend
            hands back instead of the routine's results.
        catch: the exceptions ``failed`` receives (``BaseException`` where
            none may leave the callback).
    """
    try:
        with controls.muted():   # the backend may call it in the user's thread
            return run(arrays)
    except catch as exc:
        return failed(amanda_error(action, where, exc), arrays)


def spread(count, hosted, arrays):
    """The routine's selection: ``arrays`` at the ``hosted`` positions, None
    at the other ``count`` positions (tensors that cannot reach Python)."""
    values = [None] * count
    for i, array in zip(hosted, arrays):
        values[i] = array
    return values


def observe(action, where, values, hosted, unhosted):
    """Call a before/after routine on its selection (from `spread`).

    Args:
        unhosted: what a tensor that does not reach Python is, for the error
            when the routine returns a replacement for one.

    Returns:
        None when the routine replaced nothing, else one entry per hosted
        position: the replacement array, or None to keep the tensor.

    Raises:
        ToolError: the routine raised, or returned something that is no
            replacement of its selection.
    """
    result = call_routine(action, values, is_array, where)
    if result is None:
        return None
    for position, new in enumerate(result):
        if new is not None and values[position] is None:
            raise tool_error(action, where, f"returned a replacement at selected position "
                             f"{position}, a tensor that {unhosted}")
    check_replacements(action, values, result, meta, where)
    return [result[i] for i in hosted]


def replace(action, where, arrays, dtypes, shapes=None, copy=True):
    """Call a replace routine on the op's inputs.

    Args:
        arrays: the op's inputs.
        dtypes: the NumPy dtype of each output of the op.
        shapes: per output, its static shape (an object whose
            ``is_compatible_with(shape)`` says whether a result fits), or
            None where the backend checks no shape.
        copy: return copies (the backend may read them after the routine
            changed an array it kept).

    Returns:
        One array per output.

    Raises:
        ToolError: the routine raised, or its results are not one array per
            output with that output's dtype (and shape).
    """
    result = invoke(action, arrays, where)
    if is_array(result):
        result = [result]
    if not isinstance(result, (list, tuple)) or len(result) != len(dtypes):
        raise tool_error(action, where, f"must return {len(dtypes)} arrays, one per output "
                         f"of the op; got {type(result).__name__}")
    shapes = shapes or [None] * len(dtypes)
    out = []
    for position, (new, shape, dtype) in enumerate(zip(result, shapes, dtypes)):
        if not is_array(new) or new.dtype != dtype or (
                shape is not None and not shape.is_compatible_with(new.shape)):
            got = (f"{type(new).__name__}" if not is_array(new)
                   else f"shape {list(new.shape)} and dtype {new.dtype}")
            has = f"shape {shape} and dtype {np.dtype(dtype)}" if shape is not None else \
                f"dtype {np.dtype(dtype)}"
            raise tool_error(action, where, f"returned {got} for output {position}, which "
                             f"has {has}; a routine must keep the shape and dtype of the "
                             "tensor it replaces")
        out.append(np.array(new, copy=True) if copy else new)
    return out
