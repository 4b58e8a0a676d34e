"""PyTorch eager driver: per-op records and the per-session cache.

An ``_OpRecord`` holds what one forward op (a stable op id) does: its
context, whether its analysis ran, its actions and the records of the
backward ops it owns (``_BackwardRecord``); ``_Cache`` keeps a session's
records. ``_StraightThrough`` is the autograd function that passes a
routine's value forward and the gradient back unchanged. Part of
:mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import hashlib

import torch

from amanda.context import OpContext
from amanda.runtime.pytorch.eager.sites import NAMESPACE, _Tensor
from amanda.tool import BACKWARD_AFTER, BACKWARD_BEFORE, FORWARD_AFTER, FORWARD_BEFORE


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

    # forward and setup_context apart, and a vmap rule generated: torch.func
    # transforms (vmap, grad, jacrev) refuse an autograd function without them
    generate_vmap_rule = True

    @staticmethod
    def forward(original, box):
        return box[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        # no gradient stays no gradient (torch would hand backward zeros):
        # torch runs nodes with undefined gradients (e.g. before a reentrant
        # checkpoint whose segment's graph is cut), and an input that gets
        # no gradient in vanilla must get none here either
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad):
        return grad, None

    @staticmethod
    def jvp(ctx, tangent, box_tangent):
        # forward-mode AD (torch.autograd.forward_ad, torch.func.jvp/jacfwd):
        # the original's tangent goes forward unchanged, as the gradient
        # goes back; without this method torch refuses the function
        return tangent


_STRAIGHT_THROUGH_NODE = None  # set lazily: the autograd node class of _StraightThrough


def _is_straight_through(node):
    return type(node) is _STRAIGHT_THROUGH_NODE


def resolve_straight_through(node):
    """The node behind the driver's pass-through nodes (None stays None)."""
    while node is not None and type(node) is _STRAIGHT_THROUGH_NODE:
        node = node.next_functions[0][0]
    return node


def _replaces(tensor, accumulator):
    """Whether ``tensor`` is a routine's straight-through replacement of the
    parameter ``accumulator`` accumulates into (a before-routine that
    replaced the op's input): the accumulator is then named by that
    input's position, as without the routine (before, it was named by its
    occurrence in the walk, and its id changed with the routine)."""
    grad_fn = getattr(tensor, "grad_fn", None)
    return (grad_fn is not None and _is_straight_through(grad_fn)
            and resolve_straight_through(grad_fn) is accumulator)


def _is_tensor(value):
    return isinstance(value, _Tensor)


# -- per-op records ---------------------------------------------------------

class _BackwardRecord:
    __slots__ = ("op_id", "name", "index", "parent", "context", "pre_done", "post_done",
                 "before", "after", "replace", "where", "hooks")

    def __init__(self, parent, index, name, session):
        self.parent = parent
        self.index = index
        self.name = name
        self.op_id = _stable_id(parent.op_id, index, name)
        self.context = None
        self.pre_done = not session.routines[BACKWARD_BEFORE]
        self.post_done = not session.routines[BACKWARD_AFTER]
        self.before, self.after, self.replace = [], [], []
        self.where = (name, self.op_id, NAMESPACE)   # for error messages
        self.hooks = None   # the hooks of nodes made by executions: see _install_backward

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
                 "where", "nodes", "spec", "pinned", "kinds", "lane", "owner",
                 "settled")

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
        self.pinned = False     # a backward op has actions: watched for good (see refresh)
        self.kinds = None       # (node kinds, their records): see backward_records
        self.owner = (session.token, op_id)   # claims gradient accumulators (the walk)
        self.lane = None
        self.settled = False
        self.refresh()

    def fresh(self):
        """An uncached copy: analysis runs again, actions apply once."""
        return _OpRecord(self.session, self.op_id, self.name, self.func, self.module_path)

    def needs_walk(self):
        if any(not b.idle for b in self.backward.values()):
            return True
        return self.session.has_backward and not self.walked

    def refresh(self):
        if not self.pinned:
            self._refresh_unpinned()
        elif self.settled:
            return      # pinned and analysed: its actions, so its lane, are final
        self.lane = self._lane()
        self.settled = self.pinned and self.pre_done and self.post_done

    def _lane(self):
        """Which short lane of the slow path the op takes while the cache is
        on (`eager.mode._LANES`): only once its actions can no longer
        change what it does (pinned, analysed before and after), and it
        replaces nothing after it runs."""
        if not (self.pinned and self.pre_done and self.post_done) or self.after \
                or self.replace:
            return None
        if not self.before:
            return _BACKWARD_LANE      # backward points only
        if not self.session.has_backward:
            return _BEFORE_LANE        # "before" actions, never walked
        return None

    def _refresh_unpinned(self):
        # A backward op with actions keeps them (records and their actions
        # are never dropped): its nodes are hooked at every execution, so
        # the op is watched and off the fast path for good.
        if any(b.before or b.after or b.replace for b in self.backward.values()):
            self.pinned = True
        elif not self.session.has_backward and (self.before or self.after or self.replace):
            # Likewise with forward actions and no backward routines: its
            # backward records (if traced) stay idle, it is never walked for
            # backward points, and it keeps its actions.
            self.pinned = True
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
        the other nodes must keep their ids.

        ``inputs`` is the op's input tensors, or a function returning them
        (called only when an accumulator must be named). Without
        accumulators the records depend on the node kinds alone: the list
        of the last such execution is reused when the kinds are the same."""
        kinds = tuple(map(type, nodes))
        last = self.kinds
        if last is not None and last[0] == kinds:
            return last[1]
        seen, records, accumulators = {}, [], False
        for node in nodes:
            name = type(node).__name__
            index = None
            if name == "AccumulateGrad":
                accumulators = True
                if callable(inputs):
                    inputs = inputs()
                variable = node.variable
                index = next((f"input{p}" for p, t in enumerate(inputs)
                              if t is variable or _replaces(t, node)), None)
            if index is None:
                index = seen.get(name, 0)
                seen[name] = index + 1
            records.append(self.backward_record(index, name))
        if not accumulators:
            self.kinds = (kinds, records)
        return records


def _stable_id(*parts):
    """A 63-bit id from text parts: the same in every run and process."""
    text = "\x1f".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


_COUNT_NODES = 2   # record.fast value: fast, counting the autograd nodes the op creates
_BACKWARD_LANE = 0  # record.lane values (None: no lane, the whole slow path)
_BEFORE_LANE = 1


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
