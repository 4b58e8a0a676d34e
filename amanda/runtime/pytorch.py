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
from amanda.runtime.routines import call_routine, check_replacements, select
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


# What a frame's code is to the op it calls, keyed by id(code) (hashing a
# code object rehashes its constants on every call, which is slow for large
# functions; the codes are kept alive in _SEEN_CODE so their ids stay valid):
_SITE = 1        # the op's calling site: user code, models, tools, torch.nn layers
_LIBRARY = 2     # torch internals and amanda's runtime: the site is further up
_MACHINERY = 3   # torch mechanisms (activation checkpointing) whose calls are not ops
_BOUNDARY = 4    # nn.Module's call machinery: the site never lies above it
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LIBRARY_DIRS = (_TORCH_DIR, os.path.dirname(os.path.abspath(__file__)) + os.sep)
# torch's own layers (nn.Conv2d.forward...) are sites, so an op inside a torch
# layer is identified from within it, never by the line that called the model.
_LAYER_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_MODULE_FILE = os.path.join(_LAYER_DIR, "module.py")
_MACHINERY_FILES = (os.path.join(_TORCH_DIR, "utils", "checkpoint.py"),)
_CODE_KIND = {}
_SEEN_CODE = []


def _code_kind(code):
    kind = _CODE_KIND.get(id(code))
    if kind is None:
        _SEEN_CODE.append(code)
        path = code.co_filename
        if path == _MODULE_FILE:
            kind = _BOUNDARY if code.co_name in ("_call_impl", "_wrapped_call_impl") \
                else _LIBRARY
        elif path in _MACHINERY_FILES:
            kind = _MACHINERY
        elif path.startswith(_LAYER_DIR):
            kind = _SITE
        else:
            kind = _LIBRARY if path.startswith(_LIBRARY_DIRS) else _SITE
        _CODE_KIND[id(code)] = kind
    return kind


def _calling_site(frame):
    """The frame that identifies an op called from ``frame``: the first one
    outside torch's internals and amanda's runtime, but never above the
    module call that runs it. None when torch's checkpointing machinery made
    the call (not an op of the model)."""
    kind = _CODE_KIND.get(id(frame.f_code)) or _code_kind(frame.f_code)
    while kind is not _SITE and kind is not _BOUNDARY:
        if kind is _MACHINERY:
            return None
        back = frame.f_back
        if back is None:
            break
        back_kind = _CODE_KIND.get(id(back.f_code)) or _code_kind(back.f_code)
        if back_kind is _BOUNDARY:
            break        # a hook or helper called by Module.__call__: the site is here
        frame, kind = back, back_kind
    return frame


class BackwardOp:
    """What ``OpContext.get_backward_op()`` returns in PyTorch: the autograd
    node's name (``ConvolutionBackward0``, ``AccumulateGrad``...) and its
    index among its forward op's backward ops of the same kind (``"inputN"`` for
    the accumulator of the op's input N). The live node is not
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
    original tensor unchanged, as if the routine were the identity.

    The value comes in a one-item list (``apply(original, [value])``): a
    tensor argument handed back by ``forward`` would become a view of the
    function's output, which in-place ops then refuse and whose strides on
    size-1 dimensions differ from the value's."""

    @staticmethod
    def forward(ctx, original, box):
        # no gradient stays no gradient (torch would hand backward zeros):
        # torch runs nodes with undefined gradients (e.g. before a reentrant
        # checkpoint whose segment's graph is cut), and an input that gets
        # no gradient in vanilla must get none here either
        ctx.set_materialize_grads(False)
        return box[0]

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

class _BackwardRecord:
    __slots__ = ("op_id", "name", "index", "parent", "context", "pre_done", "post_done",
                 "before", "after", "replace")

    def __init__(self, parent, index, name, session):
        self.parent = parent
        self.index = index
        self.name = name
        self.op_id = _stable_id(parent.op_id, index, name)
        self.context = None
        self.pre_done = not session.routines[BACKWARD_BEFORE]
        self.post_done = not session.routines[BACKWARD_AFTER]
        self.before, self.after, self.replace = [], [], []

    def waiting(self):
        """Whether this backward op still waits for its analysis. (It waits
        as long as it has not run: a backward op that runs only at some steps
        is analysed when it first does.)"""
        return not (self.pre_done and self.post_done)

    @property
    def idle(self):
        return self.pre_done and self.post_done and not (self.before or self.after or self.replace)


class _OpRecord:
    __slots__ = ("op_id", "name", "func", "module_path", "context", "pre_done", "post_done",
                 "before", "after", "replace", "backward", "walked", "fast", "watch", "session",
                 "where", "nodes", "spec")

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
        self.nodes = -1         # autograd nodes the op created when last walked (-1: never)
        self.spec = None        # output structure, for checking replace_op results
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
        if self.fast and self.session.has_backward:
            # Fast, but a change in the autograd nodes it creates (a weight
            # unfrozen, an input that now requires grad) walks them again.
            self.fast = _COUNT_NODES

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

    def backward_records(self, nodes, inputs):
        """The records of the autograd nodes this execution created.

        A node is named by its kind and its occurrence among the op's nodes of
        that kind; a gradient accumulator by the input it accumulates into.
        Not by its position in the walk: activation checkpointing recomputes
        an op on detached inputs, whose graph lacks or adds accumulators, and
        the other nodes must keep their ids."""
        seen, records = {}, []
        for node in nodes:
            name = type(node).__name__
            index = None
            if name == "AccumulateGrad":
                variable = node.variable
                index = next((f"input{p}" for p, t in enumerate(inputs) if t is variable), None)
            if index is None:
                index = seen.get(name, 0)
                seen[name] = index + 1
            records.append(self.backward_record(index, name))
        return records


def _stable_id(*parts):
    """A 63-bit id from text parts: the same in every run and process."""
    text = "\x1f".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


_COUNT_NODES = 2   # record.fast value: fast, counting the autograd nodes the op creates


class _Cache:
    """A session's PyTorch state: op records by (site key, occurrence)."""

    def __init__(self, session):
        self.session = session
        self.records = {}
        self.ids = {}          # op id -> site key, to keep ids distinct
        self.trace = None
        if session.requires_graph:
            from amanda.frontends.pytorch import EagerTrace
            self.trace = EagerTrace(NAMESPACE, on_complete=session.graph_completed,
                                    resolve_node=resolve_straight_through)


# -- per-thread state ----------------------------------------------------------

class _Segment:
    """A checkpointed call in the forward pass: what its recomputation replays."""

    __slots__ = ("token", "key", "stack", "counts", "cache", "used")

    def __init__(self, token, key, stack, counts, cache):
        self.token = None if token is None else weakref.ref(token)
        self.key, self.stack, self.counts, self.cache = key, stack, counts, cache
        self.used = None    # the backward pass that recomputed it


class _ThreadState:
    """Per-thread driver state: the modules being called and the occurrence
    counts of the current step.

    There is no fast path that skips the mode: every torch call made inside
    ``apply`` reaches ``_Mode.__torch_function__``, so a new op (a branch taken
    for the first time, code outside modules, ops after a ``disabled()``
    block) is always analysed. Ops with nothing to do cost a lookup.
    """

    def __init__(self):
        self.depth = 0
        self.cache = None
        self.mode = None
        self.modules = []       # weak references to the modules being called
        self.counts = {}        # site key -> occurrences in this step (ops in modules)
        self.segments = {}      # id(module) -> [_Segment] of its checkpointed calls
        self.parents = {}       # id(module) -> stack above its last call this step
        self.base = 0           # depth of the borrowed stack while recomputing
        self.recomputing = False
        self.saved = None       # the step's counts, while recomputing
        self.muted = None       # disabled flag to restore after a muted recomputation
        self.segment_cache = None   # the scope's cache, while a segment runs under another

    def new_step(self):
        self.counts.clear()
        self.segments.clear()
        self.parents.clear()

    def checkpointed(self, module, args, token, cache):
        """The forward pass calls ``module`` in a checkpointed segment (torch's
        checkpoint object ``token``): keep where it stands (module stack,
        occurrence counts) and the tools that run it (``cache``; None inside
        ``disabled()``), for its recomputation in backward."""
        self.segments.setdefault(id(module), []).append(_Segment(
            token, _segment_key(args), self.modules[:], dict(self.counts), cache))

    def recompute(self, module, args, by_checkpoint, token=None):
        """A module called during a backward pass by torch's checkpointing
        (directly, or through the checkpointed function), or with no module
        around it: a forward segment is recomputed. Its ops take the module
        stack and the ids of their first execution: the segment is found by
        its module and inputs (a module checkpointed twice in a step is two
        segments), and its counts restart where they stood then. The stack
        stays after the module returns, so the checkpointed function's own
        ops (transformers checkpoints a layer's ``forward``) keep their
        module. Forward ops recomputed by other code (a Python autograd
        function's backward, e.g. Reformer) take the stack of the module's
        last forward call."""
        self.end_segment()
        entry = self.segment(module, args, token)
        if entry is not None:
            base, counts, cache = entry.stack, entry.counts, entry.cache
        elif by_checkpoint:
            base, counts, cache = (), {}, None
        else:
            base, counts, cache = self.parents.get(id(module), ()), {}, self.cache
        self.modules[:] = base
        self.base = len(self.modules)
        if cache is None or not cache.session.active:
            # Not run by an instrumented forward pass that is still applied:
            # it ran inside disabled(), before apply, in an apply scope that
            # has ended (or is not a checkpointed segment amanda saw), so its
            # recomputation is not instrumented either.
            self.muted, _CONTROLS.disabled = _CONTROLS.disabled, True
        elif cache is not self.cache:
            # recomputed under the tools that ran it, not those of today's scope
            self.segment_cache, self.cache = self.cache, cache
        if not self.recomputing:
            self.recomputing = True
            self.saved = self.counts
        self.counts = dict(counts)

    def segment(self, module, args, token=None):
        """The call of ``module`` in a checkpointed segment of this step that
        a recomputation of ``module`` on ``args`` replays, if any.

        The segment is the one of torch's checkpoint object ``token`` (the
        non-reentrant checkpoint's frame, the reentrant one's autograd
        context), the same object at forward and at recomputation, and the
        call is the first of ``module`` in it not yet replayed in this
        backward pass. A segment whose forward amanda did not see has no
        record: None. Only where torch's object could not be found (a torch
        whose checkpoint code amanda does not know) is the call matched by
        the storage of its first input (identity, not address: see
        _segment_key), or else as the newest call of the module not yet
        recomputed (backward recomputes segments in reverse order)."""
        entries = self.segments.get(id(module))
        if not entries:
            return None
        task = _in_backward()
        if token is not None:
            mine = [e for e in entries if e.token is not None and e.token() is token]
            if not mine:
                entries = [e for e in entries if e.token is None]
                if not entries:
                    return None
            else:
                found = next((e for e in mine if e.used != task), None)
                if found is None:                # replayed again in this pass
                    found = mine[0]
                found.used = task
                return found
        key = _segment_key(args)
        fresh = [e for e in reversed(entries) if e.used != task]
        found = next((e for e in fresh if _same_input(e.key, key)), None) \
            or next((e for e in reversed(entries) if _same_input(e.key, key)), None) \
            or (fresh[0] if fresh else entries[-1])
        found.used = task
        return found

    def end_segment(self):
        """A recomputed segment's module returned: its mute and tools end."""
        if self.muted is not None:
            _CONTROLS.disabled, self.muted = self.muted, None
        if self.segment_cache is not None:
            self.cache, self.segment_cache = self.segment_cache, None

    def end_recompute(self):
        if self.recomputing:
            self.end_segment()
            self.recomputing = False
            self.counts, self.saved = self.saved, None
            self.modules.clear()
            self.base = 0

    def reset(self, cache):
        self.end_segment()             # a segment interrupted by an error
        self.cache = cache
        self.end_recompute()
        self.new_step()
        self.modules.clear()
        self.base = 0


_tls = threading.local()


def _state():
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _ThreadState()
    return st


_in_backward = torch._C._current_graph_task_id


def _module_pre_hook(module, args):
    """Global forward pre-hook while amanda is applied: keeps the stack of
    modules being called. (Wrapping ``nn.Module.__call__`` would be cheaper
    per call, but assigning a class attribute of ``nn.Module`` invalidates the
    type caches of every subclass, which costs ~0.5 ms per apply scope.)

    Module calls inside ``amanda.disabled()`` are not tracked: the code after
    the block sees the same modules, steps and counts as if it had not run."""
    st = getattr(_tls, "state", None)
    if st is None or not st.depth:
        return
    if _CONTROLS.disabled:
        if _in_backward() == -1 and _grad_enabled():
            role, token = _checkpoint_role(_getframe(1))
            if role is _FORWARD:
                st.checkpointed(module, args, token, None)   # its recomputation stays muted
        return
    if _COMPILE["prior"] is None and type(module).__name__ == "OptimizedModule":
        with DRIVER._lock:
            _compile_eagerly()     # compiled after apply was entered
    modules = st.modules
    role, token = _checkpoint_role(_getframe(1))
    if _in_backward() != -1:
        if role is _FORWARD:
            st.checkpointed(module, args, token, st.cache)  # a first run in a recomputation
        elif role is _RECOMPUTE or not modules:
            st.recompute(module, args, role is _RECOMPUTE, token)
    else:
        if st.recomputing:
            st.end_recompute()
        if not modules:
            st.new_step()                  # a root module call starts a step
        else:
            st.parents[id(module)] = modules[:]
        if role is not None:
            st.checkpointed(module, args, token, st.cache)
    modules.append(weakref.ref(module))


def _checkpoint_role(frame):
    """What torch's checkpointing machinery is doing when it makes the
    module call running this hook, directly or through the user's function,
    and in which checkpoint: ``(_FORWARD, token)`` (a checkpointed segment's
    forward), ``(_RECOMPUTE, token)`` (its recomputation), or ``(None,
    None)`` when checkpoint did not make the call. Looking up the stack from
    the call, a checkpoint frame comes before the call of any enclosing
    module; its function says which it is (helpers such as
    ``checkpoint_sequential``'s are looked through), and its locals hold
    torch's object for that checkpoint (``token``: None if not found)."""
    while frame is not None and frame.f_code.co_filename == _MODULE_FILE:
        frame = frame.f_back           # this call's own Module.__call__ frames
    machinery = False
    while frame is not None:
        code = frame.f_code
        kind = _CODE_KIND.get(id(code)) or _code_kind(code)
        if kind is _MACHINERY:
            role = _ROLES.get(code.co_qualname)
            if role is not None:
                return role, _checkpoint_token(frame)
            machinery = True
        elif kind is _BOUNDARY:
            break
        frame = frame.f_back
    if not machinery:
        return _NO_ROLE
    return (_RECOMPUTE if _in_backward() != -1 else _FORWARD), None


def _checkpoint_token(frame):
    """torch's object for one checkpoint call, the same in its forward and
    its recomputation: the reentrant checkpoint's autograd context (``ctx``
    of ``CheckpointFunction.forward`` and ``.backward``); the non-reentrant
    checkpoint's ``_CheckpointFrame`` (``new_frame`` in the generator that
    ``checkpoint`` runs; ``frame`` in the saved-tensor unpack hook that calls
    ``recompute_fn``). Only read when a checkpoint calls a module."""
    try:
        name = frame.f_code.co_qualname
        if name.startswith("CheckpointFunction."):
            return frame.f_locals.get("ctx")
        if name == "checkpoint":
            gen = frame.f_locals.get("gen")
            inner = getattr(gen, "gi_frame", None)
            return None if inner is None else inner.f_locals.get("new_frame")
        for _ in range(4):              # recompute_fn <- ... <- unpack_hook
            frame = frame.f_back
            if frame is None:
                return None
            if frame.f_code.co_qualname.endswith("<locals>.unpack_hook"):
                return frame.f_locals.get("frame")
    except (AttributeError, TypeError):
        pass
    return None


_FORWARD, _RECOMPUTE = "forward", "recompute"
_NO_ROLE = (None, None)
# The functions of torch/utils/checkpoint.py that call the checkpointed
# function: non-reentrant checkpoint runs it in ``checkpoint`` and recomputes
# it in ``recompute_fn``; reentrant checkpoint in its autograd function.
_ROLES = {"checkpoint": _FORWARD, "CheckpointFunction.forward": _FORWARD,
          "_checkpoint_without_reentrant_generator.<locals>.recompute_fn": _RECOMPUTE,
          "CheckpointFunction.backward": _RECOMPUTE}


def _segment_key(args):
    """What tells two checkpointed calls of one module apart: the storage of
    their first tensor input (reentrant checkpointing recomputes on detached
    copies, which share it), by identity, not address: torch keeps one
    Python object per live storage, and a weak reference to it dies with the
    storage, so a freed storage's address reused by another never matches."""
    for value in args:
        if isinstance(value, _Tensor):
            try:
                storage = value.untyped_storage()
                return (weakref.ref(storage), value.storage_offset(), tuple(value.shape))
            except (RuntimeError, TypeError, NotImplementedError):
                return None     # a tensor without storage (sparse, nested...)
    return None


def _same_input(key, other):
    return key is not None and other is not None and key[1:] == other[1:] \
        and key[0]() is not None and key[0]() is other[0]()


def _module_post_hook(module, args, output):
    st = getattr(_tls, "state", None)
    if st is None or not st.depth:
        return
    modules = st.modules
    if modules and modules[-1]() is module:
        modules.pop()
        if st.recomputing and len(modules) == st.base:
            st.end_segment()         # the stack stays: see _ThreadState.recompute


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
        frame = _getframe(1)
        if _CODE_KIND.get(id(frame.f_code)) is not _SITE:
            frame = _calling_site(frame)
        if frame is None:
            return _machinery_call(func, args, kwargs)
        st = self.st
        modules = st.modules
        key = (modules[-1] if modules else None, id(frame.f_code), frame.f_lasti, func)
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
            if func not in _PRODUCERS and not _has_tensor(args, kwargs):
                return _first_call_without_tensors(st, cache, key, n, name, func, frame,
                                                   args, kwargs)
            record = _new_record(st, cache, key, n, name, func, frame)
        fast = record.fast
        if fast and cache.trace is None and _CONTROLS.cache:
            if fast is True or not _grad_enabled():
                return func(*args, **kwargs)
            mark = _sequence_nr()
            result = func(*args, **kwargs)
            if _sequence_nr() - mark != record.nodes:
                _walk_again(cache, record, args, kwargs, result, mark)
            return result
        return _run_op(cache, record, func, args, kwargs)


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


_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class _Exporting(threading.local):
    """Set by ``amanda.export`` in the thread that traces a model for export:
    ``guard(action, selected, where)`` is a context manager wrapped around each
    routine call; it refuses routines that an exported graph cannot hold."""

    guard = None


EXPORTING = _Exporting()


def _meta(tensor):
    return (tensor.shape, tensor.dtype) if isinstance(tensor, _Tensor) else None


def _invoke(action, selected, where, meta=_meta):
    """Run a routine with autodiff isolation unless it opted in. Amanda is
    disabled meanwhile: a routine's own torch calls are not instrumented
    (inside the mode's handler torch has popped the mode already; the flag
    covers backward hooks)."""
    switch = not action.ad and _grad_enabled()
    if switch:
        _set_grad_enabled(False)   # cheaper than a torch.no_grad() object
    try:
        with controls.muted():
            guard = EXPORTING.guard
            if guard is not None:
                with guard(action, selected, where):
                    return call_routine(action, selected, _is_tensor, where, meta)
            return call_routine(action, selected, _is_tensor, where, meta)
    finally:
        if switch:
            _set_grad_enabled(True)


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
                new = _StraightThrough.apply(old, [new.detach()])
            values[pos] = new
            changed = True
    return changed


def _analyse(session, point, context, record):
    with controls.muted():
        session.analyse(point, context)
    take_actions(context, record)


_NOTHING = object()


def _run_op(cache, record, func, args, kwargs, computed=_NOTHING):
    session = cache.session
    if not controls.state.cache:
        record = record.fresh()
    where = record.where
    tensors, slots = _flatten(args, kwargs)
    context = None
    trace = cache.trace
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
    if record.before and _apply_actions(record.before, tensors, where):
        args, kwargs = _rebuild(args, kwargs, slots, tensors)
    mark = _sequence_nr()
    if record.replace:
        action = record.replace[0]
        if record.spec is None:
            record.spec = _output_spec(func, args, kwargs)
        result = _replace(action, select(tensors, action.positions, action, where), where)
        result = _check_replacement(action, result, record.spec, where)
    elif computed is _NOTHING:
        result = func(*args, **kwargs)
    else:
        result = computed
    outputs = _op_outputs(result, args)
    nodes = ()
    if _grad_enabled() and (record.watch or cache.trace is not None or (
            session.has_backward and _sequence_nr() - mark != record.nodes)):
        # (a changed count of new autograd nodes: an input that now requires
        # grad makes backward ops this op did not have before)
        nodes = _walk_new_nodes(outputs, mark, (session.token, record.op_id))
        record.walked = True
        record.nodes = _sequence_nr() - mark
        if nodes:
            _install_backward(session, record, nodes, tensors)
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
    if record.after and _apply_actions(record.after, outputs, where):
        if result is None:
            raise ToolError("an after-op routine replaced the tensor an in-place op modified; "
                            "this op returns None, so there is no output to replace: "
                            "return None from the routine", tool=record.after[0].tool,
                            routine=record.after[0].func, op_name=where[0], op_id=where[1],
                            namespace=where[2])
        result = _rebuild_outputs(result, outputs)
        if ir_op is not None:
            trace.alias(outputs, ir_op.outputs)
    record.refresh()
    return result


def _walk_again(cache, record, args, kwargs, result, mark):
    """The op created other autograd nodes than when it was last walked:
    find them, so a backward op seen for the first time is analysed."""
    nodes = _walk_new_nodes(_op_outputs(result, args), mark,
                            (cache.session.token, record.op_id))
    record.nodes = _sequence_nr() - mark
    if nodes:
        _install_backward(cache.session, record, nodes, _flatten(args, kwargs)[0])
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
        op_name, op_id, namespace = where
        return ToolError(f"replace_op routine {message}", tool=action.tool,
                         routine=action.func, op_name=op_name, op_id=op_id,
                         namespace=namespace)
    if isinstance(spec, tuple):               # one output
        if not isinstance(result, _Tensor):
            raise fail(f"returned {_describe_value(result)}; the op returns one tensor "
                       "(return a tensor, not a sequence)")
        got, want = (result.shape, result.dtype), spec
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
            got = (r.shape, r.dtype) if isinstance(r, _Tensor) else None
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
    try:
        with controls.muted():
            if action.ad:
                return action.func(*selected, **action.kwargs)
            with torch.no_grad():
                return action.func(*selected, **action.kwargs)
    except Exception as exc:
        op_name, op_id, namespace = where
        raise ToolError(f"replace_op routine raised {type(exc).__name__}: {exc}",
                        tool=action.tool, routine=action.func, op_name=op_name,
                        op_id=op_id, namespace=namespace) from exc


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
            if getattr(node.variable, "_amanda_machinery", False):
                continue
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


def _install_backward(session, record, nodes, inputs):
    for node, brec in zip(nodes, record.backward_records(nodes, inputs)):
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
    if not brec.pre_done:
        context = _backward_context(brec)
        context._set_values(grad_outputs=grad_outputs)
        try:
            _analyse(session, BACKWARD_BEFORE, context, brec)
        finally:
            context._set_values(grad_outputs=None)
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
    if not brec.post_done:
        context = _backward_context(brec)
        context._set_values(grad_outputs=grad_outputs, grad_inputs=grad_inputs)
        try:
            _analyse(session, BACKWARD_AFTER, context, brec)
        finally:
            context._set_values(grad_outputs=None, grad_inputs=None)
        brec.post_done = True
        brec.parent.refresh()
    values, changed = list(grad_inputs), False
    if brec.replace:
        action = brec.replace[0]
        where = _where(brec)
        new = _invoke(action, select(list(grad_outputs), action.positions, action, where),
                      where, meta=None)
        if new is not None:
            if len(new) != len(values):
                raise ToolError(f"replace_backward_op routine returned {len(new)} gradients; "
                                f"the backward op produces {len(values)}", tool=action.tool,
                                routine=action.func, op_name=brec.name, op_id=brec.op_id,
                                namespace=NAMESPACE)
            check_replacements(action, values, new, _meta, where)
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
        st.depth -= 1
        if st.depth == 0:
            mode = st.mode
            st.reset(None)
            st.mode = None
            try:
                mode.__exit__(None, None, None)
            finally:
                self._remove_hooks()
        else:
            st.cache = restored.caches["pytorch"]

    def _add_hooks(self):
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._handles = [
                    _torch_module.register_module_forward_pre_hook(_module_pre_hook),
                    _torch_module.register_module_forward_hook(_module_post_hook,
                                                               always_call=True),
                ]
                _patch_engine()
                if "torch._dynamo" in sys.modules:
                    _compile_eagerly()

    def _remove_hooks(self):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for handle in self._handles:
                    handle.remove()
                self._handles = []
                _restore_engine()
                _restore_compile()


# -- the backward pass ------------------------------------------------------------

# torch pops the mode while its handler runs a call, and ``backward()`` is
# such a call: without help, the Python code autograd runs during backward
# (activation checkpointing's recomputation, Python autograd functions, tensor
# hooks) would run with no mode. While amanda is applied, the engine entry
# that ``torch.autograd.backward``/``grad`` call pushes the thread's mode back
# for the duration of the pass.
_ENGINE = {"original": None}
_function_mode_stack = torch.overrides._get_current_function_mode_stack


def _run_backward_seen(*args, **kwargs):
    st = getattr(_tls, "state", None)
    mode = st.mode if st is not None and st.depth else None
    if mode is None or _CONTROLS.disabled or any(
            m is mode for m in _function_mode_stack()):
        return _ENGINE["original"](*args, **kwargs)
    with mode:
        return _ENGINE["original"](*args, **kwargs)


def _patch_engine():
    import torch.autograd as autograd
    _ENGINE["original"] = autograd._engine_run_backward
    autograd._engine_run_backward = _run_backward_seen


def _restore_engine():
    import torch.autograd as autograd
    if _ENGINE["original"] is not None:
        autograd._engine_run_backward = _ENGINE["original"]
        _ENGINE["original"] = None


# -- torch.compile ----------------------------------------------------------------

# While amanda is applied, compiled callables run instrumented compiled graphs
# (amanda.runtime.pytorch_compiled: Dynamo's callback is chosen per call and
# session), or, for what that path cannot do, their Python code eagerly, so
# every op is seen (Dynamo would otherwise trace the mode's handler or run
# graphs in which no op is an instrumentation point). With
# pytorch_compiled.ENABLED false, Dynamo's stance is force_eager for every
# call, as before; that stance is process-wide: another thread's compiled
# code runs eagerly meanwhile too (the compiled path does the same).
_COMPILE = {"prior": None}
_COMPILED_PATH = "compiled path"   # _COMPILE["prior"] while the compiled path is installed


def _compile_eagerly():
    if _COMPILE["prior"] is not None:
        return
    from torch._dynamo import eval_frame

    from amanda.runtime import pytorch_compiled
    WRAPPER_MODULES.add(eval_frame.OptimizedModule)
    if pytorch_compiled.ENABLED:
        pytorch_compiled.install()
        _COMPILE["prior"] = _COMPILED_PATH
    else:
        _COMPILE["prior"] = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))


def _restore_compile():
    prior = _COMPILE["prior"]
    if prior is _COMPILED_PATH:
        from amanda.runtime import pytorch_compiled
        pytorch_compiled.uninstall()
        _COMPILE["prior"] = None
    elif prior is not None:
        from torch._dynamo import eval_frame
        eval_frame._set_stance(prior)
        _COMPILE["prior"] = None


DRIVER = TorchEagerDriver()


def evaluate(tensors):
    """NumPy copies of PyTorch tensors (``amanda.evaluate``)."""
    if isinstance(tensors, (list, tuple)):
        return [t.detach().cpu().numpy() for t in tensors]
    return tensors.detach().cpu().numpy()
