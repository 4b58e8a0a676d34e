"""Lower recorded actions into the IR: one ``amanda.routine`` op per action.

The result is an ordinary IR graph: each action becomes an op of type
:data:`ROUTINE` that consumes the selected tensors and produces their
replacements, and the IR's use-def is rewired so the instrumented program reads
them. Backend runtimes then only have to realise ``amanda.routine`` ops (as
callbacks, or natively for portable routines); everything else in the graph is
the backend's own program.

Rewiring follows what eager PyTorch does, so one tool means the same on every
backend:

* before an op: the op and its own backward ops read the replacements (in
  eager, the op's autograd nodes saved the values it was called with);
* after an op: every other consumer reads the replacements, except the op's own
  backward ops (its autograd nodes saved its real outputs);
* before/after a backward op: its gradient inputs / outputs are replaced;
* replacing an op: consumers of its outputs read the routine's results.
"""

from __future__ import annotations

from amanda.context import AFTER_OP, BEFORE_OP, REPLACE_OP
from amanda.errors import ToolError, describe
from amanda.passes.manager import PassResult

ROUTINE = "amanda.routine"


def lower_actions(graph, plan, *, in_place=False):
    """Return a copy of ``graph`` with every action of ``plan`` as a routine op.

    Args:
        graph: the analysed :class:`amanda.ir.Graph` (left untouched unless
            ``in_place``).
        plan: its :class:`~amanda.passes.instrumentation.InstrumentationPlan`.
        in_place: lower into ``graph`` itself instead of a copy. Only for a
            caller that owns ``graph`` and reads it no more (a frontend that
            lifted it for this one instrumentation): copying costs about as
            much as lifting. The result is the same graph the copy would be.

    Returns:
        A new graph (``graph`` itself when ``in_place``). Routine ops carry
        ``attrs``: ``kind`` (the action kind), ``routine`` and ``tool``
        (names), ``target`` (the instrumented op's name) and ``action`` (the
        :class:`~amanda.context.Action` itself, kept in memory only).
    """
    result = graph if in_place else graph.copy()
    owned = _backward_ops_by_owner(result)
    by_name = {op.name: op for op in result.ops}
    for entry in plan.actions():
        op = by_name[entry.op.name]
        for action in entry.replace:
            _lower_replace(result, op, action, owned)
        for action in entry.before:
            _lower_before(result, op, action, owned)
        # each after-routine is inserted right behind the op and reads its
        # outputs, so lowering them last to first chains them in recorded
        # order: the k-th routine sees what the (k-1)-th one returned
        for action in reversed(entry.after):
            _lower_after(result, op, action, owned)
    return result


class LowerActionsPass:
    """`lower_actions` under the pass contract (`amanda.passes.manager`).

    Args:
        plan: the :class:`~amanda.passes.instrumentation.InstrumentationPlan` to
            lower, or the `InstrumentationPass` that makes it (its plan is read
            when this pass runs, so both can be queued in one manager).
        in_place: lower into the input graph (see `lower_actions`).
        when: ``when(plan, graph)`` says whether to lower; where it says no,
            the pass returns its input unchanged (``modified`` False). None:
            always.

    The result's graph is a new graph (the input is left untouched, as
    `lower_actions` does) unless ``in_place``; ``modified`` says whether any
    op carried actions.
    """

    name = "lower_actions"

    def __init__(self, plan, *, in_place=False, when=None):
        self.source = plan
        self.in_place = in_place
        self.when = when

    def __call__(self, graph):
        plan = getattr(self.source, "plan", self.source)
        if plan is None:
            raise ValueError("lower_actions has no plan: run the instrumentation pass first")
        if self.when is not None and not self.when(plan, graph):
            return PassResult(graph, False)
        return PassResult(lower_actions(graph, plan, in_place=self.in_place),
                          bool(plan.actions()))


def _backward_ops_by_owner(graph):
    owned = {}
    for op in graph.ops:
        owner = op.attrs.get("forward_op") if op.attrs.get("backward") else None
        if owner:
            owned.setdefault(owner, set()).add(op)
    return owned


def selected(values, action, op):
    """The positions of ``values`` (an op's inputs or outputs) ``action``
    selects, in order.

    Raises:
        ToolError: a position is past the op's tensors (names the tool,
            routine and op).
    """
    if action.positions is None:
        return list(range(len(values)))
    for p in action.positions:
        if p >= len(values):
            raise ToolError(f"{action.kind} selects position {p} but the op has "
                            f"{len(values)} such tensors", tool=action.tool,
                            routine=action.func, op_name=op.type, op_id=op.name,
                            namespace=op.namespace or None)
    return list(action.positions)


def _routine_op(graph, action, target, inputs, num_outputs):
    return graph.create_op(ROUTINE, inputs, num_outputs=num_outputs, attrs={
        "kind": action.kind, "routine": describe(action.func),
        "tool": describe(action.tool) if action.tool is not None else None,
        "target": target.name, "action": action})


def _lower_before(graph, op, action, owned):
    positions = selected(op.inputs, action, op)
    originals = [op.inputs[p] for p in positions]
    with graph.inserting_before(op):
        routine = _routine_op(graph, action, op, originals, len(originals))
    # the op reads the replacements at the selected positions only (one tensor
    # may feed several); its backward ops wherever they read the originals
    for p, new in zip(positions, routine.outputs):
        op.replace_input_with(p, new)
    readers = owned.get(op.name, set()) if action.kind == BEFORE_OP else set()
    for original, new in zip(originals, routine.outputs):
        _rewire(original, new, lambda user: user in readers)


def _lower_after(graph, op, action, owned):
    positions = selected(op.outputs, action, op)
    originals = [op.outputs[p] for p in positions]
    with graph.inserting_after(op):
        routine = _routine_op(graph, action, op, originals, len(originals))
    keep = owned.get(op.name, set()) if action.kind == AFTER_OP else set()
    for original, new in zip(originals, routine.outputs):
        _rewire(original, new, lambda user: user is not routine and user not in keep)
    _replace_graph_outputs(graph, originals, routine.outputs)


def _replace_graph_outputs(graph, originals, replacements):
    """Graph outputs read what consumers read (one pass over the outputs)."""
    swap = {id(o): n for o, n in zip(originals, replacements)}
    outputs = graph.outputs
    if any(id(t) in swap for t in outputs):
        graph.set_outputs([swap.get(id(t), t) for t in outputs])


def _lower_replace(graph, op, action, owned):
    positions = selected(op.inputs, action, op)
    inputs = [op.inputs[p] for p in positions]
    with graph.inserting_after(op):
        routine = _routine_op(graph, action, op, inputs, len(op.outputs))
    keep = owned.get(op.name, set()) if action.kind == REPLACE_OP else set()
    for original, new in zip(op.outputs, routine.outputs):
        _rewire(original, new, lambda user: user is not routine and user not in keep)
    _replace_graph_outputs(graph, op.outputs, routine.outputs)


def _rewire(original, new, accept):
    for user, position in list(original.uses):
        if accept(user):
            user.replace_input_with(position, new)

