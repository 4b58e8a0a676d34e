"""The instrumentation pass: run the tools' analysis routines over IR ops.

Shared by every graph backend (TensorFlow graph mode, ONNX): the frontend lifts
the backend program into an :class:`amanda.ir.Graph`, this pass runs the
analysis routines of an :class:`amanda.tool.Session` on each op and records the
actions they ask for, and the backend's runtime lowers the actions into the
backend program. Nothing here knows a framework: a :class:`GraphBackend` says
what the backend's op and tensor objects are.

Forward ops are analysed first, in graph order; then backward ops (IR ops with
``attrs["backward"]``), whose context starts from a copy of their forward op's
context (``attrs["forward_op"]`` names it; None for gradient ops that belong to
no forward op, whose ``get_op()`` is then None).
"""

from __future__ import annotations

import collections

from amanda import controls
from amanda.context import OpContext, take_actions
from amanda.passes.manager import PassResult
from amanda.tool import BACKWARD_AFTER, BACKWARD_BEFORE, FORWARD_AFTER, FORWARD_BEFORE


class GraphBackend:
    """What the pass needs to know of a backend. Subclass per backend.

    Attributes:
        namespace: the contexts' namespace, e.g. ``"tensorflow/2.21.0/graph"``.
    """

    namespace = ""

    def __init__(self, namespace=None):
        if namespace is not None:
            self.namespace = namespace

    def raw_op(self, ir_op):
        """The backend's op object for an IR op (``get_op()``)."""
        return ir_op

    def values(self, ir_tensors):
        """What ``get_inputs()`` & co. return for IR tensors."""
        return list(ir_tensors)

    def context(self, op):
        """A new context for forward op ``op``: its id is the IR op's name
        unless the backend gives ops ids of their own (compiled PyTorch
        gives eager's)."""
        return OpContext(self.namespace, self.raw_op(op), op.name, op.type)

    def inputs(self, op):
        """What the context shows of the op's inputs (``get_inputs()`` of a
        forward op, ``get_grad_outputs()`` of a backward op). Called in graph
        order, at the op's before point if it has routines there and again at
        its after point, just before `outputs`: a backend that analyses on
        values it computes (compiled PyTorch runs the graph as the pass walks
        it) may compute them here."""
        return self.values(op.inputs)

    def outputs(self, op):
        """What the context shows of the op's outputs, at its after point
        (after `inputs` for the same op)."""
        return self.values(op.outputs)


class OpActions:
    """The actions recorded on one IR op, and its context."""

    __slots__ = ("op", "context", "before", "after", "replace")

    def __init__(self, op, context):
        self.op = op
        self.context = context
        self.before, self.after, self.replace = [], [], []

    def __bool__(self):
        return bool(self.before or self.after or self.replace)

    def __repr__(self):
        return (f"<OpActions {self.op.name}: {len(self.before)} before, "
                f"{len(self.after)} after, {len(self.replace)} replace>")


class InstrumentationPlan:
    """Result of the pass: actions per IR op name.

    Attributes:
        graph: the analysed graph.
        ops: op name -> :class:`OpActions`, for every analysed op.
    """

    def __init__(self, graph):
        self.graph = graph
        self.ops = {}

    def actions(self):
        """The ops that carry actions, in graph order."""
        return [entry for entry in self.ops.values() if entry]

    def __len__(self):
        return len(self.actions())


def run_instrumentation_pass(graph, session, backend, plan=None, forward=None):
    """Run ``session``'s analysis routines on the ops of ``graph``.

    Args:
        graph: an :class:`amanda.ir.Graph` lifted by a frontend.
        session: the applied tools (:class:`amanda.tool.Session`).
        backend: a :class:`GraphBackend`.
        plan: a plan from an earlier run on a smaller version of this graph:
            ops it analysed are kept, only new ops are analysed.
        forward: ``{op name: OpActions}`` of analysed ops of *other* graphs
            that backward ops of this one may name as their ``forward_op``
            (a TF gradient function's body differentiates the ops of the
            forward function's body).

    Returns:
        An :class:`InstrumentationPlan`.

    Raises:
        ToolError: an analysis routine failed; the message names the tool,
            the routine, the op and the namespace.
    """
    old = plan.ops if plan is not None else {}
    result = InstrumentationPlan(graph)
    backward = []
    for op in graph.ops:
        if op.name in old:
            result.ops[op.name] = old[op.name]
        elif op.attrs.get("backward"):
            backward.append(op)
        else:
            result.ops[op.name] = _analyse_forward(op, graph, session, backend)
    owners = result.ops if not forward else collections.ChainMap(result.ops, forward)
    for op in backward:
        result.ops[op.name] = _analyse_backward(op, graph, session, backend, owners)
    return result


class InstrumentationPass:
    """`run_instrumentation_pass` under the pass contract (`amanda.passes.manager`).

    The pass only analyses: it returns ``PassResult(graph, modified=False)`` and
    keeps the plan in `plan`, where `LowerActionsPass` finds it. Run again (on a
    grown graph), it reuses its last plan for the ops analysed already.

    Args:
        session: the applied tools (:class:`amanda.tool.Session`).
        backend: a :class:`GraphBackend`.
        plan: an earlier plan to start from, as for `run_instrumentation_pass`.
        forward: forward ops of other graphs, as for `run_instrumentation_pass`.
    """

    name = "instrument"

    def __init__(self, session, backend, plan=None, forward=None):
        self.session = session
        self.backend = backend
        self.plan = plan
        self.forward = forward

    def __call__(self, graph):
        self.plan = run_instrumentation_pass(graph, self.session, self.backend, plan=self.plan,
                                             forward=self.forward)
        return PassResult(graph, False)


def _analyse_forward(op, graph, session, backend):
    context = backend.context(op)
    return _run_points(op, graph, session, backend, context,
                       (FORWARD_BEFORE, FORWARD_AFTER), ("inputs", "outputs"))


def _analyse_backward(op, graph, session, backend, owners):
    """``owners``: op name -> `OpActions` of the analysed forward ops."""
    owner_name = op.attrs.get("forward_op")
    owner = owners.get(owner_name) if owner_name else None
    if owner is not None:
        forward_op, parent = owner.op, owner.context
        context = OpContext(backend.namespace, backend.raw_op(forward_op), forward_op.name,
                            forward_op.type, backward_op=backend.raw_op(op),
                            backward_op_id=op.name, parent=parent)
    else:
        context = OpContext(backend.namespace, None, None, None,
                            backward_op=backend.raw_op(op), backward_op_id=op.name)
    return _run_points(op, graph, session, backend, context,
                       (BACKWARD_BEFORE, BACKWARD_AFTER), ("grad_outputs", "grad_inputs"))


def _run_points(op, graph, session, backend, context, points, slots):
    """Run the routines of the op's before and after points: the op's inputs
    are visible at both, its outputs at the after point only.

    ``slots`` names the context values the op's inputs and outputs fill, e.g.
    ``("inputs", "outputs")`` (a leading underscore, as in ``"_inputs"``, is
    accepted too)."""
    (before, after), (input_name, output_name) = points, (s.lstrip("_") for s in slots)
    context._set_ir(op, graph)
    entry = OpActions(op, context)
    if session.routines[before]:
        context._set_values(**{input_name: backend.inputs(op)})
        analyse_point(session, before, context, entry)
    if session.routines[after]:
        context._set_values(**{input_name: backend.inputs(op), output_name: backend.outputs(op)})
        analyse_point(session, after, context, entry)
    # Tensors of the analysis are not kept: contexts live as long as the plan.
    context._forget_values()
    return entry


def analyse_point(session, point, context, target):
    """Run the analysis routines of ``point`` on ``context`` and move the
    actions they record into ``target`` (its ``before``, ``after`` and
    ``replace`` lists, `take_actions`).

    The one analysis step of every path: this pass takes it at each point of
    each IR op, eager PyTorch at each point of a newly seen op's call and of
    its autograd nodes, as they execute (an eager op's after point comes
    once it has run). Amanda is muted meanwhile: an analysis routine's own
    tensor calls and sessions are not instrumented.

    Raises:
        ToolError: a routine failed, or more than one routine replaces the op.
    """
    with controls.muted():
        session.analyse(point, context)
    take_actions(context, target)
