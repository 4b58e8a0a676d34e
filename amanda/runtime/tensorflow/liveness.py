"""TensorFlow graph mode: hosted routines at points that see dead tensors.

In v1 control flow (``Switch``/``Merge``) a tensor on the branch a run does
not take is *dead*. TensorFlow does not run an op that reads a dead tensor:
its outputs are dead in turn, and only a ``Merge`` runs on its one live
input. A hosted routine is an op like any other, so a callback reading a
``Merge``'s inputs was dead in every run, so were the tensors it handed on
(the ``Merge`` read them), and so was the fetch ("Retval[0] does not have
value").

Two points see dead and live tensors in the same run while their op runs:
before a ``Merge`` (its inputs, one live) and after a ``Switch`` (its two
outputs, one live). There the callback reads a *view* instead, live whenever
the op runs: a ``Merge`` of the same tensors, whose two outputs are the live
tensor and its position. The routine receives that tensor at its position
and None at the others, and runs once per execution of the op; what it
hands on for a position reads the original tensor (`_chosen`), so it is
dead exactly when the original is. Every other point's tensors are live
exactly when its op runs, as TensorFlow propagates deadness.
"""

from __future__ import annotations

import functools

import tensorflow as tf

#: (op type, point) -> the side of the op whose tensors are dead but one
#: whenever the op runs
_ONE_LIVE = {
    ("Merge", "before"): "inputs",
    ("Switch", "after"): "outputs",
}

#: v1 control-flow ops: a Python routine cannot stand in for one (its
#: outputs would have to be dead or live as the op decides)
_V1_CONTROL = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter",
                         "Exit", "RefExit", "NextIteration", "RefNextIteration", "LoopCond"})


def one_live_side(user_op, kind):
    """Names of the tensors of ``user_op`` at point ``kind`` (``"before_op"``,
    ``"after_backward_op"``, ...) of which only one is live when it runs;
    None where all of them are live."""
    side = _ONE_LIVE.get((user_op.type, kind.split("_")[0]))
    if side is None:
        return None
    return [t.name for t in getattr(user_op, side)]


def live_feed(resolve, user_op, kind, selected, inputs, hosted, is_back_edge):
    """What the callback of a routine at point ``kind`` of ``user_op``
    reads: ``(tensors, spread, looped)``, ``spread`` making the routine's
    selection from them (None: they are the hosted tensors themselves) and
    ``looped`` the positions it may not replace (see `live_view`)."""
    members = one_live_side(user_op, kind)
    if members is None:
        return [inputs[i] for i in hosted], None, ()
    feed, positions, looped = live_view(resolve, members, selected, inputs, is_back_edge)
    return feed, functools.partial(spread_live, len(inputs), hosted, positions), looped


def live_view(resolve, members, selected, inputs, is_back_edge):
    """The view a routine reads at a point with dead tensors.

    Args:
        resolve: user tensor name -> the copy's tensor (a stand-in for a
            loop's back edge not built yet).
        members: names of the op's tensors at the point (`one_live_side`).
        selected: the names of the user's tensors behind the routine's
            selection, in order.
        inputs: the routine's selection in the copy (results of earlier
            routines, possibly), in order.
        is_back_edge: tensor -> whether it is a ``NextIteration``'s output
            (or stands in for one).

    Returns:
        ``([value, index], positions, looped)``: the live tensor and its
        position among ``members``, both live whenever the op runs; for
        each selected tensor its position among ``members``; the selected
        positions that are a loop's back edge (a ``NextIteration``'s
        output, which only the ``Merge`` itself may read: TensorFlow allows
        no other cycle), whose routine results must be the original tensor.
    """
    tensors = [resolve(name) for name in members]
    positions = []
    for name, tensor in zip(selected, inputs):
        position = members.index(name)
        tensors[position] = tensor      # what earlier routines handed on
        positions.append(position)
    with tf.name_scope("live"):
        merged = tf.raw_ops.Merge(inputs=tensors)
    looped = [j for j, tensor in enumerate(tensors[p] for p in positions) if is_back_edge(tensor)]
    return [merged.output, merged.value_index], positions, looped


def spread_live(count, hosted, positions, arrays):
    """The routine's selection from a view's ``arrays`` (value, index): the
    value at the selected position that was live, None elsewhere (dead
    tensors and those that cannot leave TensorFlow)."""
    value, index = arrays
    values = [None] * count
    for i in hosted:
        if positions[i] == int(index):
            values[i] = value
    return values


def refuse_replacing(target, kind):
    """The reason a ``replace_*`` routine cannot stand in for ``target``, or
    None."""
    if kind.startswith("replace") and target.type in _V1_CONTROL:
        return (f"replace routine of {target.name!r}: a Python routine cannot replace a v1 "
                f"control-flow op ({target.type}), whose outputs are live or dead as the "
                "branch taken decides; instrument the ops around it")
    return None


def has_v1_control_flow(graph):
    """Whether ``graph`` holds v1 control-flow ops (dead tensors, loop frames)."""
    return any(op.type in _V1_CONTROL for op in graph.get_operations())


def bare_trigger(target, kind, v1_flow=True, gate=list):
    """The input of a routine that passes no tensor (ordered by control
    edges): a scalar computed exactly when the routine is to run, in the op's
    loop frame (TensorFlow refuses an op whose inputs come from two frames).

    Args:
        v1_flow: whether the graph has v1 control flow; without it every op
            runs in one frame, and a constant is the trigger.
        gate: ops -> what to hand ``tf.control_dependencies`` for them
            (`amanda.runtime.tensorflow.emit.Emitter.gate`).

    Returns:
        The routine's input (the routine is also a control input of a
        ``before`` point's op, or waits on an ``after`` point's).
    """
    if not v1_flow:   # every tensor is live, one frame: a constant does
        return tf.constant(0)
    if not kind.startswith("before"):
        with tf.control_dependencies(gate([target])):    # live when the op ran
            return tf.constant(0)
    if target.type in ("Merge", "RefMerge"):   # its inputs are dead but one: a view
        with tf.name_scope("live"):
            return tf.raw_ops.Merge(inputs=list(target.inputs)).value_index
    # a data input carries the branch's liveness: a control edge from a
    # Switch is live on both sides
    readable = [t for t in target.inputs if not t.dtype._is_ref_dtype]
    if readable:
        return tf.raw_ops.Rank(input=readable[0])   # tf.rank folds a known rank
    # v1 variable references (never behind a Switch) or no input at all
    with tf.control_dependencies(gate([t.op for t in target.inputs] + list(target.control_inputs))):
        return tf.constant(0)
