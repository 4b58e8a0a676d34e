"""Rewrite passes over the amanda IR, and the contract they share.

A pass is a callable ``graph -> PassResult(graph, modified)``; `PassManager` runs
a sequence of them, verifying the IR after each one in debug mode, and names the
passes already run when one fails (see `amanda.passes.manager`). The passes:

* `amanda.passes.instrumentation`: run the tools' analysis routines over the ops
  and record their actions (`InstrumentationPass`; `run_instrumentation_pass`
  returns the plan itself);
* `amanda.passes.lower_actions`: turn the recorded actions into
  ``amanda.routine`` ops (`LowerActionsPass`; `lower_actions` returns the graph);
* `amanda.passes.rewrite`: subgraph rewriting by pattern rules (`RewritePass`;
  `apply_rules` returns a `RewriteResult`, itself a `PassResult`).

`amanda.passes.pipeline.instrument_graph` is the one pipeline the graph
backends run between their frontend and their lowering: instrument, backend
extras, ``graph_completed``, ``lower_actions``.
"""

from amanda.passes.manager import PassError, PassManager, PassResult

__all__ = ["PassError", "PassManager", "PassResult"]
