"""The one instrumentation pipeline: analysis, whole graph, lowering.

Every graph backend runs the same passes between its frontend and its
lowering, through `instrument_graph`::

    lift (frontend)  ->  instrument  ->  [backend extras]  ->  graph_completed
                     ->  lower_actions  ->  backend lowering (runtime)

* ``instrument`` runs the tools' analysis routines on every op and records
  their actions (`amanda.passes.instrumentation`); given the plan of an
  earlier run on a smaller version of the graph, it analyses new ops only.
* backend extras are passes of the backend's own (ONNX analyses the bodies
  of ``If``/``Loop``/``Scan`` there).
* ``graph_completed`` hands the whole analysed graph to the tools that set
  ``requires_graph`` (graph tracing, effective path), on every backend.
* ``lower_actions`` turns the actions into routine ops of a new graph
  (`amanda.passes.lower_actions`); the analysed graph is left as it was,
  unless its caller owns it (``lower_in_place``) and no graph tool kept it.

All of it is amanda's own work, so it runs inside `amanda.controls.muted`:
an analysis routine's own tensor calls and sessions are not instrumented.
Lifting and the backend's lowering stay in the frontends and runtimes.
"""

from __future__ import annotations

from amanda import controls
from amanda.passes.instrumentation import InstrumentationPass
from amanda.passes.lower_actions import LowerActionsPass
from amanda.passes.manager import PassManager, PassResult

__all__ = ["GraphCompletedPass", "instrument_graph"]


class GraphCompletedPass:
    """Hands the analysed graph to the tools that asked for whole graphs.

    Args:
        session: the applied tools (:class:`amanda.tool.Session`).
    """

    name = "graph_completed"

    def __init__(self, session):
        self.session = session

    def __call__(self, graph):
        if self.session.requires_graph:
            self.session.graph_completed(graph)
        return PassResult(graph, False)


def instrument_graph(graph, session, backend, *, plan=None, extras=(), name="instrument",
                     whole=True, forward=None, lower_in_place=False, lower_when=None):
    """Runs the pipeline over an IR graph a frontend lifted.

    Args:
        graph: the lifted :class:`amanda.ir.Graph` (not changed).
        session: the applied tools.
        backend: the backend's :class:`~amanda.passes.instrumentation.GraphBackend`
            (what contexts show of the user's program).
        plan: the plan of an earlier run on a smaller version of ``graph``.
        extras: backend passes run after the analysis, before
            ``graph_completed``.
        name: the pipeline's name in error messages.
        whole: ``graph`` is a whole program, handed to graph tools; False for
            a part of one (a TF function body instrumented on its own).
        forward: analysed forward ops of other graphs that backward ops of
            ``graph`` differentiate (a TF gradient function's body), as for
            `amanda.passes.instrumentation.run_instrumentation_pass`.
        lower_in_place: the caller owns ``graph`` and reads it no more, so
            routine ops may be lowered into it instead of into a copy. Not
            done when graph tools received ``graph`` (they may keep it).
        lower_when: ``lower_when(plan, graph)`` (after the analysis and the
            extras) says whether to lower at all; where it says no, ``graph``
            comes back as it was analysed and the backend realises the plan
            itself (ONNX's observe-only sessions read the plan's actions at
            their sites, `amanda.runtime.onnx.sites`). None: always lower.

    Returns:
        ``(plan, lowered)``: the :class:`InstrumentationPlan` and the graph
        with routine ops (new unless lowered in place).

    Raises:
        ToolError: a tool's routine failed (names tool, routine, op); the note
            names the pass it failed in.
        PassError: a pass broke the IR (named with the passes run before it).
    """
    analyse = InstrumentationPass(session, backend, plan, forward)
    handed_out = whole and session.requires_graph
    passes = [analyse, *extras, *([GraphCompletedPass(session)] if whole else []),
              LowerActionsPass(analyse, in_place=lower_in_place and not handed_out,
                               when=lower_when)]
    with controls.muted():
        result = PassManager(passes, name=name)(graph)
    return analyse.plan, result.graph
