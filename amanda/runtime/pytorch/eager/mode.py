"""PyTorch eager driver: the ``TorchFunctionMode`` and the per-op path.

``_Mode.__torch_function__`` sees every torch call (the hot path): it keys
the call by module, site and occurrence, finds or makes its record
(``_new_record``: the stable op id, named by module path), and either calls
the op directly (nothing to do) or runs it with its points and actions
(``_run_op``). Part of :mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import contextlib
import dis
import warnings

import torch
from torch.overrides import TorchFunctionMode

from amanda.errors import NotInstrumentedWarning, user_stacklevel
from amanda.runtime.pytorch.eager.backward import _install_backward, _walk_new_nodes
from amanda.runtime.pytorch.eager.records import (
    _BACKWARD_LANE, _BEFORE_LANE, _OpRecord, _stable_id)
from amanda.runtime.pytorch.eager.routines import (
    _analyse, _apply_actions, _check_replacement, _grad_enabled, _output_spec, _replace)
from amanda.runtime.pytorch.eager.segments import _drop_finished, _in_backward, _state
from amanda.runtime.pytorch.eager.sites import (
    _CODE_KIND, _CONTROLS, _FUNCS, _NOT_A_POINT, _SITE, _calling_site, _classify, _getframe,
    _sequence_nr, _Tensor)
from amanda.runtime.pytorch.eager.writes import (
    _check_view_write, _mark_replaced_views, _mark_viewed, _swapped, _write_back,
    _write_into_modified, _writes_in_place, _writes_of)
from amanda.runtime.routines import select
from amanda.tool import FORWARD_AFTER, FORWARD_BEFORE


# Module types that only wrap the user's model (amanda.export's call wrapper
# and torch's tracing wrapper): paths are named from below them, so an op has
# the same path and id in an export as in an eager run.
WRAPPER_MODULES = set()


def _module_path(refs):
    """Dotted path of the innermost module, as ``named_modules()`` names it:
    "" for the root, None outside any module. Wrappers (``WRAPPER_MODULES``:
    a ``torch.compile``'d layer's ``OptimizedModule``) are not part of it: a
    leading one is skipped, and below one in the middle the wrapped module
    takes the wrapper's name, so compiling a layer does not change the paths
    and ids of its ops (``layers.0.attn``, not ``layers.0._orig_mod.attn``)."""
    if WRAPPER_MODULES:
        refs = _below_wrappers(refs)
    if not refs:
        return None
    parts = []
    parent = refs[0]()
    for ref in refs[1:]:
        child = ref()
        if not (WRAPPER_MODULES and type(parent) in WRAPPER_MODULES):
            parts.append(_child_name(parent, child))
        parent = child
    return ".".join(parts)


def _below_wrappers(refs):
    start = 0
    while start < len(refs) and type(refs[start]()) in WRAPPER_MODULES:
        start += 1
    return refs[start:]


def _child_name(parent, child):
    # Containers that are not called themselves (nn.ModuleList, a dict of
    # modules...) sit between a caller and the module it calls: search below.
    for name, module in getattr(parent, "_modules", {}).items():
        if module is child:
            return name
    if hasattr(parent, "named_modules"):
        for name, module in parent.named_modules():
            if module is child and name:
                return name
    return type(child).__name__


# The instruction that calls an op, as the frame reports it (``f_lasti``),
# depends on how the interpreter made the call, not only on the code: from
# CPython 3.11, a call of a Python function (``F.layer_norm``, which hands the
# call to the mode) made inline by the interpreter leaves ``f_lasti`` on the
# last inline-cache entry of the ``CALL``; made through the C API it leaves it
# on the ``CALL`` itself, and the interpreter never inlines while a PEP 523
# frame evaluator is installed (Dynamo's, during a ``torch.compile``d call);
# a specialized 3.11 ``PRECALL`` makes some calls of builtins itself. Op keys
# (and so occurrence counts and ids) name the ``CALL`` instruction, whichever
# way the interpreter went (`_call_instruction`).
_CACHE = dis.opmap.get("CACHE")
_PRECALL = dis.opmap.get("PRECALL")
_NOT_THE_CALL = tuple(op in (_CACHE, _PRECALL) for op in range(256))


def _call_instruction(code, lasti):
    """The offset of the instruction that made the call ``f_lasti`` stands
    for: back from an inline-cache entry to its instruction, forward from a
    3.11 ``PRECALL`` to its ``CALL``."""
    raw = code.co_code
    while lasti > 0 and raw[lasti] == _CACHE:
        lasti -= 2
    if raw[lasti] == _PRECALL:
        lasti += 2 * (1 + dis._inline_cache_entries[_PRECALL])
    return lasti


class _Mode(TorchFunctionMode):
    """Sees every torch call; the hot path of the eager driver."""

    def __init__(self, st):
        super().__init__()
        self.st = st

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        name = _FUNCS.get(func, False)
        if name is False:
            name = _classify(func)
        if name is None or _CONTROLS.disabled:
            return func(*args, **kwargs)
        frame = _getframe(1)
        if _CODE_KIND.get(id(frame.f_code)) is not _SITE:
            frame = _calling_site(frame)
        if not frame:
            if frame is None:
                return _machinery_call(func, args, kwargs)
            return func(*args, **kwargs)     # made by a __torch_dispatch__ method
        st = self.st
        modules = st.modules
        code = frame.f_code
        lasti = frame.f_lasti
        if _NOT_THE_CALL[code.co_code[lasti]]:
            lasti = _call_instruction(code, lasti)
        key = (modules[-1] if modules else None, id(code), lasti, func)
        if st.recomputing and _in_backward() == -1:
            st.end_recompute()             # the backward pass is over
            modules = st.modules
            key = (None, key[1], key[2], func)
        if modules:
            counts = st.counts
            n = counts.get(key, 0)
            counts[key] = n + 1
        else:
            n = 0     # outside modules, an op is its site: see _new_record
        cache = st.cache
        record = cache.records.get((key, n))
        if record is None:
            if modules and not st.recomputing and _in_backward() == -1 \
                    and _drop_finished(st, frame):
                # modules left on the stack by an interrupted call: this
                # call is keyed again without them
                if n:
                    st.counts[key] = n
                else:
                    st.counts.pop(key, None)
                return self.__torch_function__(func, types, args, kwargs)
            if _tracer(st) is not None:
                return _traced_call(st, func, args, kwargs)
            if func not in _PRODUCERS and not _has_tensor(args, kwargs):
                return _first_call_without_tensors(st, cache, key, n, name, func, frame,
                                                   args, kwargs)
            record = _new_record(st, cache, key, n, name, func, frame)
        fast = record.fast
        if fast and cache.trace is None and _CONTROLS.cache:
            if fast is True or not _grad_enabled():
                return func(*args, **kwargs)
            if _tracer(st) is not None:
                return _traced_call(st, func, args, kwargs)
            mark = _sequence_nr()
            result = func(*args, **kwargs)
            if _sequence_nr() - mark != record.nodes:
                _walk_again(cache, record, args, kwargs, result, mark)
            return result
        if _tracer(st) is not None:
            return _traced_call(st, func, args, kwargs)
        lane = record.lane
        if lane is not None and cache.trace is None and _CONTROLS.cache:
            return _LANES[lane](record, func, args, kwargs)
        return _run_op(cache, record, func, args, kwargs)


_get_dispatch_mode = torch._C._get_dispatch_mode
_dispatch_modes = torch._C._len_torch_dispatch_stack
_PROXY_MODE = torch._C._TorchDispatchModeKey.PROXY
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_jit_tracing_state = torch._C._get_tracing_state
_is_exporting = torch.compiler.is_exporting


def _tracer(st):
    """What traces the current torch call instead of executing it, or None:
    an FX proxy mode (``make_fx``, ``torch.export``, AOTAutograd), fake
    tensors (``FakeTensorMode``: shapes only) or the TorchScript tracer
    (``torch.jit.trace``; not while ``amanda.export`` records the
    instrumented model with it: `recording_instrumented_trace`). Checked on
    the slow paths only: an op with nothing to do runs the same traced or
    not."""
    if _dispatch_modes():       # (the count includes the proxy and fake modes)
        if _get_dispatch_mode(_PROXY_MODE) is not None:
            return "an FX tracer (make_fx, torch.export, AOTAutograd)"
        if _get_dispatch_mode(_FAKE_MODE) is not None:
            return "fake tensors (FakeTensorMode, torch.export)"
    if _jit_tracing_state() is not None and not st.instrumented_trace:
        return "torch.jit.trace"
    if _is_exporting():
        return "torch.export"
    return None


@contextlib.contextmanager
def recording_instrumented_trace():
    """Inside, the TorchScript tracer records the instrumented ops and their
    routines (``amanda.export``'s own trace) instead of the plain program."""
    st = _state()
    prior = st.instrumented_trace
    st.instrumented_trace = True
    try:
        yield
    finally:
        st.instrumented_trace = prior


def _traced_call(st, func, args, kwargs):
    """A call that a tracer records rather than executes: not a point. It
    gets no analysis, no routine and no backward hook, so the traced program
    is the plain one and no routine sees a fake tensor or a proxy; amanda
    says so once per scope."""
    if not st.traced_warned:
        st.traced_warned = True
        warnings.warn(
            f"amanda: torch calls traced by {_tracer(st)} inside apply are recorded, not "
            "executed: they get no instrumentation points and the traced program is the "
            "uninstrumented one (to export an instrumented model use amanda.export). "
            "See docs/pytorch-eager.md, Limits.",
            NotInstrumentedWarning, stacklevel=user_stacklevel(torch))
    return func(*args, **kwargs)


def _machinery_call(func, args, kwargs):
    """A call made by torch's checkpointing machinery (not an op). The tensors
    it makes (reentrant checkpointing's detached inputs) are marked, so their
    gradient accumulators are not taken for backward ops of the model."""
    result = func(*args, **kwargs)
    for tensor in _flatten_outputs(result):
        tensor._amanda_machinery = True
    return result


# Functions seen returning a tensor from no tensor arguments (factories).
_PRODUCERS = set()


def _has_tensor(args, kwargs):
    for a in args:
        if isinstance(a, _Tensor) or (isinstance(a, (list, tuple)) and
                                      any(isinstance(b, _Tensor) for b in a)):
            return True
    return any(isinstance(a, _Tensor) for a in kwargs.values())


def _first_call_without_tensors(st, cache, key, n, name, func, frame, args, kwargs):
    """A call with no tensor argument may compute no tensor at all
    (``torch._C._set_grad_enabled`` under ``torch.no_grad()``, profiler
    ranges): such calls are not points. The first call of such a function is
    made, then classified by its result: a function that returned no tensor
    is never a point again; a factory (``torch.zeros``) is a point from now
    on, and this first call gets its points around the result it computed."""
    result = func(*args, **kwargs)
    if not _flatten_outputs(result):
        _FUNCS[func] = _NOT_A_POINT
        if n:
            st.counts[key] = n      # not an occurrence of an op after all
        else:
            st.counts.pop(key, None)
        return result
    _PRODUCERS.add(func)
    record = _new_record(st, cache, key, n, name, func, frame)
    return _run_op(cache, record, func, args, kwargs, computed=result)


def _new_record(st, cache, key, n, name, func, frame):
    path = _module_path(st.modules)
    code = frame.f_code
    parts = [path, code.co_qualname, frame.f_lineno, name, n]
    op_id = _stable_id(*parts)
    while True:
        other = cache.ids.setdefault(op_id, key)
        if other == key:
            break
        if other[1:] == key[1:] and (other, n) in cache.records:
            return _same_op_new_module(cache, op_id, other, key, n)
        parts.append("+")                # distinct sites, distinct ids
        op_id = _stable_id(*parts)
    record = cache.records[(key, n)] = _OpRecord(cache.session, op_id, name, func, path)
    return record


def _same_op_new_module(cache, op_id, other, key, n):
    """The same site at the same module path, in another module object: a
    module built anew at each call (``ACT2FN[...]()`` in transformers). It is
    the same op, with the same id and record; the entry of the module that
    is gone is dropped, so the records do not grow step after step."""
    record = cache.records[(key, n)] = cache.records[(other, n)]
    if other[0] is not None and other[0]() is None:
        del cache.records[(other, n)]
        cache.ids[op_id] = key
    return record


# -- the slow path: analysis and actions ----------------------------------------

def _flatten(args, kwargs):
    """Tensors among the arguments, in order, and where each one sits."""
    tensors, slots = [], []
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            tensors.append(a)
            slots.append((i, None))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, _Tensor):
                    tensors.append(b)
                    slots.append((i, j))
    for k, a in kwargs.items():
        if isinstance(a, _Tensor):
            tensors.append(a)
            slots.append((k, None))
    return tensors, slots


def _rebuild(args, kwargs, slots, tensors):
    args, kwargs = list(args), dict(kwargs)
    for (where, inner), tensor in zip(slots, tensors):
        box = kwargs if isinstance(where, str) else args
        if inner is None:
            box[where] = tensor
        else:
            seq = list(box[where])
            seq[inner] = tensor
            box[where] = type(box[where])(seq) if isinstance(box[where], tuple) else seq
    return tuple(args), kwargs


def _flatten_outputs(result):
    if isinstance(result, _Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [r for r in result if isinstance(r, _Tensor)]
    return []


def _rebuild_outputs(result, new):
    if isinstance(result, _Tensor):
        return new[0]
    items, it = [], iter(new)
    for r in result:
        items.append(next(it) if isinstance(r, _Tensor) else r)
    if isinstance(result, list):
        return items
    if hasattr(result, "_fields"):      # namedtuple
        return type(result)(*items)
    try:
        return type(result)(items)       # tuple and torch.return_types
    except TypeError:
        return tuple(items)


# -- the short lanes of the slow path (record.lane; cache on, no trace) -----------

def _backward_lane(record, func, args, kwargs):
    """Backward points only (a backward op with actions; nothing runs in
    forward, nothing left to analyse): run the op, hook its new nodes."""
    mark = _sequence_nr()
    result = func(*args, **kwargs)
    if _grad_enabled():
        nodes = _walk_new_nodes(_op_outputs(result, args), mark, record.owner)
        record.walked = True
        record.nodes = _sequence_nr() - mark
        if nodes:
            _install_backward(record.session, record, nodes,
                              lambda: _flatten(args, kwargs)[0])
    return result


def _before_lane(record, func, args, kwargs):
    """Forward "before" actions only, no backward routines, nothing left to
    analyse: the op is never walked (see _OpRecord.refresh). Where the
    arguments sit is found only when a routine replaced one."""
    tensors = _tensors_of(args, kwargs)
    if tensors and _writes_in_place(record.name):
        _check_view_write(tensors, record.where, args)
    values = list(tensors)
    if not _apply_actions(record.before, values, record.where):
        return func(*args, **kwargs)
    slots = _flatten(args, kwargs)[1]
    swapped = _swapped(tensors, values, slots, *_writes_of(func, args, kwargs))
    args, kwargs = _rebuild(args, kwargs, slots, values)
    result = _write_back(swapped, func(*args, **kwargs), record.name)
    _mark_viewed(swapped, result)
    return result


_LANES = {_BACKWARD_LANE: _backward_lane, _BEFORE_LANE: _before_lane}


def _tensors_of(args, kwargs):
    """The tensors among the arguments, in ``_flatten``'s order."""
    tensors = []
    for a in args:
        if isinstance(a, _Tensor):
            tensors.append(a)
        elif isinstance(a, (list, tuple)):
            tensors.extend([b for b in a if isinstance(b, _Tensor)])
    if kwargs:
        tensors.extend([a for a in kwargs.values() if isinstance(a, _Tensor)])
    return tensors


_NOTHING = object()


def _run_op(cache, record, func, args, kwargs, computed=_NOTHING):
    session = cache.session
    if not _CONTROLS.cache:
        record = record.fresh()
    where = record.where
    trace = cache.trace
    if (record.before or record.after or record.replace or not record.pre_done
            or not record.post_done or trace is not None):
        tensors = _tensors_of(args, kwargs)
    else:
        tensors = None    # found only if a gradient accumulator is to be named
    context = None
    if not record.pre_done:
        context = record.get_context()
        context._set_values(inputs=tensors)
        context._set_recomputation(_in_backward() != -1)
        if trace is not None:
            context._set_graph(trace.graph)
        try:
            _analyse(session, FORWARD_BEFORE, context, record)
        finally:
            context._set_values(inputs=None)
        record.pre_done = True
    if tensors and _writes_in_place(where[0]):
        _check_view_write(tensors, where, args)
    swapped = None
    if record.before:
        originals = list(tensors)
        if _apply_actions(record.before, tensors, where):
            slots = _flatten(args, kwargs)[1]
            swapped = _swapped(originals, tensors, slots, *_writes_of(func, args, kwargs))
            args, kwargs = _rebuild(args, kwargs, slots, tensors)
    versions = ([None if t.is_inference() else t._version for t in tensors]   # _version_of
                if record.after and computed is _NOTHING else None)
    mark = _sequence_nr()
    if record.replace:
        action = record.replace[0]
        if record.spec is None:
            record.spec = _output_spec(func, args, kwargs)
        result = _replace(action, select(tensors, action.positions, action, where), where)
        result = _check_replacement(action, result, record.spec, where)
    elif computed is _NOTHING:
        result = func(*args, **kwargs)
        if swapped:
            result = _write_back(swapped, result, where[0])
            _mark_viewed(swapped, result)
    else:
        result = computed
    outputs = None     # found when something looks at them
    nodes = ()
    if _grad_enabled() and (record.watch or cache.trace is not None or (
            session.has_backward and _sequence_nr() - mark != record.nodes)):
        # (a changed count of new autograd nodes: an input that now requires
        # grad makes backward ops this op did not have before)
        outputs = _op_outputs(result, args)
        nodes = _walk_new_nodes(outputs, mark, record.owner)
        record.walked = True
        record.nodes = _sequence_nr() - mark
        if nodes:
            _install_backward(session, record, nodes, tensors if tensors is not None
                              else lambda: _flatten(args, kwargs)[0])
    if outputs is None and (trace is not None or not record.post_done or record.after):
        outputs = _op_outputs(result, args)
    ir_op = trace.forward(record, func, args, kwargs, tensors, outputs, nodes) if trace else None
    if not record.post_done:
        context = record.get_context()
        context._set_values(inputs=tensors, outputs=outputs)
        if trace is not None:
            context._set_ir(ir_op, trace.graph)
        try:
            _analyse(session, FORWARD_AFTER, context, record)
        finally:
            context._set_values(inputs=None, outputs=None)
        record.post_done = True
    if record.after:
        produced = list(outputs)
        if _apply_actions(record.after, outputs, where):
            _write_into_modified(produced, outputs, tensors, versions, swapped,
                                 result is None, where[0], _flatten(args, kwargs)[1],
                                 _writes_of(func, args, kwargs)[0])
            _mark_replaced_views(produced, outputs, tensors)
            if result is not None:
                result = _rebuild_outputs(result, outputs)
            if ir_op is not None:
                trace.alias(outputs, ir_op.outputs)
    record.refresh()
    return result


def _walk_again(cache, record, args, kwargs, result, mark):
    """The op created other autograd nodes than when it was last walked:
    find them, so a backward op seen for the first time is analysed."""
    nodes = _walk_new_nodes(_op_outputs(result, args), mark, record.owner)
    record.nodes = _sequence_nr() - mark
    if nodes:
        _install_backward(cache.session, record, nodes, lambda: _flatten(args, kwargs)[0])
    record.refresh()


def _op_outputs(result, args):
    """The tensors an op produced: those it returned, or, for an in-place op
    that returns None (``Tensor.__setitem__``, ``_foreach_*_``), those it
    modified, its first argument. Every path that looks at an op's outputs
    (points, the autograd walk, a walk again on the fast path) uses this."""
    if result is None:
        return _modified_tensors(args)
    return _flatten_outputs(result)


def _modified_tensors(args):
    first = args[0] if args else None
    if isinstance(first, _Tensor):
        return [first]
    if isinstance(first, (list, tuple)):
        return [t for t in first if isinstance(t, _Tensor)]
    return []
