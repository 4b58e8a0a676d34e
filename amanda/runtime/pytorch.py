"""PyTorch eager driver: every operator call is an instrumentation point.

How it works (the paper's eager "JIT", Sec. 5):

* A ``TorchFunctionMode`` sees every ``torch.*``, ``torch.nn.functional.*`` and
  Tensor method/operator call made by user code; calls made *inside* an op
  (e.g. ``F.layer_norm`` calling ``torch.layer_norm``) are part of that op.
* Each call gets a stable op id from (innermost module, calling code location,
  function, occurrence count). Counts restart when a root module is entered
  (or, for code outside modules, when the first op of the step runs again), so
  next step's conv gets the same id though its tensors are new objects.
* At an op's first execution the tools' analysis routines run and record
  actions; later executions replay them. An op without actions takes a short
  path that only looks its record up.
* The autograd nodes an op creates are found by walking from its outputs down
  to nodes older than the op (autograd sequence numbers), so one forward op can
  own many backward ops. Backward points are node pre/post hooks installed on
  those nodes only when something must run there.

Nothing global is left behind: the mode is popped and the two global module
hooks (which track the modules being called) are removed when the outermost
``apply`` scope exits.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import weakref

import torch
from torch.nn.modules import module as _torch_module
from torch.overrides import TorchFunctionMode

from amanda import controls
from amanda.context import OpContext, take_actions
from amanda.errors import ToolError
from amanda.runtime.routines import call_routine, select
from amanda.tool import BACKWARD_AFTER, BACKWARD_BEFORE, FORWARD_AFTER, FORWARD_BEFORE

NAMESPACE = "pytorch/" + torch.__version__.split("+")[0] + "/eager"
_CONTROLS = controls.state
_getframe = sys._getframe

_sequence_nr = torch._C._autograd._get_sequence_nr
_ACCUMULATE = 2 ** 64 - 1  # AccumulateGrad nodes carry the largest sequence number
_Tensor = torch.Tensor

# Calls that compute no tensor are not instrumentation points.
_QUERIES = frozenset("""
size dim numel stride storage_offset is_contiguous element_size nelement ndimension
data_ptr is_floating_point is_complex is_signed get_device is_nonzero equal item tolist
numpy __array__ __array_wrap__ __len__ __bool__ __int__ __float__ __index__ __complex__
__repr__ __str__ __format__ __hash__ __reduce_ex__ __setstate__ __getstate__ __deepcopy__
__iter__ __contains__ __dlpack__ __dlpack_device__ backward register_hook
register_post_accumulate_grad_hook retain_grad requires_grad_ untyped_storage storage
_typed_storage is_shared is_pinned is_set_to has_names is_inference dim_order __set__
__delete__ _is_view is_same_size __torch_function__ __get__
""".split())
# Tensor properties that do compute a tensor (views), unlike .shape or .grad.
_TENSOR_PROPERTIES = frozenset("T mT H mH real imag".split())

_NOT_A_POINT = None
# func -> op name, or _NOT_A_POINT. Running the backward pass is not a forward
# op: its nodes are the backward ops.
_FUNCS = {torch.autograd.grad: _NOT_A_POINT, torch.autograd.backward: _NOT_A_POINT}


def _classify(func):
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property read: x.shape, x.T, x.grad ...
        attr = getattr(getattr(func, "__self__", None), "__name__", None)
        name = attr if attr in _TENSOR_PROPERTIES else _NOT_A_POINT
    elif name in _QUERIES:
        name = _NOT_A_POINT
    _FUNCS[func] = name
    return name


# Code objects of torch and amanda's runtime: the calling site of an op is the
# first frame outside them (amanda.models and tools are ordinary callers).
# Keyed by id(): hashing a code object rehashes its constants on every call,
# which is slow for large functions; the codes are kept alive here so their
# ids stay valid.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.abspath(__file__)) + os.sep)   # amanda's runtime
_LIBRARY_CODE = {}
_SEEN_CODE = []


def _is_library_code(code):
    flag = _LIBRARY_CODE.get(id(code))
    if flag is None:
        _SEEN_CODE.append(code)
        flag = _LIBRARY_CODE[id(code)] = code.co_filename.startswith(_LIBRARY_DIRS)
    return flag


class BackwardOp:
    """What ``OpContext.get_backward_op()`` returns in PyTorch: the autograd
    node's name (``ConvolutionBackward0``, ``AccumulateGrad``...) and its
    position among the backward ops of its forward op. The live node is not
    kept: a hook holding its own node would never be freed."""

    def __init__(self, name, index):
        self.__name__ = name
        self.index = index

    def name(self):
        return self.__name__

    def __repr__(self):
        return f"<BackwardOp {self.__name__} #{self.index}>"


class _StraightThrough(torch.autograd.Function):
    """Forward: the routine's value. Backward: the gradient goes to the
    original tensor unchanged, as if the routine were the identity."""

    @staticmethod
    def forward(ctx, original, replacement):
        return replacement

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_STRAIGHT_THROUGH_NODE = None  # set lazily: the autograd node class of _StraightThrough


def _is_straight_through(node):
    return type(node) is _STRAIGHT_THROUGH_NODE


def resolve_straight_through(node):
    """The node behind the driver's pass-through nodes (None stays None)."""
    while node is not None and type(node) is _STRAIGHT_THROUGH_NODE:
        node = node.next_functions[0][0]
    return node


def _is_tensor(value):
    return isinstance(value, _Tensor)


# -- per-op records ---------------------------------------------------------

# Backward ops whose hooks were installed this many steps without ever running
# are taken for dead (e.g. BERT's pooler when the loss reads only
# last_hidden_state): their analysis is dropped so the forward op can go fast.
_DEAD_AFTER = 3


class _BackwardRecord:
    __slots__ = ("op_id", "name", "index", "parent", "context", "pre_done", "post_done",
                 "before", "after", "replace", "unrun")

    def __init__(self, parent, index, name, session):
        self.parent = parent
        self.index = index
        self.name = name
        self.op_id = _stable_id(parent.op_id, index, name)
        self.context = None
        self.pre_done = not session.routines[BACKWARD_BEFORE]
        self.post_done = not session.routines[BACKWARD_AFTER]
        self.before, self.after, self.replace = [], [], []
        self.unrun = 0   # steps hooked for analysis without running

    def waiting(self):
        """Whether analysis hooks are still worth installing on this op."""
        if self.pre_done and self.post_done:
            return False
        self.unrun += 1
        if self.unrun > _DEAD_AFTER:
            self.pre_done = self.post_done = True
            return False
        return True

    @property
    def idle(self):
        return self.pre_done and self.post_done and not (self.before or self.after or self.replace)


class _OpRecord:
    __slots__ = ("op_id", "name", "func", "module_path", "context", "pre_done", "post_done",
                 "before", "after", "replace", "backward", "walked", "fast", "watch", "session",
                 "where")

    def __init__(self, session, op_id, name, func, module_path):
        self.session = session
        self.op_id = op_id
        self.name = name
        self.func = func
        self.module_path = module_path
        self.context = None
        self.pre_done = not session.routines[FORWARD_BEFORE]
        self.post_done = not session.routines[FORWARD_AFTER]
        self.before, self.after, self.replace = [], [], []
        self.backward = {}      # (index, node name) -> _BackwardRecord
        self.walked = False     # backward ops discovered at least once
        self.where = (name, op_id, NAMESPACE)   # for error messages
        self.refresh()

    def fresh(self):
        """An uncached copy: analysis runs again, actions apply once."""
        return _OpRecord(self.session, self.op_id, self.name, self.func, self.module_path)

    def needs_walk(self):
        if any(not b.idle for b in self.backward.values()):
            return True
        return self.session.has_backward and not self.walked

    def refresh(self):
        self.watch = self.needs_walk()
        self.fast = (self.pre_done and self.post_done and not self.before and not self.after
                     and not self.replace and not self.watch)

    def get_context(self):
        if self.context is None:
            self.context = OpContext(NAMESPACE, self.func, self.op_id, self.name,
                                     module_path=self.module_path)
        return self.context

    def backward_record(self, index, name):
        key = (index, name)
        record = self.backward.get(key)
        if record is None:
            record = self.backward[key] = _BackwardRecord(self, index, name, self.session)
        return record


def _stable_id(*parts):
    """A 63-bit id from text parts: the same in every run and process."""
    text = "\x1f".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


class _Cache:
    """A session's PyTorch state: op records by (site key, occurrence)."""

    def __init__(self, session):
        self.session = session
        self.records = {}
        self.ids = {}          # op id -> site key, to keep ids distinct
        self.settled_sequence = None  # module calls of a step with nothing to do
        self.trace = None
        if session.requires_graph:
            from amanda.frontends.pytorch import EagerTrace
            self.trace = EagerTrace(NAMESPACE, on_complete=session.graph_completed,
                                    resolve_node=resolve_straight_through)


# -- per-thread state ----------------------------------------------------------

class _ThreadState:
    """Per-thread driver state.

    *Settling*: once a whole step (root module call to root module call) ran
    with every op on the short path — analysed, no actions, no pending
    backward analysis — the mode is popped and ops run at vanilla speed, as
    the paper's action cache switches uninstrumented ops back to vanilla.
    Module calls are still tracked: the first one that departs from the
    settled step's sequence (a new code path), a disabled cache or another
    tool set pushes the mode back at once.
    """

    def __init__(self):
        self.depth = 0
        self.cache = None
        self.mode = None
        self.modules = []       # weak references to the modules being called
        self.counts = {}        # site key -> occurrences in this step
        self.first_key = None   # first op outside modules in this step
        self.settled = False
        self.clean = False      # every op of this step took the short path
        self.sequence = []      # module calls of this step (while not settled)
        self.expected = []      # module calls of the settled step
        self.position = 0

    def new_step(self):
        self.counts.clear()
        self.first_key = None
        if self.settled:
            self.position = 0
            return
        self.remember_clean_step()
        cache = self.cache
        if cache.settled_sequence is not None and cache.trace is None and _CONTROLS.cache:
            self.expected = cache.settled_sequence
            self.position = 0
            self.settle()
        self.sequence = []
        self.clean = True

    def remember_clean_step(self):
        """A step that ran entirely on the short path becomes the session's
        settled sequence (kept across apply scopes of the same tools)."""
        if self.clean and self.sequence and self.cache.trace is None and _CONTROLS.cache:
            self.cache.settled_sequence = self.sequence

    def reset(self, cache):
        self.cache = cache
        self.counts.clear()
        self.first_key = None
        self.modules.clear()
        self.settled = self.clean = False
        self.sequence, self.expected, self.position = [], [], 0

    def settle(self):
        self.settled = True
        self.mode.__exit__(None, None, None)

    def unsettle(self):
        if self.settled:
            self.settled = False
            self.mode.__enter__()
        self.clean = False
        self.cache.settled_sequence = None

    def module_called(self, ref):
        if not self.settled:
            self.sequence.append(ref)
            return
        position = self.position
        expected = self.expected
        if position < len(expected) and expected[position] == ref and _CONTROLS.cache:
            self.position = position + 1
        else:
            self.unsettle()   # a code path the settled step did not take
            self.sequence.append(ref)


_tls = threading.local()


def _state():
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _ThreadState()
    return st


def _module_pre_hook(module, args):
    """Global forward pre-hook while amanda is applied: keeps the stack of
    modules being called. (Wrapping ``nn.Module.__call__`` would be cheaper
    per call, but assigning a class attribute of ``nn.Module`` invalidates the
    type caches of every subclass, which costs ~0.5 ms per apply scope.)"""
    st = getattr(_tls, "state", None)
    if st is None or not st.depth:
        return
    modules = st.modules
    if not modules:
        st.new_step()  # a root module call starts a step
    ref = weakref.ref(module)
    st.module_called(ref)
    modules.append(ref)


def _module_post_hook(module, args, output):
    st = getattr(_tls, "state", None)
    if st is not None and st.depth and st.modules:
        st.modules.pop()


# Module types that only wrap the user's model (amanda.export's call wrapper
# and torch's tracing wrapper): paths are named from below them, so an op has
# the same path and id in an export as in an eager run.
WRAPPER_MODULES = set()


def _module_path(refs):
    """Dotted path of the innermost module, as ``named_modules()`` names it:
    "" for the root, None outside any module."""
    if WRAPPER_MODULES:
        refs = _below_wrappers(refs)
    if not refs:
        return None
    parts = []
    parent = refs[0]()
    for ref in refs[1:]:
        child = ref()
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
        st = self.st
        frame = _getframe(1)
        flag = _LIBRARY_CODE.get(id(frame.f_code))
        while flag or flag is None:  # up to the first frame outside torch and the runtime
            if flag is None:
                flag = _is_library_code(frame.f_code)
                continue
            if frame.f_back is None:
                break
            frame = frame.f_back
            flag = _LIBRARY_CODE.get(id(frame.f_code))
        modules = st.modules
        key = (modules[-1] if modules else None, id(frame.f_code), frame.f_lasti, func)
        counts = st.counts
        n = counts.get(key, 0)
        if not modules:
            if st.first_key is None:
                st.first_key = key
            elif n and key == st.first_key:  # code outside modules starts a new step
                counts.clear()
                n = 0
        counts[key] = n + 1
        cache = st.cache
        record = cache.records.get((key, n))
        if record is None:
            record = _new_record(st, cache, key, n, name, func, frame)
        if record.fast and cache.trace is None and _CONTROLS.cache:
            return func(*args, **kwargs)
        st.clean = False
        return _run_op(cache, record, func, args, kwargs)


def _new_record(st, cache, key, n, name, func, frame):
    st.clean = False
    path = _module_path(st.modules)
    code = frame.f_code
    parts = [path, code.co_qualname, frame.f_lineno, name, n]
    op_id = _stable_id(*parts)
    while cache.ids.setdefault(op_id, key) != key:  # distinct sites, distinct ids
        parts.append("+")
        op_id = _stable_id(*parts)
    record = cache.records[(key, n)] = _OpRecord(cache.session, op_id, name, func, path)
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


_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class _Exporting(threading.local):
    """Set by ``amanda.export`` in the thread that traces a model for export:
    ``guard(action, selected, where)`` is a context manager wrapped around each
    routine call; it refuses routines that an exported graph cannot hold."""

    guard = None


EXPORTING = _Exporting()


def _invoke(action, selected, where):
    """Run a routine with autodiff isolation unless it opted in. Amanda is
    disabled meanwhile: a routine's own torch calls are not instrumented
    (inside the mode's handler torch has popped the mode already; the flag
    covers backward hooks)."""
    state = _CONTROLS
    saved, state.disabled = state.disabled, True
    grad = _grad_enabled()
    switch = grad and not action.ad
    if switch:
        _set_grad_enabled(False)   # cheaper than a torch.no_grad() object
    try:
        guard = EXPORTING.guard
        if guard is not None:
            with guard(action, selected, where):
                return call_routine(action, selected, _is_tensor, where)
        return call_routine(action, selected, _is_tensor, where)
    finally:
        if switch:
            _set_grad_enabled(True)
        state.disabled = saved


def _apply_actions(actions, values, where):
    """Run ``actions`` in order over ``values`` (a list, updated in place).
    Returns whether any value was replaced."""
    changed = False
    for action in actions:
        positions = action.positions
        selected = values if positions is None else select(values, positions, action, where)
        result = _invoke(action, selected, where)
        if result is None:
            continue
        for pos, new in zip(positions if positions is not None else range(len(values)), result):
            old = values[pos]
            if new is None or new is old:
                continue
            if not action.ad and isinstance(old, _Tensor) and old.requires_grad \
                    and _grad_enabled():
                new = _StraightThrough.apply(old, new.detach())
            values[pos] = new
            changed = True
    return changed


def _analyse(session, point, context, record):
    state = controls.state
    saved, state.disabled = state.disabled, True
    try:
        session.analyse(point, context)
    finally:
        state.disabled = saved
    take_actions(context, record)


def _run_op(cache, record, func, args, kwargs):
    session = cache.session
    if not controls.state.cache:
        record = record.fresh()
    where = record.where
    tensors, slots = _flatten(args, kwargs)
    context = None
    trace = cache.trace
    if not record.pre_done:
        context = record.get_context()
        context._inputs = tensors
        if trace is not None:
            context._graph = trace.graph
        try:
            _analyse(session, FORWARD_BEFORE, context, record)
        finally:
            context._inputs = None
        record.pre_done = True
    if record.before and _apply_actions(record.before, tensors, where):
        args, kwargs = _rebuild(args, kwargs, slots, tensors)
    mark = _sequence_nr()
    if record.replace:
        action = record.replace[0]
        result = _replace(action, select(tensors, action.positions, action, where), where)
    else:
        result = func(*args, **kwargs)
    outputs = _flatten_outputs(result)
    nodes = ()
    if (record.watch or cache.trace is not None) and _grad_enabled():
        nodes = _walk_new_nodes(outputs, mark, (session.token, record.op_id))
        record.walked = True
        if nodes:
            _install_backward(session, record, nodes)
    ir_op = trace.forward(record, func, args, kwargs, tensors, outputs, nodes) if trace else None
    if not record.post_done:
        context = record.get_context()
        context._inputs, context._outputs = tensors, outputs
        if trace is not None:
            context._graph, context._ir_op = trace.graph, ir_op
        try:
            _analyse(session, FORWARD_AFTER, context, record)
        finally:
            context._inputs = context._outputs = None
        record.post_done = True
    if record.after and outputs and _apply_actions(record.after, outputs, where):
        result = _rebuild_outputs(result, outputs)
        if ir_op is not None:
            trace.alias(outputs, ir_op.outputs)
    record.refresh()
    return result


def _replace(action, selected, where):
    guard = EXPORTING.guard
    if guard is not None:
        with guard(action, selected, where):
            return _run_replacement(action, selected, where)
    return _run_replacement(action, selected, where)


def _run_replacement(action, selected, where):
    state = controls.state
    saved, state.disabled = state.disabled, True
    try:
        if action.ad:
            return action.func(*selected, **action.kwargs)
        with torch.no_grad():
            return action.func(*selected, **action.kwargs)
    except Exception as exc:
        op_name, op_id, namespace = where
        raise ToolError(f"replace_op routine raised {type(exc).__name__}: {exc}",
                        tool=action.tool, routine=action.func, op_name=op_name,
                        op_id=op_id, namespace=namespace) from exc
    finally:
        state.disabled = saved


# -- backward ops -----------------------------------------------------------------

def _walk_new_nodes(outputs, mark, owner):
    """Autograd nodes created since sequence number ``mark``, reachable from
    the outputs, in breadth-first order.

    Gradient accumulators carry no creation order and outlive a step while
    an old graph is referenced; one belongs to the first op (``owner``: session
    token and op id) that reaches it, and is found again by that op only.
    """
    queue = [t.grad_fn for t in outputs if t.grad_fn is not None]
    found, seen, i = [], set(), 0
    while i < len(queue):
        node = queue[i]
        i += 1
        if id(node) in seen:
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        if seq == _ACCUMULATE:
            metadata = node.metadata
            claim = metadata.get("amanda")
            if claim is None or claim[0] != owner[0]:
                metadata["amanda"] = owner
                found.append(node)
            elif claim == owner:
                found.append(node)
            continue
        if seq < mark and not _is_straight_through(node):
            continue
        if not _is_straight_through(node):
            found.append(node)
        queue.extend(child for child, _ in node.next_functions if child is not None)
    return found


def _install_backward(session, record, nodes):
    for index, node in enumerate(nodes):
        brec = record.backward_record(index, type(node).__name__)
        pending = brec.waiting()
        if not pending and not (brec.before or brec.after or brec.replace):
            continue
        if node._sequence_nr() == _ACCUMULATE:
            # Hooks reach their record through a holder: an accumulator kept
            # alive by an old graph is found again, and must not be hooked twice.
            metadata = node.metadata
            hooks = metadata.get("amanda_hooks")
            if hooks is None or hooks.session is not session:
                hooks = metadata["amanda_hooks"] = _NodeHooks(session)
        else:
            hooks = _NodeHooks(session)   # a node created by this very execution
        hooks.brec = brec
        if not hooks.pre and (not brec.pre_done or brec.before):
            node.register_prehook(functools.partial(_backward_pre, hooks))
            hooks.pre = True
        # A pending pre-analysis may record "after" actions for this very run.
        if not hooks.post and (not brec.pre_done or not brec.post_done or brec.after
                               or brec.replace):
            node.register_hook(functools.partial(_backward_post, hooks))
            hooks.post = True


class _NodeHooks:
    """What a node's hooks act on; replaced when an old node is found again."""

    __slots__ = ("session", "brec", "pre", "post")

    def __init__(self, session):
        self.session = session
        self.brec = None
        self.pre = self.post = False


def _backward_context(brec):
    if brec.context is None:
        parent = brec.parent
        brec.context = OpContext(NAMESPACE, parent.func, parent.op_id, parent.name,
                                 backward_op=BackwardOp(brec.name, brec.index),
                                 backward_op_id=brec.op_id, module_path=parent.module_path,
                                 parent=parent.context)
    return brec.context


def _where(brec):
    return (brec.name, brec.op_id, NAMESPACE)


def _backward_pre(hooks, grad_outputs):
    session, brec = hooks.session, hooks.brec
    if not session.active or controls.state.disabled:
        return None
    brec.unrun = 0
    if not brec.pre_done:
        context = _backward_context(brec)
        context._grad_outputs = grad_outputs
        try:
            _analyse(session, BACKWARD_BEFORE, context, brec)
        finally:
            context._grad_outputs = None
        brec.pre_done = True
        brec.parent.refresh()
    if brec.before:
        values = list(grad_outputs)
        if _apply_actions(brec.before, values, _where(brec)):
            return tuple(values)
    return None


def _backward_post(hooks, grad_inputs, grad_outputs):
    session, brec = hooks.session, hooks.brec
    if not session.active or controls.state.disabled:
        return None
    brec.unrun = 0
    if not brec.post_done:
        context = _backward_context(brec)
        context._grad_outputs, context._grad_inputs = grad_outputs, grad_inputs
        try:
            _analyse(session, BACKWARD_AFTER, context, brec)
        finally:
            context._grad_outputs = context._grad_inputs = None
        brec.post_done = True
        brec.parent.refresh()
    values, changed = list(grad_inputs), False
    if brec.replace:
        action = brec.replace[0]
        new = _invoke(action, select(list(grad_outputs), action.positions, action, _where(brec)),
                      _where(brec))
        if new is not None:
            if len(new) != len(values):
                raise ToolError(f"replace_backward_op routine returned {len(new)} gradients; "
                                f"the backward op produces {len(values)}", tool=action.tool,
                                routine=action.func, op_name=brec.name, op_id=brec.op_id,
                                namespace=NAMESPACE)
            values, changed = new, True
    if brec.after and _apply_actions(brec.after, values, _where(brec)):
        changed = True
    return tuple(values) if changed else None


# -- the driver ----------------------------------------------------------------------

class TorchEagerDriver:
    """Activates the mode and the module hooks per thread for ``apply``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._handles = []

    def enter(self, session):
        global _STRAIGHT_THROUGH_NODE
        if _STRAIGHT_THROUGH_NODE is None:
            _STRAIGHT_THROUGH_NODE = _StraightThrough._backward_cls
        st = _state()
        cache = session.caches.get("pytorch")
        if cache is None:
            cache = session.caches["pytorch"] = _Cache(session)
        st.depth += 1
        if st.depth == 1:
            st.reset(cache)
            self._add_hooks()
            st.mode = _Mode(st)
            try:
                st.mode.__enter__()
            except BaseException:
                self._remove_hooks()
                st.depth -= 1
                raise
        else:
            st.unsettle()   # other tools: intercept again
            st.cache = cache

    def exit(self, session, restored):
        st = _state()
        cache = session.caches.get("pytorch")
        try:
            if cache is not None and cache.trace is not None:
                cache.trace.finish()  # a scope's end ends the traced step (tools may raise)
        finally:
            self._leave(st, restored)

    def _leave(self, st, restored):
        """Pop one scope: at the outermost, remove the mode and hooks."""
        st.remember_clean_step()
        st.depth -= 1
        if st.depth == 0:
            mode, settled = st.mode, st.settled
            st.reset(None)
            st.mode = None
            try:
                if not settled:
                    mode.__exit__(None, None, None)
            finally:
                self._remove_hooks()
        else:
            st.unsettle()
            st.cache = restored.caches["pytorch"]
            st.clean = False

    def _add_hooks(self):
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._handles = [
                    _torch_module.register_module_forward_pre_hook(_module_pre_hook),
                    _torch_module.register_module_forward_hook(_module_post_hook,
                                                               always_call=True),
                ]

    def _remove_hooks(self):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for handle in self._handles:
                    handle.remove()
                self._handles = []


DRIVER = TorchEagerDriver()


def evaluate(tensors):
    """NumPy copies of PyTorch tensors (``amanda.evaluate``)."""
    if isinstance(tensors, (list, tuple)):
        return [t.detach().cpu().numpy() for t in tensors]
    return tensors.detach().cpu().numpy()
