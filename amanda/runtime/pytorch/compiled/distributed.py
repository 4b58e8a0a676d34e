"""Compiled PyTorch under ``DistributedDataParallel`` (docs/distributed.md,
"Compiled DDP").

**DDPOptimizer splits the graph at bucket boundaries.** While a DDP
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

import torch

__all__ = ["WHOLE_NAME", "active_ddp", "hidden_from_dynamo", "split_at_buckets"]

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
