"""TensorFlow graph mode: instrumentation routines as ``tf.numpy_function``
callbacks (`_observer`, `_replacer`), their errors carried across
TensorFlow's threads (`_hosting`, `_surface`), and `_chosen`/`_shaped`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
import weakref

import numpy as np
import tensorflow as tf

from amanda.runtime import host


# -- routines as callbacks (the host's core: amanda.runtime.host) -------------------

_is_array = host.is_array
_read_only = host.read_only
_tool_error = host.tool_error
#: what a tensor the routine receives as None is, in error messages
_UNHOSTED = ("cannot leave TensorFlow (a resource handle, variant, string or variable "
             "reference)")


def _crosses_to_python(dtype):
    """Whether tensors of ``dtype`` can be handed to a Python routine.

    Not handles (resource, variant), strings, nor references to v1
    variables (``float32_ref``: the op reading one may assign to it, which a
    copy made in Python would silently break).
    """
    return not dtype._is_ref_dtype and dtype not in (tf.resource, tf.variant, tf.string)


# A routine's error is raised on one of TensorFlow's threads and comes back as
# an UnknownError carrying only its text; the error itself waits here, under a
# token named in that text, until Session.run or the function call re-raises it.
_failures = {}
_failures_lock = threading.Lock()
_failure_tokens = itertools.count()
_FAILURE_MARK = "amanda-routine-failure-"


class _RoutineFailed(Exception):
    """What a hosted callback raises into TensorFlow (see `_surface`)."""


def _failed(error):
    with _failures_lock:
        while len(_failures) >= 256:   # failures nobody re-raised (e.g. a GraphDef run by hand)
            _failures.pop(next(iter(_failures)))
        token = next(_failure_tokens)
        _failures[token] = error
    return _RoutineFailed(f"{_FAILURE_MARK}{token}: {error}")


# An integer constant a routine may read but not replace (tensorflow_rewrite
# `_keep_constant`) is checked by an Assert op whose message names a token;
# what the error needs waits here, for as long as the action lives: the
# action is held weakly (the instrumented graph holds it), or every tool,
# its sessions and their graphs would stay alive for the process's life.
_kept = {}
_KEPT_MARK = "amanda-kept-constant-"
_KEPT_RE = re.compile(re.escape(_KEPT_MARK) + r"(\d+)")


def _kept_constant(action, where, message):
    """The text of the check that ``action`` left a constant as it was."""
    with _failures_lock:
        if len(_kept) >= 1024:          # forget the checks of actions that are gone
            for token in [t for t, entry in _kept.items() if entry[0]() is None]:
                del _kept[token]
        token = next(_failure_tokens)
        _kept[token] = (weakref.ref(action), where, message)
    return f"{_KEPT_MARK}{token}: {message}"


def _kept_error(token):
    """The `ToolError` of a failed check, or None if its action is gone
    (TensorFlow's error, which carries the check's text, is raised then)."""
    entry = _kept.get(token)
    action = entry[0]() if entry is not None else None
    return None if action is None else _tool_error(action, *entry[1:])


@contextlib.contextmanager
def _surface():
    """Turn the TensorFlow error that a failing hosted routine caused back
    into the amanda error it raised (with the routine's exception as its
    ``__cause__``); other TensorFlow errors pass unchanged."""
    try:
        yield
    except tf.errors.OpError as exc:
        match = _FAILURE_RE.search(exc.message or "")
        if match is None:
            kept = _KEPT_RE.search(exc.message or "")
            error = _kept_error(int(kept.group(1))) if kept is not None else None
            if error is not None:
                raise error from exc
            raise
        with _failures_lock:
            error = _failures.pop(int(match.group(1)), None)
        if error is None:
            raise
        cause = error.__cause__
        if cause is None:
            raise error from exc
        _keep_cause(error, cause)
        raise error from cause


class _CauseKept:
    """Keeps an error's ``__cause__`` readable after ``tf.function``'s
    traceback filter re-raises it ``from None`` (which clears it)."""

    @property
    def __cause__(self):
        cause = BaseException.__cause__.__get__(self)
        return cause if cause is not None else self._amanda_cause

    @__cause__.setter
    def __cause__(self, value):
        BaseException.__cause__.__set__(self, value)


_cause_kept_types = {}


def _keep_cause(error, cause):
    kind = type(error)
    if not issubclass(kind, _CauseKept):
        kept = _cause_kept_types.get(kind)
        if kept is None:
            kept = _cause_kept_types[kind] = type(kind.__name__, (_CauseKept, kind),
                                                  {"__module__": kind.__module__})
        error.__class__ = kept
    error._amanda_cause = cause


_FAILURE_RE = re.compile(_FAILURE_MARK + r"(\d+)")


def _raise_failed(error, arrays):
    raise _failed(error) from None


def _hosting(action, where, run):
    """Run ``run`` as a callback: every error becomes an amanda error that
    `_surface` re-raises in the caller's thread."""

    def callback(*arrays):
        return host.call_muted(action, where, run, arrays, _raise_failed)

    return callback


def _chosen(original, new, flag):
    """``new`` where ``flag`` is True, else ``original`` itself.

    Switch and Merge forward one of the two tensors without touching their
    data: the cheapest way to let the original tensor flow on when the
    routine returned None.
    """
    kept, _ = tf.raw_ops.Switch(data=original, pred=flag)
    _, replaced = tf.raw_ops.Switch(data=new, pred=flag)
    chosen = tf.raw_ops.Merge(inputs=[kept, replaced]).output
    return _shaped(chosen, original.shape)


def _shaped(tensor, shape):
    """``tensor``, its static ``shape`` stated in the graph itself.

    ``set_shape`` informs Python only: Grappler infers shapes from the
    GraphDef, where a PyFunc's outputs (and a Merge reading one) have none.
    Without them it cannot fold shape computations or rewrite sums as it does
    in the plain graph (MobileNetV2's gradients came out summed in another
    order), so even an observing routine changed the numbers. EnsureShape
    gives Grappler the shape, at the cost of a check when the graph runs.
    """
    tensor.set_shape(shape)
    if shape.rank is None:
        return tensor
    return tf.ensure_shape(tensor, shape)


#: TensorFlow's buffer alignment (``EIGEN_MAX_ALIGN_BYTES`` of its x86 builds)
_TF_ALIGNMENT = 64


def _owned_copy(array):
    """A copy of ``array`` that TensorFlow copies once more into a buffer of
    its own when the callback returns it.

    TensorFlow takes a callback's array without copying it when its data
    are ``_TF_ALIGNMENT``-aligned, and then never lets a kernel reuse that
    buffer for its output (it does not own the memory); otherwise it copies
    the data into a buffer it owns, which a kernel may reuse, as it may any
    op's output. ``AddN`` sums starting from the first input whose buffer it
    may reuse, so where NumPy's allocation happened to be aligned a
    replaced tensor changed the order of a gradient sum, and the result by
    one ulp, from run to run. Placing every copy off that alignment makes
    each result TensorFlow's own buffer, like the output it stands for.
    """
    array = np.asarray(array)
    if array.nbytes == 0 or array.dtype.hasobject:
        return np.array(array, copy=True)
    # one item past an aligned address: on the itemsize, off any alignment
    # above it (TensorFlow's, whatever its build)
    item = array.dtype.itemsize
    raw = np.empty(array.nbytes + _TF_ALIGNMENT + item, np.uint8)
    start = (-raw.ctypes.data) % _TF_ALIGNMENT + item
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def _observer(action, where, count, hosted, dtypes, spread=None, fixed=()):
    """The callback of a before/after routine.

    It receives the hosted tensors (read-only arrays; the others are None to
    the routine) and returns one flag per hosted tensor, then one array per
    hosted tensor: where the flag is False the graph lets the original
    tensor flow on and the array (a 0-d placeholder) is never read, so an
    observing routine feeds nothing of its own into the graph.

    Args:
        dtypes: those of the hosted tensors; None for a routine that can
            only return None (`amanda.runtime.routines.returns_only_none`):
            its callback returns one int32 token, and the graph orders it
            by control edges (`tensorflow_rewrite._GraphRewrite._observing`).
        spread: ``arrays -> the routine's selection``, where the callback
            receives something else than the hosted tensors (a view of a
            point with dead tensors, `tensorflow_liveness.spread_live`).
        fixed: selected positions the routine may not replace (a loop's
            back edge); handing back the array it received keeps them.
    """
    token = dtypes is None or not hosted
    kept = [] if token else [np.False_] * len(hosted) + [np.zeros((), d) for d in dtypes]
    unhosted = _UNHOSTED if spread is None else _UNHOSTED + " or is dead in this run"
    if spread is None:
        spread = lambda arrays: host.spread(count, hosted, arrays)  # noqa: E731

    def run(arrays):
        values = spread([_read_only(a) for a in arrays])
        new = host.observe(action, where, values, hosted, unhosted)
        if token:
            return [np.int32(0)]
        if new is None:
            return kept
        flags, arrays_out = [], []
        for i, replacement, placeholder in zip(hosted, new, kept[len(hosted):]):
            if replacement is values[i]:     # its own read-only array: nothing changed
                replacement = None
            if replacement is not None and i in fixed:
                raise _tool_error(action, where, f"returned a replacement at selected position "
                                  f"{i}, a loop's value from its previous iteration, which "
                                  "only the loop's Merge may read: routines observe it")
            flags.append(np.bool_(replacement is not None))
            # a copy: the routine may keep its array and change it later,
            # while TensorFlow still reads it
            arrays_out.append(placeholder if replacement is None
                              else _owned_copy(replacement))
        return flags + arrays_out

    return _hosting(action, where, run)


def _replacer(action, where, shapes, dtypes):
    """The callback of a replace routine: the op's inputs in (read-only), one
    array per output of the op out, each with that output's dtype and a
    shape its static shape allows."""

    def run(arrays):
        return [_owned_copy(a) for a in host.replace(
            action, where, [_read_only(a) for a in arrays], dtypes, shapes, copy=False)]

    return _hosting(action, where, run)


def _numpy_function(graph, func, *args, **kwargs):
    """``tf.numpy_function`` in ``graph`` (the copy being built), with
    ``func`` kept alive by ``graph``. TensorFlow keeps a hosted function alive
    as long as the outermost graph around the one it is created in: for the
    copy of a ``tf.function`` that is the process's global eager graph, which
    never dies, so every routine (and through it its tool, the tool's
    sessions and their graphs) would be kept for the life of the process.
    The function is handed to the copy instead, which lives as long as amanda's
    cache entry for the user's function."""
    root = tf.compat.v1.get_default_graph()      # where TensorFlow starts its walk
    while getattr(root, "outer_graph", None) is not None and root.outer_graph is not root:
        root = root.outer_graph
    before = len(getattr(root, "_py_funcs_used_in_graph", ()))
    result = tf.numpy_function(func, *args, **kwargs)
    if root is not graph:
        kept = root._py_funcs_used_in_graph
        moved = kept[before:]
        del kept[before:]
        if not hasattr(graph, "_py_funcs_used_in_graph"):
            graph._py_funcs_used_in_graph = []
        graph._py_funcs_used_in_graph.extend(moved)
    return result


def _user_stacklevel():
    """The ``stacklevel`` that makes a warning name the user's line (the
    first caller outside amanda and TensorFlow)."""
    import sys
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            os.path.dirname(os.path.abspath(tf.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level
