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

The code is split along its seams (see "How the runtime is organised"
in ``docs/pytorch-eager.md``); this package is the PyTorch backend's runtime:
``eager/`` (the driver above), ``compiled/`` (``torch.compile``), ``capture``
(``torch.export`` graphs), ``export`` (``amanda.export`` to ONNX), ``tools``
(what the built-in tools read, with the pruning projects' torch code),
``portable_ops``, ``distributed`` and ``examples``. This module is the entry
point and re-exports the names other modules, tests and docs use:

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

The re-exports are loaded on first use (``__getattr__``), so importing a
module of this package that imports no torch (``tools``, ``pruning_*``,
``distributed``, ``examples``) still imports no torch, as when they were
``runtime/pytorch_*.py`` modules beside this one.
"""

from __future__ import annotations

import importlib

# every name other modules, tests and docs read from here (the per-thread
# state, the module hook, the export hooks, the straight-through function...)
# is the object defined once in its module of eager/: name -> that module
_EXPORTS = {
    **dict.fromkeys(["_install_backward", "_walk_new_nodes"], "backward"),
    **dict.fromkeys(["DRIVER", "TorchEagerDriver", "_module_post_hook", "_module_pre_hook",
                     "evaluate"], "driver"),
    **dict.fromkeys(["WRAPPER_MODULES", "_Mode", "_module_path", "_run_op"], "mode"),
    **dict.fromkeys(["BackwardOp", "_Cache", "_OpRecord", "_stable_id", "_StraightThrough",
                     "resolve_straight_through"], "records"),
    **dict.fromkeys(["EXPORTING"], "routines"),
    **dict.fromkeys(["_checkpoint_role", "_Segment", "_state", "_tls"], "segments"),
    **dict.fromkeys(["_FUNCS", "_QUERIES", "NAMESPACE"], "sites"),
}

__all__ = ["DRIVER", "EXPORTING", "NAMESPACE", "WRAPPER_MODULES", "BackwardOp",
           "TorchEagerDriver", "evaluate", "resolve_straight_through"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:   # a submodule not imported yet is found by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.eager.{module}"), name)
    globals()[name] = value   # looked up directly from now on
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
