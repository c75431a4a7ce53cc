"""The portable strict inputs are the same bytes on a CUDA device as on the CPU: the ``exact``
RoPE tables computed from positions on the device, and the ``philox`` noise's Box–Muller run on
the device (its Philox words come from the CPU's exact integer arithmetic). Skipped without a
GPU; run on the GPU machine with ``python -m pytest tests/gpu``.
"""

import pytest
import torch

from drifttool.model.rope import image_positions, rope_table, text_positions
from drifttool.ops import strict_math as sm
from drifttool.sampling import noise as N
from tests.conftest import assert_same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("h,w,L", [(83, 83, 512), (4, 6, 13)])
def test_exact_rope_tables_same_bytes_on_cuda(h, w, L):
    for pos in (image_positions(h, w), text_positions(h, w, L)):
        cpu = rope_table(pos, (16, 56, 56), algorithm="exact")
        dev = rope_table(pos.cuda(), (16, 56, 56), algorithm="exact")
        assert dev.device.type == "cuda"
        assert_same_bytes(torch.view_as_real(dev.cpu()), torch.view_as_real(cpu), f"rope {h}x{w}+{L}")


@pytest.mark.parametrize("block,count", [(0, 1536), (3, 441_856)])
def test_philox_noise_same_bytes_on_cuda(block, count):
    key = N.philox_key(386, 1)
    cpu = N.philox_normals(key, block, count)
    dev = N.philox_normals(key, block, count, device="cuda")
    assert dev.device.type == "cuda"
    assert_same_bytes(dev.cpu(), cpu, f"philox block {block}")


def test_log64_and_sincos_quadrant64_same_bytes_on_cuda():
    g = torch.Generator().manual_seed(6)
    x = torch.rand(200_000, generator=g, dtype=torch.float64) + 2.0**-53
    assert_same_bytes(sm.log64(x.cuda()).cpu(), sm.log64(x), "log64")
    q = torch.randint(0, 4, (200_000,), generator=g)
    for i in range(2):
        assert_same_bytes(sm.sincos_quadrant64(q.cuda(), x.cuda())[i].cpu(),
                          sm.sincos_quadrant64(q, x)[i], f"sincos_quadrant64[{i}]")
