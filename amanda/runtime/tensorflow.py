"""TensorFlow graph-mode driver: ``Session.run`` and ``tf.function`` calls
execute an instrumented copy.

Inside ``amanda.apply``, ``Session.run`` and concrete functions' ``_call_flat``
are intercepted (the two patches, removed when the outermost scope exits). The
user's graph is lifted into the IR, the tools' analysis routines run over it
(the shared instrumentation pass), the recorded actions are lowered to
``amanda.routine`` IR ops, and those are realised in a *copy* of the user's
graph, which a shadow session runs. The user's graph is never modified: same
operations, same collections.

* Analysis runs while the graph is rewritten; instrumentation routines run
  every time the op executes, as ``tf.numpy_function`` callbacks receiving
  NumPy arrays (None for tensors that cannot leave TensorFlow).
* Rewrites are cached per graph version; when the user's graph grows, the
  pass reuses the previous plan (only new ops are analysed) and only new
  operations are imported into the copy.
* Variables: the shadow session receives the user session's variable values
  at the first instrumented run of each ``apply`` scope and hands them back
  when the scope ends, through the user graph's own read and initializer
  ops (fed), so checkpoints and later plain runs see the trained values and
  no instrumentation state.
* Ops inside the function bodies of ``While``/``If``/``Case`` and
  ``PartitionedCall`` are points too, with ids ``"<call op>/<attribute>/<node>"``
  (`_BodyRewrite`): each body with routines becomes a renamed function in the
  copy's library, called by a stateful twin of the call op; ops of gradient
  bodies are backward points mapped to the forward body's ops.
* While analysis routines run, `evaluate` computes values of the user's
  tensors (uninstrumented, with the current variable values and the inputs of
  the run being rewritten) and `current_session` returns the user's session.

How it all fits together, and its limits, is in ``docs/tensorflow.md``.

The work is in one module per seam (``tensorflow_probes``, ``tensorflow_hosting``,
``tensorflow_bodies``, ``tensorflow_rewrite``, ``tensorflow_variables``,
``tensorflow_shadow``, ``tensorflow_functions``, ``tensorflow_driver``); this
entry module re-exports the names imported from it.
"""

from __future__ import annotations

# every public name that was importable from here before the split still is (the
# runtime package loads ``DRIVER``, ``evaluate`` and ``instrument_graph`` from here)
from amanda.runtime.tensorflow_driver import (  # noqa: F401
    DRIVER, TensorFlowGraphDriver, instrument_graph)
from amanda.runtime.tensorflow_probes import (  # noqa: F401
    NAMESPACE, TFGraphBackend, current_session, evaluate)
from amanda.runtime.observation import hosted_observation, observation_budget  # noqa: F401
from amanda.runtime.tensorflow_shadow import current_rewrite  # noqa: F401

__all__ = ["NAMESPACE", "current_session", "evaluate"]
