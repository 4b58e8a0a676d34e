"""PyTorch eager driver: every operator call is an instrumentation point.

How it works (the paper's eager "JIT", Sec. 5):

* A ``TorchFunctionMode`` sees every ``torch.*``, ``torch.nn.functional.*`` and
  Tensor method/operator call made by user code; calls made *inside* an op
  (e.g. ``F.layer_norm`` calling ``torch.layer_norm``) are part of that op.
* Each call gets a stable op id from (innermost module, calling code location,
  function, occurrence count). Counts restart when a root module is entered
  (or, for code outside modules, when the first op of the step runs again), so
  next step's conv gets the same id though its tensors are new objects.
* At an op's first execution the tools' analysis routines run and record
  actions; later executions replay them. An op without actions takes a short
  path that only looks its record up.
* The autograd nodes an op creates are found by walking from its outputs down
  to nodes older than the op (autograd sequence numbers), so one forward op can
  own many backward ops. Backward points are node pre/post hooks installed on
  those nodes only when something must run there.

Nothing global is left behind: the mode is popped and the two global module
hooks (which track the modules being called) are removed when the outermost
``apply`` scope exits.

The backend's packages: ``eager/`` (the path above), ``compiled/``
(``torch.compile``d models), ``capture`` (``torch.export`` graphs), ``export``
(ONNX export of instrumented models), ``tools`` (facts the built-in tools ask
of a backend), ``portable_ops`` and ``distributed``; the frontend is
:mod:`amanda.frontends.pytorch`. This module declares the backend's
descriptor (:data:`BACKEND`) and imports no framework: its parts load when
first used. The eager path's modules (see "How the runtime is organised" in
``docs/pytorch-eager.md``):

* :mod:`~amanda.runtime.pytorch.eager.sites`: which calls are points, calling sites;
* :mod:`~amanda.runtime.pytorch.eager.records`: op records, the session cache,
  ``BackwardOp``, the straight-through function;
* :mod:`~amanda.runtime.pytorch.eager.segments`: per-thread state, checkpointed
  segments and their recomputation;
* :mod:`~amanda.runtime.pytorch.eager.mode`: the ``TorchFunctionMode`` (hot path),
  op ids and module paths, ``_run_op``;
* :mod:`~amanda.runtime.pytorch.eager.routines`: analysis, actions, ``replace_op``;
* :mod:`~amanda.runtime.pytorch.eager.backward`: the autograd walk and node hooks;
* :mod:`~amanda.runtime.pytorch.eager.driver`: ``DRIVER``, the global module hooks,
  the backward engine entry and ``torch.compile``.
"""

from __future__ import annotations

from amanda.runtime.backends import Backend, lazy_names, register

BACKEND = register(Backend(
    name="pytorch",
    frameworks=("torch",),
    value_modules=("torch",),
    model_modules=("torch",),
    driver="amanda.runtime.pytorch.eager.driver:DRIVER",
    evaluate="amanda.runtime.pytorch.eager.driver:evaluate",
    export="amanda.runtime.pytorch.export:export_torch",
    tool_support="amanda.runtime.pytorch.tools",
    vocabulary="amanda.runtime.pytorch.vocabulary",
    rewrite_rules="amanda.runtime.pytorch.rewrite_rules",
    portable_ops="amanda.runtime.pytorch.portable_ops",
    target_provider="amanda.frontends.pytorch.targets",
))

#: the public names of the eager path, loaded (with torch) when first read
_PUBLIC = {
    "DRIVER": "amanda.runtime.pytorch.eager.driver",
    "TorchEagerDriver": "amanda.runtime.pytorch.eager.driver",
    "evaluate": "amanda.runtime.pytorch.eager.driver",
    "EXPORTING": "amanda.runtime.pytorch.eager.routines",
    "NAMESPACE": "amanda.runtime.pytorch.eager.sites",
    "WRAPPER_MODULES": "amanda.runtime.pytorch.eager.mode",
    "BackwardOp": "amanda.runtime.pytorch.eager.records",
    "resolve_straight_through": "amanda.runtime.pytorch.eager.records",
}

__all__ = ["BACKEND", *_PUBLIC]


__getattr__ = lazy_names(__name__, _PUBLIC)
