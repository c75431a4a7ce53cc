"""A rank body launched by ``torchrun`` (``test_torchrun``): read the launcher's environment, write
this rank's share of a sample-parallel artifact at ``argv[1]`` for the batch ``argv[2]``
(comma-separated logical ids)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dist_workers import synthetic_run
from drifttool.distributed import (close_distributed, init_distributed, rank_samples,
                                   sample_parallel_layout)

if __name__ == "__main__":
    torch.set_num_threads(1)
    out, batch = Path(sys.argv[1]), [int(i) for i in sys.argv[2].split(",")]
    ctx = init_distributed(mesh_dims=("sample",))
    try:
        layout = {**sample_parallel_layout(batch, ctx.world_size), **ctx.layout()}
        synthetic_run(out, batch, rank_samples(batch, ctx.rank, ctx.world_size), ctx.rank,
                      layout=layout)
    finally:
        close_distributed(ctx)
