"""PyTorch eager driver: backward ops.

The autograd nodes a forward op creates are found by walking from its
outputs down to nodes older than the op (``_walk_new_nodes``); node pre/post
hooks are installed on those where something must run
(``_install_backward``), and run the backward points (``_backward_pre``,
``_backward_post``). Part of :mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict

import torch

from amanda.context import OpContext
from amanda.runtime.pytorch.eager import records as _records
from amanda.runtime.pytorch.eager.records import BackwardOp, _is_straight_through
from amanda.runtime.pytorch.eager.routines import _analyse, _apply_actions, _invoke, _meta
from amanda.runtime.pytorch.eager.sites import _ACCUMULATE, _CONTROLS, NAMESPACE
from amanda.runtime.routines import check_replacements, routine_error, select
from amanda.tool import BACKWARD_AFTER, BACKWARD_BEFORE


# -- backward ops -----------------------------------------------------------------

def _walk_new_nodes(outputs, mark, owner):
    """Autograd nodes created since sequence number ``mark``, reachable from
    the outputs, in breadth-first order.

    Gradient accumulators carry no creation order and outlive a step while
    an old graph is referenced; one belongs to the first op (``owner``: session
    token and op id) that reaches it, and is found again by that op only.
    """
    if len(outputs) == 1:
        # The common case: one output whose node is new and whose inputs'
        # nodes are all older (no accumulator, no pass-through node). The
        # walk below would find that node alone.
        node = outputs[0].grad_fn
        if node is None:
            return []
        seq = node._sequence_nr()
        passing = _records._STRAIGHT_THROUGH_NODE    # (_is_straight_through, inlined)
        if mark <= seq != _ACCUMULATE and type(node) is not passing:
            for child, _ in node.next_functions:
                if child is not None and (child._sequence_nr() >= mark
                                          or type(child) is passing):
                    break
            else:
                return [node]
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
    """Hook the nodes where something must run. ``inputs``: the op's input
    tensors, or a function returning them (see ``backward_records``)."""
    for node, brec in zip(nodes, record.backward_records(nodes, inputs)):
        if brec.pre_done and brec.post_done and not (brec.before or brec.after or brec.replace):
            continue      # analysed, nothing to do (brec.idle, inlined)
        if node._sequence_nr() != _ACCUMULATE:
            # A node created by this very execution: no hook on it yet, and
            # its hooks act on this record for good, so every such node of
            # the record shares one holder and its two callables.
            shared = brec.hooks
            if shared is None or shared[0].session is not session:
                holder = _NodeHooks(session)
                holder.brec = brec
                shared = brec.hooks = (holder, _Hook(_backward_pre, holder),
                                       _Hook(_backward_post, holder))
            if not brec.pre_done or brec.before:
                node.register_prehook(shared[1])
            if not brec.pre_done or not brec.post_done or brec.after or brec.replace:
                node.register_hook(shared[2])
            continue
        # Hooks reach their record through a holder: an accumulator kept
        # alive by an old graph is found again, and must not be hooked twice.
        metadata = node.metadata
        hooks = metadata.get("amanda_hooks")
        if hooks is None or hooks.session is not session:
            hooks = metadata["amanda_hooks"] = _NodeHooks(session)
        hooks.brec = brec
        if not hooks.pre and (not brec.pre_done or brec.before):
            node.register_prehook(_Hook(_backward_pre, hooks))
            hooks.pre = True
        # A pending pre-analysis may record "after" actions for this very run.
        if not hooks.post and (not brec.pre_done or not brec.post_done or brec.after
                               or brec.replace):
            node.register_hook(_Hook(_backward_post, hooks))
            hooks.post = True


class _Hook(functools.partial):
    """A node hook of amanda's: ``_backward_pre`` or ``_backward_post`` bound
    to the ``_NodeHooks`` it acts on. Registered without a handle (below)."""

    __slots__ = ()


# -- registering a node hook without a handle ------------------------------------
#
# ``node.register_prehook(h)``/``register_hook(h)`` call, from C++, the
# Python ``torch.autograd.Function._register_hook(hooks, h)``: it makes the
# node's ``OrderedDict`` of hooks (the first time) and a ``RemovableHandle``
# (a weak reference, a class counter), about 1 µs of the 1.7 µs a
# registration costs. amanda never removes a hook (a node's hooks go with
# the node), so while amanda is applied its own hooks (``_Hook``) are put in
# the dict under keys of their own (negative: a handle's ids are not) and
# no handle is made. Every other hook is registered by torch's function, as
# before; torch's attribute is put back when the last scope ends.

_HOOK_CLASS = torch.autograd.Function      # whose _register_hook torch's C++ calls
_KEYS = itertools.count(-1, -1)
_TORCH_REGISTER = {"function": None}


def _register_without_handle(hooks, hook):
    if type(hook) is not _Hook:
        return _TORCH_REGISTER["function"](hooks, hook)
    if hooks is None:
        hooks = OrderedDict()      # torch's type: a handle of a later user hook refers to it
    hooks[next(_KEYS)] = hook
    return hooks, None


_QUICK = staticmethod(_register_without_handle)


def install_quick_registration():
    """While amanda is applied (process-wide: the first thread in)."""
    if "_register_hook" in _HOOK_CLASS.__dict__:
        return       # torch's layout is not the one this was written for: leave it
    _TORCH_REGISTER["function"] = _HOOK_CLASS._register_hook
    _HOOK_CLASS._register_hook = _QUICK


def remove_quick_registration():
    if _HOOK_CLASS.__dict__.get("_register_hook") is _QUICK:
        del _HOOK_CLASS._register_hook
    _TORCH_REGISTER["function"] = None


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


def _backward_pre(hooks, grad_outputs):
    session, brec = hooks.session, hooks.brec
    if not session.active or _CONTROLS.disabled:
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
        if _apply_actions(brec.before, values, brec.where):
            return tuple(values)
    return None


def _backward_post(hooks, grad_inputs, grad_outputs):
    session, brec = hooks.session, hooks.brec
    if not session.active or _CONTROLS.disabled:
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
        where = brec.where
        new = _invoke(action, select(list(grad_outputs), action.positions, action, where),
                      where, meta=None)
        if new is not None:
            if len(new) != len(values):
                raise routine_error(action, where, f"returned {len(new)} gradients; the "
                                    f"backward op produces {len(values)}",
                                    what="replace_backward_op routine")
            check_replacements(action, values, new, _meta, where)
            values, changed = new, True
    if brec.after and _apply_actions(brec.after, values, brec.where):
        changed = True
    return tuple(values) if changed else None
