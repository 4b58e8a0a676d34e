"""PyTorch eager driver: per-thread state and activation checkpointing.

``_ThreadState`` holds the modules being called and the occurrence counts
of the current step, and the checkpointed segments of the forward pass
(``_Segment``) that a recomputation in backward replays with the ids of
their first execution. ``_checkpoint_role`` tells, from the stack, whether
torch's checkpointing makes a module call, for a segment's forward or its
recomputation. Part of :mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import threading
import weakref

import torch

from amanda import controls
from amanda.runtime.pytorch.eager.sites import (
    _BOUNDARY, _CODE_KIND, _MACHINERY, _MODULE_FILE, _Tensor, _code_kind)


# -- per-thread state ----------------------------------------------------------

class _Segment:
    """A checkpointed call in the forward pass: what its recomputation replays."""

    __slots__ = ("token", "key", "stack", "counts", "cache", "used")

    def __init__(self, token, key, stack, counts, cache):
        self.token = None if token is None else weakref.ref(token)
        self.key, self.stack, self.counts, self.cache = key, stack, counts, cache
        self.used = None    # the backward pass that recomputed it


def _still_running(frame, caller):
    """Whether the module call whose frame is ``frame`` is still running
    around the call made from frame ``caller``: ``frame`` is above it on the
    stack. None (not known) counts as running.

    **Rule: the stack of modules being called holds only calls that are
    running.** torch runs the global forward hook that pops a module
    (``always_call``) when its forward raises an ``Exception``, not a
    ``BaseException`` such as ``KeyboardInterrupt``: a model interrupted so
    and caught inside ``apply`` would leave its modules on the stack, and
    every later call would be taken for a call inside them (other
    occurrence counts, other op ids, no new step). The next module call,
    and the next op not seen before inside the module on top (an op
    outside modules after the interruption), find that their frames are
    gone and drop them. Checked in the forward pass only: a recomputation
    in backward borrows the stack of the forward call.
    """
    if frame is None:
        return True
    # from ``caller`` itself: a module whose ``forward`` is torch library
    # code (weight norm's ``_WeightNorm``) has its ops' site in the very
    # ``Module._call_impl`` ``inner`` frame its call was recorded with
    f = caller
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def _drop_finished(st, caller):
    """Drop the module calls that have ended from ``st.modules`` (see
    `_still_running`); whether any was dropped. ``st.frames`` holds the
    frame of each module call beside it (None where not known)."""
    modules, frames = st.modules, st.frames
    if len(frames) != len(modules) or _still_running(frames[-1], caller):
        return False
    running = set()
    f = caller
    while f is not None:
        running.add(id(f))
        f = f.f_back
    keep = 0
    for frame in frames:
        if frame is not None and id(frame) not in running:
            break
        keep += 1
    del modules[keep:]
    del frames[keep:]
    return True


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
        self.frames = []        # the frame of each of their calls (None: not known)
        self.counts = {}        # site key -> occurrences in this step (ops in modules)
        self.segments = {}      # id(module) -> [_Segment] of its checkpointed calls
        self.parents = {}       # id(module) -> stack above its last call this step
        self.base = 0           # depth of the borrowed stack while recomputing
        self.recomputing = False
        self.saved = None       # the step's counts, while recomputing
        self.muted = None       # the controls.muted() of a muted recomputation, until it ends
        self.segment_cache = None   # the scope's cache, while a segment runs under another
        self.scripted = set()   # ids of TorchScript modules (and "fast path") warned about in this scope
        self.traced_warned = False  # whether this scope said that tracing gets no points
        self.fork_warned = False    # whether this scope said that forked processes get none
        self.forked = False         # a forked child: amanda muted until its scope ends
        self.instrumented_trace = False   # amanda.export's trace records the routines

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
            self.muted = controls.muted()
            self.muted.__enter__()   # ended by end_segment, in the module's post hook
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
            self.muted, muted = None, self.muted
            muted.__exit__(None, None, None)
        if self.segment_cache is not None:
            self.cache, self.segment_cache = self.segment_cache, None

    def end_recompute(self):
        if self.recomputing:
            self.end_segment()
            self.recomputing = False
            self.counts, self.saved = self.saved, None
            self.modules.clear()
            self.frames.clear()
            self.base = 0

    def reset(self, cache):
        self.end_segment()             # a segment interrupted by an error
        self.cache = cache
        self.end_recompute()
        self.new_step()
        self.modules.clear()
        self.frames.clear()
        self.scripted.clear()
        self.traced_warned = False
        self.fork_warned = False
        self.base = 0


_tls = threading.local()


def _state():
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _ThreadState()
    return st


_in_backward = torch._C._current_graph_task_id


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
