"""Compiled PyTorch under ``DistributedDataParallel`` (docs/distributed.md,
"Compiled DDP").

Dynamo treats DDP in two special ways, and amanda has to follow both:

* **DDP's own forward is not compiled.** ``torch.compile(ddp_model)``
  breaks the graph in DDP's forward (the logger and reducer calls of
  ``_pre_forward``, ``_inside_ddp_forward``, which Dynamo skips on
  purpose, ``_post_forward``) and compiles only the module DDP wraps.
  amanda takes every graph break for code it cannot see and would run the
  whole call eagerly. So inside ``apply`` such a call runs DDP's forward
  eagerly, where amanda's eager runtime sees whatever ops it makes (with
  ``find_unused_parameters=True``, the ``clone`` of ``_DDPSink``, a point
  at DDP's own path, as eagerly), and its module compiled with the user's
  compile settings, as ``DDP(torch.compile(module))`` runs
  (`run_module_compiled`).
* **DDPOptimizer splits the graph at bucket boundaries.** While a DDP
  forward runs (``_get_active_ddp_module()``) and
  ``torch._dynamo.config.optimize_ddp`` is ``"ddp_optimizer"`` (the
  default), Dynamo hands each frame's graph to ``DDPOptimizer``, which
  cuts it where DDP's gradient buckets end and compiles each piece with
  the frame's compiler, on fake tensors. amanda's compiler would have
  analysed each piece alone, on fake tensors (the FLOPs profiler's
  mapping failed reading a weight's values), with op occurrences counted
  per piece. So the active module is hidden from Dynamo while it converts
  one of amanda's frames (`hidden_from_dynamo`), amanda lifts, analyses
  and instruments the whole graph, and then cuts it with DDPOptimizer
  itself (`split_at_buckets`): each piece goes to the user's compiler
  through amanda's AOTAutograd run, which puts the backward points in
  that piece's backward graph, so DDP can all-reduce a bucket's
  gradients once its piece's backward graph has run, as in the vanilla
  compiled step.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["WHOLE_NAME", "active_ddp", "ddp_of_compiled_call", "hidden_from_dynamo",
           "run_module_compiled", "split_at_buckets"]

#: ``node.meta`` key: the node's name in the instrumented Dynamo graph, kept
#: by the copies DDPOptimizer makes of it in the pieces it cuts (which have
#: names of their own); the lifted ops and the backward points name nodes so
#: (`backward._Joint`)
WHOLE_NAME = "amanda_whole_name"


def _ddp_class():
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


# -- torch.compile(ddp_model): DDP's forward eagerly, its module compiled ------------------

def ddp_of_compiled_call(module, callback):
    """The ``DistributedDataParallel`` a compiled call runs, when the call is
    ``torch.compile(ddp_model)``'s: ``module`` (the innermost module on
    amanda's stack) is the ``OptimizedModule`` whose compiler is
    ``callback`` and wraps a DDP. Otherwise None."""
    ddp_class = _ddp_class()
    inner = getattr(module, "_orig_mod", None)
    if ddp_class is None or not isinstance(inner, ddp_class):
        return None
    if getattr(getattr(module, "dynamo_ctx", None), "callback", None) is not callback:
        return None
    if not isinstance(inner._modules.get("module"), torch.nn.Module):
        return None
    return inner


#: DDP -> (the module it wraps, the compile context, that module compiled with it)
_COMPILED_MODULES = weakref.WeakKeyDictionary()


def run_module_compiled(compiled, ddp, cleanups):
    """For this call of ``compiled`` (``torch.compile(ddp)``), ``ddp`` calls
    its module through an ``OptimizedModule`` with ``compiled``'s compile
    settings (one per DDP and settings, kept, so Dynamo's cache and amanda's
    versions see the same callable on every call); ``cleanups`` (Dynamo's
    list for the call) puts the module back when the call ends, also on
    error. The wrapper is no part of module paths (``module.fc1`` as
    eagerly): amanda's eager runtime names modules from below it."""
    from torch._dynamo.eval_frame import OptimizedModule
    module = ddp._modules["module"]
    context = compiled.dynamo_ctx
    entry = _COMPILED_MODULES.get(ddp)
    if entry is None or entry[0] is not module or entry[1] is not context:
        entry = (module, context, OptimizedModule(module, context))
        _COMPILED_MODULES[ddp] = entry
    ddp._modules["module"] = entry[2]

    def put_back():
        if ddp._modules.get("module") is entry[2]:
            ddp._modules["module"] = module
    cleanups.append(put_back)


# -- DDPOptimizer after amanda's instrumentation -------------------------------------------

def active_ddp():
    """The DDP module whose forward is running, when Dynamo would split the
    graph of a frame it converts now with DDPOptimizer; else None."""
    ddp_class = _ddp_class()
    if ddp_class is None:
        return None
    ddp = ddp_class._get_active_ddp_module()
    if ddp is None:
        return None
    from torch._dynamo.utils import get_optimize_ddp_mode
    return ddp if get_optimize_ddp_mode() == "ddp_optimizer" else None


@contextlib.contextmanager
def hidden_from_dynamo(ddp):
    """No active DDP module for Dynamo while it converts a frame of amanda's
    (``ddp`` None: nothing to hide), so it hands the whole graph to
    amanda's compiler, which splits it after instrumenting it."""
    if ddp is None:
        yield
        return
    ddp_class = _ddp_class()       # where DDP keeps it, whatever ddp's own class
    saved, ddp_class._active_ddp_module = ddp_class._active_ddp_module, None
    try:
        yield
    finally:
        ddp_class._active_ddp_module = saved


def split_at_buckets(compiler, ddp):
    """A compiler that cuts the (instrumented) graph where ``ddp``'s
    gradient buckets end, as Dynamo's DDPOptimizer does, and compiles each
    piece with ``compiler``. Its result is a plain function: Dynamo wraps a
    returned ``nn.Module`` (the stitched graph module) in an
    ``OptimizedModule``, whose Python-level ``__call__`` would be one more
    frame of the compiled call for amanda to watch."""
    from torch._dynamo.backends.distributed import DDPOptimizer
    optimizer = DDPOptimizer(bucket_bytes_cap=ddp.bucket_bytes_cap, backend_compile_fn=compiler)

    def compile_split(gm, example_inputs, **kwargs):
        for node in gm.graph.nodes:
            node.meta[WHOLE_NAME] = node.name
        compiled = optimizer.compile_fn(gm, example_inputs, **kwargs)
        if not isinstance(compiled, torch.nn.Module):
            return compiled

        def run(*args):
            return compiled(*args)
        return run
    return compile_split
