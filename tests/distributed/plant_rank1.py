"""torchrun worker: the sample-parallel rollout of ``--batch 4`` on the embedded default, with a
one-ULP change planted in one operator output of logical sample 2 — which rank 1 runs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 plant_rank1.py OUT

Every rank installs the same variant (so the ranks' manifests agree); it changes only the rows of
sample 2, at rollout step 1, block 0, so the first drift against a one-process run is owned by
rank 1.
"""

from __future__ import annotations

import sys

import torch

from drifttool.distributed import close_distributed, init_distributed
from drifttool.probes.variants import Variant
from drifttool.runner import execute
from drifttool.settings import RunSpec

SAMPLE, STEP, BLOCK = 2, 1, 0


class NudgeSample(Variant):
    """``mlp_down_gemm`` as the mode computes it, then the first element of ``SAMPLE``'s first row
    moved to the next float at (``STEP``, ``BLOCK``)."""

    op = "mlp_down_gemm"
    name = "nudge_sample_2"

    def __call__(self, x, w, b):
        out = self.base(x, w, b)
        scope = self.scope()
        samples = scope["samples"] or []
        if (scope["phase"], scope["step"], scope["block"]) == ("rollout", STEP, BLOCK) \
                and SAMPLE in samples and out.dim() == 3:
            out = out.clone()
            row = samples.index(SAMPLE)
            v = out[row, 0, 0]
            out[row, 0, 0] = torch.nextafter(v, torch.tensor(float("inf"), dtype=v.dtype))
        return out


def main(out: str) -> None:
    dist = init_distributed(device="cpu", mesh_dims=("sample",))
    try:
        execute(RunSpec(batch=4, variants={"mlp_down_gemm": NudgeSample().entry()}), out,
                dist=dist)
    finally:
        close_distributed(dist)


if __name__ == "__main__":
    main(sys.argv[1])
