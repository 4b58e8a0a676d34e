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
in ``docs/pytorch-eager.md``); this module is the entry point and re-exports
the names other modules, tests and docs use:

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

# every name other modules, tests and docs read from here (the per-thread
# state, the module hook, the export hooks, the straight-through function...)
# is the object defined once in its module
from amanda.runtime.pytorch.eager.backward import _install_backward, _walk_new_nodes  # noqa: F401
from amanda.runtime.pytorch.eager.driver import (  # noqa: F401
    DRIVER, TorchEagerDriver, _module_post_hook, _module_pre_hook, evaluate)
from amanda.runtime.pytorch.eager.mode import WRAPPER_MODULES, _Mode, _module_path, _run_op  # noqa: F401
from amanda.runtime.pytorch.eager.records import (  # noqa: F401
    BackwardOp, _Cache, _OpRecord, _stable_id, _StraightThrough, resolve_straight_through)
from amanda.runtime.pytorch.eager.routines import EXPORTING  # noqa: F401
from amanda.runtime.pytorch.eager.segments import _checkpoint_role, _Segment, _state, _tls  # noqa: F401
from amanda.runtime.pytorch.eager.sites import _FUNCS, _QUERIES, NAMESPACE  # noqa: F401

__all__ = ["DRIVER", "EXPORTING", "NAMESPACE", "WRAPPER_MODULES", "BackwardOp",
           "TorchEagerDriver", "evaluate", "resolve_straight_through"]
