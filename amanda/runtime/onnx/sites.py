"""Observe-only routines at their sites: the plan read without routine ops.

A session whose routines all only look attaches them to the graph
onnxruntime optimised (`amanda.runtime.onnx.observe._SideBranches`); the
model it writes has none of the user's nodes rewired. What that needs of
each routine is what its routine op would carry: the action, the op it
instruments and the tensors it selects, in program order. Lowering the plan
into routine ops (`amanda.passes.lower_actions`) and walking them again cost
the small BERT's creation about 16 ms of its 80, for nothing the result
keeps; so when the plan is observe-only (`observes_only`, the same test as
for routine ops) and no If/Loop/Scan body carries actions, `_instrument`
stops the pipeline before lowering (``lower_when``) and hands the session a
`SitedGraph` instead.

A `Site` stands where lowering would put the routine op and answers what
the side branches ask of one (``type``, ``attrs``, ``inputs``): an
observer passes its tensors on unchanged, so every site reads the user's own
tensors, and has no outputs. Where a model then has to be written with the
routines in its dataflow after all (a tensor the optimiser removed that
cannot be recomputed), `SitedGraph.lowered` lowers the plan as the pipeline
would have.
"""

from __future__ import annotations

from amanda.passes.lower_actions import ROUTINE, lower_actions, selected


class Site:
    """One observe-only action where its routine op would be.

    Attributes mirror a routine op's: ``type`` (`ROUTINE`), ``attrs``
    (``kind``, ``action``, ``target``: the instrumented op's name),
    ``inputs`` (the user's tensors it selects), ``outputs`` (none: nothing
    reads an observer's results); its ``name`` is None.
    """

    __slots__ = ("attrs", "inputs")
    type = ROUTINE
    outputs = ()
    name = None   # (never an op's name: look-ups by name find the ops)

    def __init__(self, action, target, tensors):
        self.attrs = {"kind": action.kind, "action": action, "target": target.name}
        self.inputs = tuple(tensors)

    def __repr__(self):
        return f"<Site {self.attrs['kind']} {self.attrs['target']!r}>"


class SitedGraph:
    """An analysed IR graph read with its plan's sites in program order.

    Iterating it (or its ``ops``) gives the graph's ops with each op's
    before-sites just ahead of it and its after-sites just behind it, in the
    order their actions were recorded, as `lower_actions` would place the
    routine ops; ``attrs``, ``inputs``, ``outputs``, ``name`` and
    ``namespace`` are the graph's. The graph itself is not changed.

    Raises:
        ToolError: (constructing) an action selects a position the op does
            not have, as lowering would.
    """

    def __init__(self, graph, plan):
        self.graph = graph
        self.plan = plan
        items = []
        for op in graph.ops:
            entry = plan.ops.get(op.name)
            if not entry:
                items.append(op)
                continue
            items.extend(_sites(op, entry.before, op.inputs))
            items.append(op)
            # (a replacing action is never observe-only: its site is only
            # there for `observes_only` to say so)
            items.extend(_sites(op, entry.replace, op.inputs))
            items.extend(_sites(op, entry.after, op.outputs))
        self.ops = items

    def __iter__(self):
        return iter(self.ops)

    def __len__(self):
        return len(self.ops)

    @property
    def attrs(self):
        return self.graph.attrs

    @property
    def inputs(self):
        return self.graph.inputs

    @property
    def outputs(self):
        return self.graph.outputs

    @property
    def name(self):
        return self.graph.name

    @property
    def namespace(self):
        return self.graph.namespace

    def lowered(self):
        """A copy of the graph with the plan lowered into routine ops, as the
        pipeline would have returned it."""
        return lower_actions(self.graph, self.plan)


def _sites(op, actions, tensors):
    return [Site(action, op, tensors if action.positions is None
                 else [tensors[p] for p in selected(tensors, action, op)])
            for action in actions]


def lowerable(graph):
    """``graph`` as routine ops: a `SitedGraph` lowered, any other graph as it is."""
    return graph.lowered() if isinstance(graph, SitedGraph) else graph
