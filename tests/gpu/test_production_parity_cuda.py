"""Issue #10 item 3: drifttool's production backend is byte-equal to diffusers' forward on the GPU,
at the RFC's reference shapes, with padded prompts, batch 1 and 3 (two full-width blocks: the
arithmetic per block does not depend on the depth). A failure names the first drifting operator."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("diffusers")

from tests.gpu import parity  # noqa: E402

SHAPES = {"1024x1024": (64, 64), "1328x1328": (83, 83), "1664x928": (58, 104)}


@pytest.fixture(scope="module")
def models():
    tr = parity.diffusers_transformer(2, "cuda", seed=10)
    return tr, parity.ours_from(tr)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch,slots,lens", [(1, 128, [97]), (3, 160, [13, 160, 101])],
                         ids=["b1-padded", "b3-padded"])
def test_production_equals_diffusers_on_cuda(models, shape, batch, slots, lens):
    tr, ours = models
    grid = SHAPES[shape]
    x, txt, mask, tau = parity.inputs(batch, grid, slots, lens, "cuda", seed=batch)
    v_d, v_o, rd, ro, kernels = parity.both(tr, ours, x, txt, mask, tau, grid, lens)
    where = parity.first_difference(rd, ro)
    assert where is None and torch.equal(v_d.view(torch.int16), v_o.view(torch.int16)), \
        f"{where}; diffusers attention kernels {kernels}"
