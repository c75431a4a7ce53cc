"""Ranks on torch.distributed: the launch context, the split of a batch over ranks, and the
parallel layouts (TP/SP/CFG rule tables, canonical collectives, Ring attention).

    ctx = init_distributed(mesh_dims=("sample",))       # torchrun: gloo on CPU, nccl on CUDA
    mine = rank_samples(range(4), ctx.rank, ctx.world_size)   # rank 1 of 2 -> [2, 3]
    layout = sample_parallel_layout(range(4), ctx.world_size)

``context`` reads torchrun's environment and builds a ``DeviceMesh``; ``samples`` splits a batch's
logical sample ids; ``spawn`` is the loopback rendezvous of ranks started from one process. The
barrier and object gather/broadcast the artifact writer needs sit below it, in
``drifttool.collectives``; running the main job on spawned ranks sits above the runner, in
``drifttool.launch``. Source: design.md, "Scale: devices, ranks, runtimes".
"""

from drifttool.distributed.context import (DistContext, LaunchEnv, close_distributed,
                                           init_distributed, launch_env)
from drifttool.distributed.samples import rank_samples, sample_parallel_layout, split_samples

__all__ = ["DistContext", "LaunchEnv", "close_distributed", "init_distributed", "launch_env",
           "rank_samples", "sample_parallel_layout", "split_samples"]
