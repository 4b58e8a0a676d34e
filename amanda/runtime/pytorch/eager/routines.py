"""PyTorch eager driver: running the tools' routines on an op's tensors.

Analysis (``_analyse``), actions before/after an op (``_apply_actions``,
``_invoke``: autodiff isolation, mute, the export guard) and ``replace_op``
routines with the check of what they return against the op's output
structure (``_output_spec``, ``_check_replacement``). Part of
:mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import threading

import torch
import torch.autograd.forward_ad as _fwad

from amanda import controls
from amanda.errors import AmandaError
from amanda.passes.instrumentation import analyse_point
from amanda.runtime.pytorch.eager.records import _is_tensor, _StraightThrough
from amanda.runtime.pytorch.eager.sites import _Tensor
from amanda.runtime.routines import (
    call_routine, checked_result, invoke, routine_error, routine_failed, select)


_grad_enabled = torch.is_grad_enabled
_CONTROLS = controls.state
_set_grad_enabled = torch._C._set_grad_enabled
_unpack_dual = torch._C._VariableFunctions._unpack_dual
_interpreter_stack = torch._C._functorch.get_interpreter_stack
_JVP = torch._C._functorch.TransformType.Jvp


def _differentiated(tensor):
    """Whether autodiff follows ``tensor``, so a routine's replacement of
    it must be wired in straight-through: it requires grad while grad is
    enabled (reverse mode), or forward-mode AD carries a tangent on it
    (``torch.autograd.forward_ad``, which ``no_grad`` does not stop, or a
    ``torch.func.jvp``/``jacfwd`` transform): without the straight-through
    the tangent would be the routine's (lost when it detaches, scaled when
    it scales), not the original's."""
    if tensor.requires_grad and _grad_enabled():
        return True
    level = _fwad._current_level
    if level >= 0 and _unpack_dual(tensor, level)[1] is not None:
        return True
    stack = _interpreter_stack()
    return bool(stack) and any(layer.key() == _JVP for layer in stack)


class _Exporting(threading.local):
    """Set by ``amanda.export`` in the thread that traces a model for export:
    ``guard(action, selected, where)`` is a context manager wrapped around each
    routine call; it refuses routines that an exported graph cannot hold."""

    guard = None


EXPORTING = _Exporting()


def _meta(tensor):
    """(shape, dtype) of a tensor, what a replacement must keep; None for
    anything else. A nested tensor of the strided layout has no ``shape``
    (torch raises): its shape is its components' shapes."""
    if not isinstance(tensor, _Tensor):
        return None
    if tensor.is_nested and tensor.layout is torch.strided:
        return (tuple(map(tuple, tensor._nested_tensor_size().tolist())), tensor.dtype)
    return (tensor.shape, tensor.dtype)


def _invoke(action, selected, where, meta=_meta):
    """Run a routine with autodiff isolation unless it opted in. Amanda is
    disabled meanwhile: a routine's own torch calls are not instrumented
    (inside the mode's handler torch has popped the mode already; the flag
    covers backward hooks). ``meta``: see ``call_routine``; None where what
    the routine returns replaces other tensors than those it received
    (``replace_backward_op``), so handing one back is no "nothing"."""
    switch = not action.ad and _grad_enabled()
    if switch:
        _set_grad_enabled(False)   # cheaper than a torch.no_grad() object
    # controls.muted(), inlined: this runs once per instrumentation point
    state = _CONTROLS
    saved = state.disabled
    state.disabled = True
    try:
        guard = EXPORTING.guard
        if guard is not None:
            with guard(action, selected, where):
                return call_routine(action, selected, _is_tensor, where, meta)
        # call_routine, inlined up to the common result (None: observed)
        try:
            result = action.func(*selected, **action.kwargs)
        except AmandaError:
            raise
        except Exception as exc:
            raise routine_failed(action, where, exc) from exc
        if result is None:
            return None
        if meta is not None and len(selected) == 1 and result is selected[0]:
            return None     # handed back the one tensor it replaces: nothing changes
        return checked_result(action, selected, result, _is_tensor, where, meta)
    finally:
        state.disabled = saved
        if switch:
            _set_grad_enabled(True)


def _apply_actions(actions, values, where):
    """Run ``actions`` in order over ``values`` (a list, updated in place).
    Returns whether any value was replaced."""
    changed = False
    for action in actions:
        positions = action.positions
        if positions is None:
            selected = values
        else:
            try:
                if len(positions) == 1:
                    selected = [values[positions[0]]]    # no comprehension: the usual case
                else:
                    selected = [values[p] for p in positions]
            except IndexError:
                selected = select(values, positions, action, where)   # raises the error
        result = _invoke(action, selected, where)
        if result is None:
            continue
        for pos, new in zip(positions if positions is not None else range(len(values)), result):
            old = values[pos]
            if new is None or new is old:
                continue
            if isinstance(new, _Tensor) and isinstance(old, _Tensor) \
                    and old.layout is _STRIDED and new.layout is _STRIDED \
                    and not old.is_nested and not new.is_nested \
                    and new.stride() != old.stride():
                new = _in_layout_of(old, new)
            if not action.ad and isinstance(old, _Tensor) and _differentiated(old):
                if old.is_nested and old.layout is torch.strided:
                    raise _strided_nested(action, where)
                new = _StraightThrough.apply(old, [new.detach()])
            values[pos] = new
            changed = True
    return changed


_STRIDED = torch.strided


def _in_layout_of(old, new):
    """**Rule: a replacement takes the memory layout of the tensor it
    replaces.** What reads a tensor may compute other bits from the same
    values in another layout (a reduction sums in memory order: the backward
    of a gather over a gradient with gaps between its elements), so a
    routine's result of other strides (``clone()`` of a tensor with gaps
    between its elements is compact) is copied into a tensor of the
    original's strides. A broadcast tensor (an ``expand``: stride 0 along
    some dimensions, the gradient ``sum()`` sends back) takes its layout
    again where the replacement holds the same values all along those
    dimensions: batch norm's backward sums such a gradient to other bits than
    its compact copy (not inside a functorch transform, whose batched values
    cannot be compared). Any other tensor whose elements overlap in memory
    cannot hold other values in its layout, and a tensor of another layout
    than ``torch.strided`` has no strides: the replacement is kept as the
    routine made it."""
    if new.device != old.device:
        return new
    if _overlapping(old):
        return _broadcast_like(old, new)
    laid_out = torch.empty_strided(old.size(), old.stride(), dtype=new.dtype, device=new.device)
    laid_out.copy_(new)
    return laid_out


def _broadcast_like(old, new):
    """``new`` in the layout of the broadcast tensor ``old`` when its values
    repeat along ``old``'s stride-0 dimensions; else ``new`` itself."""
    if _interpreter_stack():
        return new      # inside a functorch transform: values unreadable (vmap's batches)
    size, stride = old.size(), old.stride()
    spread = [d for d in range(old.dim()) if stride[d] == 0 and size[d] > 1]
    base_size = [1 if d in spread else n for d, n in enumerate(size)]
    if not spread or new.size() != size or _overlapping(old.as_strided(base_size, stride)):
        return new
    corner = new
    for d in spread:
        corner = corner.narrow(d, 0, 1)
    if not torch.equal(corner.expand(size), new):
        return new      # other values along a broadcast dimension (or NaN): kept compact
    base = torch.empty_strided(base_size, stride, dtype=new.dtype, device=new.device)
    base.copy_(corner)
    return base.expand(size)


def _overlapping(tensor):
    """Whether two elements of a strided tensor may share memory (a stride
    that does not step past everything the smaller strides span)."""
    spanned = 0
    for stride, size in sorted(zip(tensor.stride(), tensor.size())):
        if size > 1:
            if stride <= spanned:
                return True
            spanned += stride * (size - 1)
    return False


def _strided_nested(action, where):
    """torch's autograd functions refuse nested tensors of the strided layout
    (\"NestedTensorImpl doesn't support sizes\"), so a replacement of one that
    autodiff follows cannot be wired in straight-through: said, not left to
    torch's internal error."""
    return routine_error(
        action, where,
        "replaced a nested tensor of the strided layout that "
        "autodiff follows; PyTorch's autograd functions cannot take one, so its gradient "
        "cannot pass straight through (build it with layout=torch.jagged, or record the "
        "action inside amanda.ad_enabled() to differentiate the routine)",
        what="instrumentation routine")


#: the analysis step every path shares (`amanda.passes.instrumentation.analyse_point`)
_analyse = analyse_point


def _output_spec(func, args, kwargs):
    """The structure of what ``func`` returns (a tensor, or a sequence with
    tensor metadata or None per item), found by running it on meta tensors:
    no data is read or written. None when the op cannot run on meta tensors
    (data-dependent shapes, ops without meta kernels)."""
    def to_meta(value):
        if isinstance(value, _Tensor):
            return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                       device="meta")
        if isinstance(value, (list, tuple)):
            return type(value)(to_meta(v) for v in value)
        return value
    try:
        with torch.device("meta"):
            result = func(*[to_meta(a) for a in args],
                          **{k: to_meta(v) for k, v in kwargs.items()})
    except Exception:
        return None
    if isinstance(result, _Tensor):
        return (result.shape, result.dtype)
    if isinstance(result, (list, tuple)):
        return [(r.shape, r.dtype) if isinstance(r, _Tensor) else None for r in result]
    return None


def _check_replacement(action, result, spec, where):
    """What a ``replace_op`` routine returned, checked against the op it
    replaces: a tensor for a one-output op, a sequence of as many tensors for
    a multi-output op, each with the shape and dtype the op would give."""
    def fail(message):
        return routine_error(action, where, message, what="replace_op routine")
    if isinstance(spec, tuple):               # one output
        if not isinstance(result, _Tensor):
            raise fail(f"returned {_describe_value(result)}; the op returns one tensor "
                       "(return a tensor, not a sequence)")
        got, want = _meta(result), spec
        if not _tracing() and got != want:
            raise fail(f"returned a tensor of shape {list(got[0])} and dtype {got[1]}; "
                       f"the op returns shape {list(want[0])} and dtype {want[1]}")
        return result
    if isinstance(result, _Tensor):
        if spec is None:
            return result
        raise fail(f"returned one tensor; the op returns {len(spec)} values")
    if not isinstance(result, (list, tuple)) or not all(
            isinstance(r, _Tensor) or r is None for r in result):
        raise fail(f"returned {_describe_value(result)}; expected a tensor or a sequence "
                   "of tensors")
    if spec is not None:
        if len(result) != len(spec):
            raise fail(f"returned {len(result)} values; the op returns {len(spec)}")
        for i, (r, want) in enumerate(zip(result, spec)):
            got = _meta(r)
            if got != want:
                raise fail(f"returned {got} at position {i}; the op returns {want} there")
    return result


_tracing = torch._C._get_tracing_state   # torch.jit.trace (amanda.export): sizes are traced


def _describe_value(value):
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else type(value).__name__


def _replace(action, selected, where):
    guard = EXPORTING.guard
    if guard is not None:
        with guard(action, selected, where):
            return _run_replacement(action, selected, where)
    return _run_replacement(action, selected, where)


def _run_replacement(action, selected, where):
    """A ``replace_op`` routine: under autodiff isolation its outputs have
    no autograd history, in reverse mode (``no_grad``) and in forward mode
    too (``_set_fwd_grad_enabled(False)``, which ``no_grad`` does not imply:
    before, ``jvp`` differentiated the routine where ``grad`` saw none)."""
    with controls.muted():
        if action.ad:
            return invoke(action, selected, where)
        with torch.no_grad(), _fwad._set_fwd_grad_enabled(False):
            return invoke(action, selected, where)
