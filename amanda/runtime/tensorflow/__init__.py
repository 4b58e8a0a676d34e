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

The work is in one module per seam (``probes``, ``hosting``, ``bodies``,
``rewrite``, ``emit``, ``variables``, ``shadow``, ``functions``, ``driver``,
...); the frontend is :mod:`amanda.frontends.tensorflow`. This module
declares the backend's descriptor (:data:`BACKEND`) and imports no
framework: its public names load, with TensorFlow, when first read.
"""

from __future__ import annotations

from amanda.runtime.backends import Backend, lazy_names, register

BACKEND = register(Backend(
    name="tensorflow",
    frameworks=("tensorflow",),
    value_modules=("tensorflow", "keras"),
    program_modules=("tensorflow",),
    driver="amanda.runtime.tensorflow.driver:DRIVER",
    evaluate="amanda.runtime.tensorflow.probes:evaluate",
    instrument="amanda.runtime.tensorflow.driver:instrument_graph",
    tool_support="amanda.runtime.tensorflow.tools",
    vocabulary="amanda.runtime.tensorflow.vocabulary",
    rewrite_rules="amanda.runtime.tensorflow.rewrite_rules",
    portable_ops="amanda.runtime.tensorflow.portable_ops",
))

#: public name -> the module defining it, loaded (with TensorFlow) when first read
_PUBLIC = {
    "DRIVER": "amanda.runtime.tensorflow.driver",
    "TensorFlowGraphDriver": "amanda.runtime.tensorflow.driver",
    "instrument_graph": "amanda.runtime.tensorflow.driver",
    "NAMESPACE": "amanda.runtime.tensorflow.probes",
    "TFGraphBackend": "amanda.runtime.tensorflow.probes",
    "current_session": "amanda.runtime.tensorflow.probes",
    "evaluate": "amanda.runtime.tensorflow.probes",
    "current_rewrite": "amanda.runtime.tensorflow.shadow",
    "hosted_observation": "amanda.runtime.observation",     # shared with ONNX
    "observation_budget": "amanda.runtime.observation",
}

__all__ = ["BACKEND", "NAMESPACE", "current_session", "evaluate"]


__getattr__ = lazy_names(__name__, _PUBLIC)
