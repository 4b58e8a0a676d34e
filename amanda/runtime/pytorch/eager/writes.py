"""PyTorch eager driver: what an op writes, and how routines' replacements
follow it.

An op that runs on tensors a before-routine replaced may write them (``add_``,
``out=``, batch norm's running statistics, a fused optimizer's state): the
write is carried into the originals (`_write_back`). An after-routine's
replacement of a tensor the op modified is written into it
(`_write_into_modified`). What an op writes is read from its version
counters, its name, and its ATen schema (`_writes_of`); writes through a view
of a replacement are said (`_check_view_write`). Used by the slow path of
:mod:`amanda.runtime.pytorch.eager.mode`.
"""

from __future__ import annotations

import types
import warnings

import torch

from amanda.errors import NotBitExactWarning, user_stacklevel
from amanda.runtime.pytorch.eager.segments import _state
from amanda.runtime.pytorch.eager.sites import _Tensor


def _mark_viewed(swapped, result):
    """Mark the replacements the op's result is a view of (``t()``,
    ``diagonal()``, ``x[0]`` run on a routine's tensor): an in-place write
    through that view reaches the replacement, not the original (Limits)."""
    if isinstance(result, _Tensor):
        outputs = (result,)
    elif isinstance(result, (list, tuple)):
        outputs = result
    else:
        return
    for out in outputs:
        if not isinstance(out, _Tensor):
            continue
        base = out._base
        for entry in swapped:
            new = entry[1]
            if base is None:
                # an alias that autograd does not count as a view
                # (``detach()``): the program's writes into it reach the
                # replacement only
                if out is not new and _shares_storage(out, new):
                    new._amanda_viewed = out._amanda_viewed = True
            elif base is new or base is new._base:
                new._amanda_viewed = True


def _shares_storage(a, b):
    """Whether two tensors alias one storage: also the aliases autograd does
    not count as views (``detach()`` has no ``_base``)."""
    try:
        ptr = a.untyped_storage().data_ptr()
        return ptr != 0 and ptr == b.untyped_storage().data_ptr() and a.device == b.device
    except (RuntimeError, NotImplementedError, TypeError):
        return False     # sparse, nested, functorch-wrapped: no plain storage


def _mark_replaced_views(produced, outputs, inputs=()):
    """Mark an after-routine's replacement of a view the op returned (or of
    an alias of an input that autograd does not count as a view, such as
    ``detach()``'s result): the program holds a tensor that no longer
    aliases the view's base, and an in-place write into it does not reach
    that base (Limits)."""
    for old, new in zip(produced, outputs):
        if new is not old and isinstance(old, _Tensor) and isinstance(new, _Tensor) and (
                old._base is not None or any(
                    t is not old and isinstance(t, _Tensor) and _shares_storage(old, t)
                    for t in inputs or ())):
            new._amanda_viewed = True


_IN_PLACE = {}


def _writes_in_place(name):
    flag = _IN_PLACE.get(name)
    if flag is None:
        flag = _IN_PLACE[name] = _in_place_name(name) or name == "__setitem__"
    return flag


def _viewed(tensor):
    if not isinstance(tensor, _Tensor):
        return False
    if getattr(tensor, "_amanda_viewed", False):
        return True
    base = tensor._base
    return base is not None and getattr(base, "_amanda_viewed", False)


def _check_view_write(tensors, where, args=()):
    """**Rule: a write through a view of a routine's replacement is said.**
    A before-routine that replaced the input of a view op with a new tensor
    made the view alias that tensor, and an after-routine that replaced a
    view the op returned gave the program a tensor that aliases nothing: an
    in-place write through the view
    (``chunk.diagonal().fill_(1)`` in ``torch.autograd.functional.jacobian``
    with ``vectorize=True``, ``p.detach().copy_(q)``) reaches the
    replacement, and the original, which the program reads afterwards, keeps
    its old value. amanda cannot make the write reach the original without
    writing the routine's value into it; it says so, once per scope, with a
    ``NotBitExactWarning`` (checked on ops that have points or actions).
    The tensors written are the first argument, or every tensor of it where
    it is a list (``_foreach_*_``)."""
    first = args[0] if args else None
    written = first if isinstance(first, (list, tuple)) else tensors[:1]
    if not any(_viewed(t) for t in written):
        return
    st = _state()
    if "view write" in st.scripted:
        return
    st.scripted.add("view write")
    warnings.warn(
        f"amanda: {where[0]} writes in place into a view of a tensor that an instrumentation "
        "routine replaced (the view op ran on the routine's tensor): the write reaches the "
        "routine's tensor, not the original, so results may differ from a run without "
        "amanda. Routines that return the tensors they receive avoid this. See "
        "docs/pytorch-eager.md, Limits.", NotBitExactWarning, stacklevel=user_stacklevel(torch))


def _version_of(tensor):
    """A tensor's version counter; None for an inference tensor, which has
    none."""
    return None if tensor.is_inference() else tensor._version


def _in_place_name(name):
    """Whether an op's name says it modifies its first argument (``add_``,
    ``__iadd__``): used only where no version counter tells."""
    return (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__"))


def _swapped(originals, tensors, slots, writes, probe=None):
    """[original, replacement, the replacement's version, whether the op
    writes that argument by its declaration (``_writes_of``), and, while the
    op is being probed (`_writes_of`), ``(probe key, slot, a copy of the
    replacement)``] for each tensor a before-routine replaced."""
    entries = []
    for old, new, slot in zip(originals, tensors, slots):
        if new is old or not isinstance(old, _Tensor) or not isinstance(new, _Tensor):
            continue
        declared = bool(writes) and _declared(writes, slot)
        snapshot = (probe, slot, new.detach().clone()) if probe is not None and not declared \
            and new.layout is torch.strided and not new.is_nested else None
        entries.append([old, new, _version_of(new), declared, snapshot])
    return entries


_BINDINGS = (types.BuiltinFunctionType, types.MethodDescriptorType)
# func -> the arguments its ATen schema marks as written (``Tensor(a!)``):
# positions and keyword names, or None when it declares none / has no schema
_WRITES = {}


def _declared_writes(func):
    """**Rule: an argument the op's schema declares written counts as
    modified, whether or not its version counter moved.** Most ops bump the
    version counter of what they write, which is how the rules below see a
    modification; torch's fused kernels do not (``_fused_adam_``,
    ``_fused_adamw_``, ``_fused_sgd_`` of ``fused=True`` optimizers, and
    ``_amp_foreach_non_finite_check_and_unscale_`` of ``GradScaler``), but
    their ATen schema says which arguments they write. Looked up once per
    function, by its name among ``torch.ops.aten`` (all overloads)."""
    try:
        return _WRITES[func]
    except KeyError:
        pass
    except TypeError:          # an unhashable callable: no schema
        return None
    found = set()
    try:
        for schema in _schemas(func):
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    found.add(arg.name)
                    if not arg.kwarg_only:
                        found.add(i)
    except Exception:          # noqa: BLE001 - not an ATen op: nothing declared
        found = set()
    writes = _WRITES[func] = frozenset(found) or None
    return writes


def _schemas(func):
    """The ATen schemas a call of ``func`` may run under, in the order its
    arguments are taken: an ``OpOverload``'s own, every overload's of an
    ``OpOverloadPacket`` (``torch.ops.aten.x``), or, for torch's generated
    bindings (``torch.add``, ``Tensor.add_``), every overload's of the ATen
    op of that name. A Python function (``F.batch_norm``) has none: its
    arguments need not be in any schema's order."""
    if isinstance(func, torch._ops.OpOverload):
        return [func._schema]
    if isinstance(func, torch._ops.OpOverloadPacket):
        packet = func
    elif isinstance(func, _BINDINGS):
        packet = getattr(torch.ops.aten, func.__name__, None)
    else:
        return []
    return [getattr(packet, overload)._schema for overload in packet.overloads()] \
        if packet is not None else []


# (func, the shape of its arguments: `_probe_key`) -> the argument slots a
# call of that kind was seen to write while probed (`_write_back`)
_PROBED = {}


def _probe_key(func, args, kwargs):
    """What decides whether a call of ``func`` writes its arguments, besides
    their values: the function and its non-tensor arguments (batch norm
    writes its running statistics only when its ``training`` flag is set);
    None for a call that cannot be keyed (it is then never probed)."""
    def shape(value):
        if isinstance(value, _Tensor):
            return "T"
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return "f"
        if isinstance(value, (list, tuple)):
            return tuple(shape(v) for v in value)
        return type(value).__name__
    try:
        key = (func, tuple(shape(a) for a in args),
               tuple(sorted((k, shape(v)) for k, v in kwargs.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _writes_of(func, args, kwargs):
    """The arguments this call of ``func`` writes by declaration, and
    whether to probe it: ``(writes, probe key or None)``.

    **Rule: what an op writes is what its ATen schema declares, or what a
    probe saw it write.** Some ops write arguments that neither their schema
    marks nor their version counters show: batch norm's running statistics
    (``F.batch_norm``, ``torch.batch_norm``, ``torch.native_batch_norm`` in
    training; their schemas declare only the ``out=`` overload's writes).
    The first call of each kind (`_probe_key`) on which a before-routine
    replaced a tensor the schema does not declare written compares each such
    replacement with a copy taken before the call; the arguments seen to
    change count as written for every later call of that kind. A probe costs one copy of the replaced tensors, once per kind of
    call. (An op whose write leaves a value unchanged on its first call is
    not seen to write it.)"""
    declared = _declared_writes(func)
    key = _probe_key(func, args, kwargs)
    if key is None:
        return declared, None
    seen = _PROBED.get(key)
    if seen is None:
        return declared, key
    return (declared or frozenset()) | seen or None, None


def _same_bits(a, b):
    """Whether a tensor still holds what its copy ``b`` holds (NaN equal to NaN)."""
    try:
        if torch.equal(a, b):
            return True
        return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else False
    except Exception:   # noqa: BLE001 - cannot be compared: nothing seen
        return True


def _declared(writes, slot):
    """Whether the argument at ``slot`` (see ``_flatten``) is declared written."""
    return slot[0] in writes


def _write_back(swapped, result, name):
    """**Rule: an op that modifies a tensor a before-routine replaced
    modifies the original.** The op ran on the replacement (``x.add_(1)``,
    ``out=``, batch norm's running statistics, an optimizer's ``_foreach_*_``
    on parameters and state): its new value is copied into the original,
    tracked by autograd where the op would be, and the op's result names the
    original where it named the replacement — as if the routine's value had
    been written into the original before the op ran. A leaf that requires
    grad (a parameter) is written under ``no_grad``: torch refuses in-place
    writes to one otherwise, so an op that modified it did so under
    ``no_grad`` itself (``F.embedding``'s ``max_norm`` renormalisation).
    (A modified original's entry keeps "written" as version:
    ``_write_into_modified`` reads it.)"""
    written = {}
    for entry in swapped:
        old, new, version, declared, snapshot = entry
        if declared:            # declared written (_writes_of)
            modified = True
        elif version is None:   # an inference tensor: no version counter
            modified = _in_place_name(name) and (new is result or result is None)
        else:
            modified = new._version != version
        if snapshot is not None:     # the op is being probed (_writes_of)
            key, slot, before = snapshot
            seen = _PROBED.setdefault(key, set())
            if not _same_bits(new, before):
                modified = True
                seen.add(slot[0])
        if modified:
            if old.shape != new.shape:
                # a write that resized its tensor (``resize_``: a quantization
                # observer's empty ``min_val`` buffer on its first call)
                with torch.no_grad():
                    old.resize_(new.shape)
            if old.is_leaf and old.requires_grad:
                with torch.no_grad():
                    old.copy_(new)
            else:
                old.copy_(new)
            written[id(new)] = old
            entry[2] = "written"
    if not written:
        return result
    if isinstance(result, _Tensor):
        return written.get(id(result), result)
    if isinstance(result, (list, tuple)) and not hasattr(result, "_fields"):
        return type(result)(written.get(id(r), r) if isinstance(r, _Tensor) else r
                            for r in result)
    return result


def _write_into_modified(produced, outputs, inputs, versions, swapped, returned_none, name,
                         slots=None, writes=None):
    """**Rule: an after-routine's replacement of a tensor the op modified
    (or created as a leaf) is written into it.** An in-place op returns the
    tensor it modified (one that returns None, ``__setitem__``, has it as its
    output); a factory op with ``requires_grad=True`` returns a new leaf. The
    value is written into that tensor under ``no_grad`` and the tensor stays
    the output, so chained calls (``buf.mul_(m).add_(g)``), every other
    reference and the leaf's ``.grad`` see the routine's value. An output
    that merely is an input (``broadcast_tensors`` with nothing to
    broadcast, ``contiguous()``) was not modified: it is replaced as usual."""
    modified = set()
    if returned_none:
        modified.update(id(t) for t in outputs)
    for i, (t, version) in enumerate(zip(inputs or (), versions or ())):
        if version is None:     # an inference tensor: the name tells
            if i == 0 and _in_place_name(name):
                modified.add(id(t))
        elif t._version != version:
            modified.add(id(t))
    if writes and inputs:
        modified.update(id(t) for t, slot in zip(inputs, slots) if _declared(writes, slot))
    for old, new, state, _, _ in swapped or ():
        if state == "written":
            modified.add(id(old))
    input_ids = {id(t) for t in inputs or ()}
    for i, (old, new) in enumerate(zip(produced, outputs)):
        if new is old or not isinstance(new, _Tensor) or not isinstance(old, _Tensor):
            continue
        if id(old) in modified or (old.is_leaf and old.requires_grad
                                   and id(old) not in input_ids):
            with torch.no_grad():
                old.copy_(new)
            outputs[i] = old
