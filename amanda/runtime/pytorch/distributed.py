"""The ``torch.distributed`` side of :mod:`amanda.distributed`.

Process groups, local multi-process runs and DDP wrapping; the merging of
reports stays framework-free in :mod:`amanda.distributed`. torch is
imported inside the functions.
"""

from __future__ import annotations

import os
import pickle
import sys

from amanda.errors import AmandaError

__all__ = ["process_group", "run_workers", "wrap_ddp"]


def process_group():
    """``torch.distributed``, once a process group is initialised.

    Raises:
        AmandaError: no process group.
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise AmandaError("amanda.distributed: no torch.distributed process group; "
                          "call torch.distributed.init_process_group first")
    return dist


def _local_worker(rank, worker, nproc, port, folder, args):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nproc)
    try:
        result = worker(rank, nproc, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.pickle"), "wb") as f:
        pickle.dump(result, f)
    # The result is on disk: leave without running C++ static destructors. A
    # gloo/TCPStore thread still joinable when they run aborts the process
    # ("terminate called without an active exception", SIGABRT) once in a
    # while, after a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(worker, nproc, port, folder, args):
    """Spawn ``nproc`` processes joined in a gloo group on 127.0.0.1:``port``;
    rank ``r`` runs ``worker(r, nproc, *args)`` and pickles its result to
    ``folder/rank<r>.pickle``."""
    import torch.multiprocessing as mp
    mp.spawn(_local_worker, args=(worker, nproc, port, folder, args), nprocs=nproc)


def wrap_ddp(model):
    """``model`` in ``DistributedDataParallel``, with one intra-op thread (N
    processes share the machine's cores)."""
    import torch
    torch.set_num_threads(1)
    return torch.nn.parallel.DistributedDataParallel(model)
