"""Sharded capture on a CUDA device: each rank's block digested on the GPU (the generic device
path, ``capture.shards``) combines to the CPU's one-device record of the logical output.
Skipped without a GPU; run with ``python -m pytest tests/gpu``."""

import pytest
import torch

from drifttool.distributed.plan import ParallelDims
from tests.capture.test_shard_capture import _awkward, _blocks, _one_device, _same, _sharded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dims", [ParallelDims(tp=2, sp=4), ParallelDims(tp=2, sp=2, sp_attention="ulysses")],
                         ids=["tp2xsp4", "tp2xsp2-ulysses"])
@pytest.mark.parametrize("keep_rows", [False, True])
def test_cuda_blocks_combine_to_the_cpu_record(dims, keep_rows):
    n_img, pad = 6889, 13
    site = {"stream": "joint", "samples": [0, 1, 2], "txt_lens": [13, 5, 0], "img_grid": (83, 83)}
    x = _awkward((3, pad + n_img, 8, 16), torch.bfloat16, 41)
    blocks = _blocks(x, dims, "joint_attention_fused", "joint", 1, pad, n_img, row_axis=1, head_axis=2)
    on_gpu = [(t.cuda(), *rest) for t, *rest in blocks]
    for a, b in zip(_one_device(site, x, "BS..", keep_rows), _sharded(site, on_gpu, "BS..", keep_rows)[1]):
        _same(a, b)
