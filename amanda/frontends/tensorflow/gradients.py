"""Gradient ops of a lifted TensorFlow graph and the forward ops they
differentiate (`map_gradients`, called by `lift_graph`).
"""

from __future__ import annotations

import contextlib

from amanda.frontends.tensorflow.gradient_names import _inside_a_gradient_function, forward_op_of
from amanda.frontends.tensorflow.tape import _GradientMapper

__all__ = ["forward_op_of", "gradient_owners", "map_gradients"]

def gradient_owners(graph):
    """Classifies the ops of an IR graph lifted from TF (without changing it).

    Returns:
        A dict mapping every gradient op's name to its forward op's name or
        None; ops not in the dict are forward ops.
    """
    return _GradientMapper(graph).run()


def map_gradients(graph, scope=None):
    """Sets ``backward``/``forward_op`` attrs on the gradient ops of ``graph``.

    Rules, in order:

    * ``tf.gradients``: ops under ``[<scope>/]gradients[_<k>]/`` (a root that
      holds a ``grad_ys_<n>`` seed or at least one ``<op>_grad`` scope) are
      gradient ops; the owner is the op named by the ``<op>_grad`` scope
      (`forward_op_of`), None for seeds and (until the last rule) ``AddN``
      aggregations.
    * ``GradientTape``: ops under ``gradient_tape/`` are gradient ops. TF names
      them ``gradient_tape/<name scope the forward op ran in>/...``, so the
      candidates are the forward ops named like a prefix of that path or lying
      directly in it (ops without gradient ops such as ``Identity`` or
      ``ReadVariableOp`` excluded). They are narrowed by the op type
      (``Conv2DBackpropFilter`` -> ``Conv2D``, ``ReluGrad`` -> ``Relu``), by
      the forward tensors the op reads (a gradient function sees only its op's
      inputs and outputs), by gradient flow from neighbouring gradient ops
      already mapped (same call, or an ancestor/descendant forward op with a
      matching tensor shape; a control edge or an ``AddN`` separates calls),
      and by contiguity (one call's ops are created one after the other). When
      evidence leaves several, the one whose name scope is the deepest prefix
      of the op's name wins. The owner is set only when one candidate is left;
      otherwise it is None (dead shape constants, ops at the boundary of two
      calls in the same scope).
    * Tape helpers outside that scope: a ``PartitionedCall`` of a
      ``__backward_*`` function (owner: the forward call whose outputs it
      reads), ``AddN`` over gradients, and seed constants (``ones``,
      ``zeros``) read only by gradient ops, are gradient ops.
    * A gradient op that its owner reads (the accumulators control flow v2
      adds as inputs of a forward ``While``) gets no owner: it runs before
      the forward op.
    * Plumbing left without an owner (``AddN`` aggregations, shape
      arithmetic from constants, dead ops) gets one where data flow or
      creation order is unambiguous: `_owners_from_readers`.

    A function body imported under a name scope (amanda's runtime names a
    body's ops ``<scope>/<node>``) is mapped by the names its ops have in the
    function (``scope``): TF named its tape ops ``gradient_tape/...`` there,
    so a ``GradientTape`` inside a function that another function calls
    (Keras ``fit``'s step) is mapped as at top level.

    Returns:
        The names of the gradient ops without owner, also stored in
        ``graph.attrs["unowned_backward_ops"]``.
    """
    with _local_names(graph, scope):
        owners = gradient_owners(graph)
        _disown_forward_feeders(graph, owners)
        _owners_from_readers(graph, owners)
    if scope:
        owners = {f"{scope}/{name}": None if owner is None else f"{scope}/{owner}"
                  for name, owner in owners.items()}
    unowned = []
    for op in graph:
        if op.name in owners:
            owner = owners[op.name]
            op.attrs["backward"] = True
            op.attrs["forward_op"] = owner
            if owner is None:
                unowned.append(op.name)
    graph.attrs["unowned_backward_ops"] = unowned
    return unowned


@contextlib.contextmanager
def _local_names(graph, scope):
    """Ops named ``<scope>/<name>`` carry ``<name>`` meanwhile (through a
    unique temporary name each way, so that no rename meets a name still
    taken); nothing when ``scope`` is empty or an op lies outside it."""
    ops = list(graph)
    prefix = f"{scope}/" if scope else None
    if not prefix or not ops or not all(op.name.startswith(prefix) for op in ops):
        yield
        return

    def rename(names):
        for index, op in enumerate(ops):
            op.name = f"\0amanda{index}"
        for op, name in zip(ops, names):
            op.name = name

    full = [op.name for op in ops]
    rename([name[len(prefix):] for name in full])
    try:
        yield
    finally:
        rename(full)


def _disown_forward_feeders(graph, owners):
    """Gradient ops that their own forward op reads get no owner.

    Control flow v2 gradients add accumulators (``EmptyTensorList``) as
    extra inputs of the forward ``While``; they run before it, so a routine
    before the forward op cannot also be seen by them (that would be a
    cycle). Walks back from each owner's inputs through the gradient ops it
    owns.
    """
    by_name = {op.name: op for op in graph}
    for owner in set(o for o in owners.values() if o is not None):
        forward = by_name.get(owner)
        if forward is None:
            continue
        pending = [t.producer for t in forward.inputs if t.producer is not None]
        while pending:
            op = pending.pop()
            if owners.get(op.name) != owner:
                continue
            owners[op.name] = None
            pending.extend(t.producer for t in op.inputs if t.producer is not None)


def _owners_from_readers(graph, owners):
    """Gives an owner to gradient plumbing the name and type rules left without.

    Two kinds of gradient op have a sound owner from their readers alone:

    * Shape arithmetic computed from constants only (``Const`` shapes TF
      folded, ``Maximum``, ``FloorDiv`` of them). It carries no gradient,
      so it is not a hand-off between two gradient functions: a gradient
      function sees only its op and the incoming gradients, so it is read
      by the function that built it. When all its readers are gradient ops
      of one forward op, that is its owner.
    * ``AddN`` summing the gradients of a forward tensor ``t`` read by
      several ops. Only the gradient function of ``t``'s producer receives
      the sum, and those of ops whose gradient passes ``t``'s through
      (``BiasAdd``, ``Identity``), which come before that producer in
      forward order. Its owner is the last of its readers' owners.

    A gradient op that reads another gradient function's result is not
    owned by this rule: its readers may be the next function's (the last op
    of one gradient function hands its result to the next one), so data
    flow alone cannot tell. Ops are visited readers first, so chains of
    constant arithmetic resolve in one sweep. Seeds (the gradient of the
    loss) and ops a forward op reads (`_disown_forward_feeders`) are never
    owned this way. Dead ops are left to `_owners_of_dead_ops`.
    """
    ops = list(graph)
    order = {op.name: i for i, op in enumerate(ops)}
    constant = set()  # gradient-scope ops computed from constants of gradient scopes only (not seeds)
    for op in ops:
        if (_inside_a_gradient_function(op.name) and not op.control_inputs
                and all(t.producer is not None and t.producer.name in constant for t in op.inputs)):
            constant.add(op.name)
    for op in reversed(ops):
        if not _unowned_plumbing(op, owners) or (op.type != "AddN" and op.name not in constant):
            continue
        readers = _readers(op)
        if not readers or any(r.name not in owners for r in readers):
            continue
        found = {owners[r.name] for r in readers}
        if None in found:
            continue
        if op.type == "AddN":
            owners[op.name] = max(found, key=order.get)
        elif len(found) == 1:
            owners[op.name] = found.pop()
    _owners_of_dead_ops(ops, owners)


def _readers(op):
    return list(op.users) + list(op.control_users)


def _unowned_plumbing(op, owners):
    if owners.get(op.name, 0) is not None:
        return False  # a forward op (absent), or owned already
    return op.type == "AddN" or _inside_a_gradient_function(op.name)


def _owners_of_dead_ops(ops, owners):
    """Dead gradient ops take the owner of the next owned op of their scope.

    A gradient function often builds shape arithmetic (``Shape`` folded to
    a ``Const``, ``Maximum``, ``FloorDiv``) and then uses its static value
    instead, leaving ops nothing reads. They have no data edge to go by;
    TF creates one gradient function's ops one after the other, and such
    shape work comes first in it, so a dead op belongs to the gradient
    function of the next op created in the same name scope that has an
    owner. Only ops inside a gradient function's scope are owned so.
    """
    live = set()
    dead = []
    for op in reversed(ops):
        readers = list(op.users) + list(op.control_users)
        if any(t.is_graph_output for t in op.outputs) or any(r.name in live for r in readers):
            live.add(op.name)
        elif op.name in owners and not _is_seed_or_forward(op, owners):
            dead.append(op)
        else:
            live.add(op.name)
    if not dead:
        return
    dead_names = {op.name for op in dead}
    following, preceding = {}, {}  # scope -> owner of the next / last owned op
    for op in ops:
        if op.name not in dead_names and owners.get(op.name) is not None:
            preceding[op.name.rpartition("/")[0]] = owners[op.name]
    for op in reversed(ops):
        scope = op.name.rpartition("/")[0]
        if op.name in dead_names:
            owner = None
            while owner is None and scope.count("/") >= 2:  # gradient_tape/<model>/<layer> at most
                owner = following.get(scope, preceding.get(scope))
                scope = scope.rpartition("/")[0]
            if owners[op.name] is None:
                owners[op.name] = owner
        elif owners.get(op.name) is not None:
            following[scope] = owners[op.name]


def _is_seed_or_forward(op, owners):
    return op.name not in owners or not (op.type == "AddN" or _inside_a_gradient_function(op.name))
