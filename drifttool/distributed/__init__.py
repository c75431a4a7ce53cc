"""Ranks on torch.distributed: the launch context, the split of a batch over ranks, and the few
collectives the artifact writer and the runner need.

    ctx = init_distributed(mesh_dims=("sample",))       # torchrun: gloo on CPU, nccl on CUDA
    mine = rank_samples(range(4), ctx.rank, ctx.world_size)   # rank 1 of 2 -> [2, 3]
    layout = sample_parallel_layout(range(4), ctx.world_size)

``context`` reads torchrun's environment and builds a ``DeviceMesh``; ``samples`` splits a batch's
logical sample ids; ``collectives`` is barrier and object gather/broadcast, no-ops in a single
process. Nothing here imports the rest of drifttool (``artifact/`` and the runner import it).
Source: design.md, "Scale: devices, ranks, runtimes".
"""

from drifttool.distributed.collectives import (all_gather_object, barrier, broadcast_object,
                                               is_distributed)
from drifttool.distributed.context import (DistContext, LaunchEnv, close_distributed,
                                           init_distributed, launch_env)
from drifttool.distributed.samples import rank_samples, sample_parallel_layout, split_samples

__all__ = ["DistContext", "LaunchEnv", "all_gather_object", "barrier", "broadcast_object",
           "close_distributed", "init_distributed", "is_distributed", "launch_env",
           "rank_samples", "sample_parallel_layout", "split_samples"]
