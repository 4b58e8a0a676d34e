"""Calling instrumentation routines and checking what they return.

Shared by every backend that runs Python routines: a routine receives the
selected tensors positionally plus its keyword arguments and returns None
(observe only), one tensor (when one was selected) or a sequence of the same
length as the selection (``None`` entries keep the original).
"""

from __future__ import annotations

import dis
import functools
import inspect

import numpy as np

from amanda.controls import muted
from amanda.errors import AmandaError, ToolError


def select(values, positions, action, where):
    """The values at ``positions`` (all of them when positions is None)."""
    if positions is None:
        return list(values)
    try:
        return [values[p] for p in positions]
    except IndexError:
        raise routine_error(action, where, f"selects positions {list(positions)} but the op has "
                     f"{len(values)} such tensors") from None


def invoke(action, args, where):
    """``action.func(*args, **action.kwargs)``; any error but an amanda one
    becomes a :class:`ToolError` naming the tool, routine and op, with the
    error chained. Every backend calls routines through this."""
    try:
        return action.func(*args, **action.kwargs)
    except AmandaError:
        raise
    except Exception as exc:
        raise routine_failed(action, where, exc) from exc


def observe_after_run(steps, views, is_array):
    """Call observe-only routines after a run, in program order: the one
    after-run observation loop, for every backend that fetches the tensors
    such routines read with the run (TensorFlow's ``Session.run`` and
    ``tf.function`` graphs, onnxruntime's observe-only sessions).

    Args:
        steps: ``(func, slots, action, where)`` per routine, in program
            order. ``func`` is the routine with its keyword arguments bound.
            ``slots`` None: it receives no tensor and can only return None
            (`returns_only_none`), and it is called as ``func()``, its
            positional arguments bound too; else one entry per positional
            argument: a key of ``views``, or None for a tensor that cannot
            leave the backend.
        views: key -> read-only array of this run (or what else the backend
            hands routines for it). Each routine receives a NumPy array as a
            view of its own (``view()``), read-only too.
        is_array: recognises the backend's arrays; what a routine returns is
            checked as every routine's is (`checked_result`), then dropped:
            after the run nothing is left to replace.

    Amanda is muted once for the whole loop (a routine's own runs stay
    plain). The first routine that raises stops the loop (those before it
    have run, those after it do not) with the `ToolError` naming tool,
    routine and op, its error chained; a routine that wrote into its
    read-only view is told why.
    """
    with muted():
        for func, slots, action, where in steps:
            args = ()
            try:
                if slots is None:
                    func()
                    continue
                args = [None if s is None else _own_view(views[s]) for s in slots]
                result = func(*args)
            except AmandaError:
                raise
            except ValueError as exc:
                if "read-only" in str(exc):
                    raise routine_error(
                        action, where, "wrote into a tensor it observes: a routine that only "
                        "returns None receives read-only views of the run's own buffers, not "
                        "copies. Copy the array to change it (numpy.array(x)), or return a new "
                        "array to replace the value") from exc
                raise routine_failed(action, where, exc) from exc
            except Exception as exc:
                raise routine_failed(action, where, exc) from exc
            if result is not None:
                checked_result(action, args, result, is_array, where)


def _own_view(value):
    return value.view() if isinstance(value, np.ndarray) else value


def routine_failed(action, where, exc):
    """The :class:`ToolError` for a routine that raised ``exc`` (chain it)."""
    return routine_error(action, where, f"raised {type(exc).__name__}: {exc}")


def call_routine(action, selected, is_tensor, where, meta=None):
    """Run ``action.func`` on ``selected`` and return the replacements.

    Args:
        action: the :class:`~amanda.context.Action`.
        selected: the selected tensors.
        is_tensor: predicate recognising the backend's tensors.
        where: ``(op_name, op_id, namespace)`` for error messages.
        meta: ``meta(tensor) -> (shape, dtype)`` of the backend's tensors;
            when given, every replacement must have the metadata of the
            tensor it replaces (see :func:`check_replacements`).

    Returns:
        None when the routine observes only, else a list with one entry per
        selected tensor (None where the routine kept the original).

    Raises:
        ToolError: the routine raised or returned something else.
    """
    result = invoke(action, selected, where)
    if result is None:
        return None
    return checked_result(action, selected, result, is_tensor, where, meta)


def checked_result(action, selected, result, is_tensor, where, meta=None):
    """What :func:`call_routine` returns for a routine's ``result`` that is
    not None (the same checks, for callers that ran the routine themselves).

    A routine that hands back what it received replaces nothing (None): its
    selection as a sequence, or, where ``meta`` is given (the result stands
    for the tensors it received), the one tensor it received."""
    if meta is not None and len(selected) == 1 and result is selected[0]:
        return None   # handed back the one tensor it replaces
    if type(result) is tuple or type(result) is list:
        if len(result) == len(selected):
            for new, old in zip(result, selected):
                if new is not old:
                    break
            else:
                return None   # handed back its inputs: nothing is replaced
    if is_tensor(result):
        if len(selected) != 1:
            raise routine_error(action, where, f"returned one tensor but {len(selected)} tensors "
                         "were selected; return a sequence of that length or None")
        result = [result]
    elif isinstance(result, (tuple, list)):
        if len(result) != len(selected):
            raise routine_error(action, where, f"returned {len(result)} values for "
                         f"{len(selected)} selected tensors")
        for value in result:
            if value is not None and not is_tensor(value):
                raise routine_error(action, where, "returned a sequence containing "
                             f"{type(value).__name__}; expected tensors or None")
        result = list(result)
    else:
        raise routine_error(action, where, f"returned {type(result).__name__}; expected None, a "
                     "tensor or a sequence of tensors")
    if meta is not None:
        check_replacements(action, selected, result, meta, where)
    return result


def check_replacements(action, selected, replacements, meta, where, what="returned"):
    """Raise unless each replacement has the shape and dtype of the tensor it
    replaces (``None`` entries keep the original and are not checked).

    Metadata only: no data is read, so the check costs the same whatever the
    tensors' sizes.
    """
    for position, (new, old) in enumerate(zip(replacements, selected)):
        if new is None or new is old:
            continue
        got, want = meta(new), meta(old)
        if want is None:
            continue      # nothing to compare with (a missing gradient)
        if got != want:
            raise routine_error(action, where, f"{what} a tensor of shape {list(got[0])} and dtype "
                         f"{got[1]} at selected position {position}, replacing one of shape "
                         f"{list(want[0])} and dtype {want[1]}; a routine must keep the "
                         "shape and dtype of the tensor it replaces")


def routine_error(action, where, message, what=None):
    """The `ToolError` about ``action``'s routine at ``where`` (op name, op
    id, namespace): the one place the runtime builds it, on every backend
    and path, so every message names the tool, the routine and the op alike.

    Args:
        message: what the routine did wrong, after ``what``.
        what: how the message begins (default: ``"instrumentation routine
            (<kind>)"``).
    """
    op_name, op_id, namespace = where
    what = f"instrumentation routine ({action.kind})" if what is None else what
    return ToolError(f"{what} {message}", tool=action.tool, routine=action.func,
                     op_name=op_name, op_id=op_id, namespace=namespace)


def returns_only_none(func):
    """Whether ``func`` can only return None (its code has no other return).

    Read from the bytecode, conservatively: a routine whose every ``return``
    returns the constant None observes only, whatever it is called with, so
    its results need not flow back into the graph. Anything else (another
    return value, a generator, a callable without code) may replace. The
    answer depends on the code object alone, which is immutable: it is
    remembered per code object (an ONNX model asks once per node and point,
    mostly about one routine).
    """
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    return code is not None and _code_returns_only_none(code)


@functools.lru_cache(maxsize=1024)
def _code_returns_only_none(code):
    if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE
                        | inspect.CO_ASYNC_GENERATOR):
        return False
    previous = None
    for instruction in dis.get_instructions(code):
        name = instruction.opname
        if name == "RETURN_CONST" and instruction.argval is not None:
            return False
        if name == "RETURN_VALUE" and (instruction.is_jump_target or previous is None
                                       or previous.opname != "LOAD_CONST"
                                       or previous.argval is not None):
            return False
        previous = instruction
    return True
