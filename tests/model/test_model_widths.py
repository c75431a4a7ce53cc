"""Every width from the config: diffusers' unit-test transformer (16 packed channels in, 4 out)
and ``out_channels=None`` load and match diffusers' forward (issue 8, item 5a).

Same tolerances as ``test_model_parity.py``: production bf16 byte for byte, production fp32
≤ 1e-6 and strict fp32 ≤ 1e-5 relative L2.
"""

from __future__ import annotations

import pytest
import torch

from drifttool.model.checkpoint import load_checkpoint, tensor_shapes
from drifttool.model.config import from_diffusers_config
from drifttool.model.mmdit import MMDiT
from drifttool.runtime import Runtime

# diffusers 0.42.1 tests/models/transformers/test_models_transformer_qwenimage.py, get_init_dict()
UNIT_TEST = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
SHAPES = {"unit_test": UNIT_TEST, "out_channels_none": {**UNIT_TEST, "out_channels": None},
          "patch1_in20": {**UNIT_TEST, "patch_size": 1, "in_channels": 20, "out_channels": None}}


@pytest.fixture(params=list(SHAPES))
def shape(request):
    return SHAPES[request.param]


def test_shape_table_matches_diffusers_and_mmdit(shape):
    from diffusers import QwenImageTransformer2DModel

    cfg = from_diffusers_config(dict(shape))
    with torch.device("meta"):
        ref = {k: tuple(v.shape) for k, v in QwenImageTransformer2DModel(**shape).state_dict().items()}
        ours = {k: tuple(v.shape) for k, v in MMDiT(cfg).state_dict().items()}
    assert tensor_shapes(cfg) == ref == ours


def _inputs(shape, batch=2, grid=(4, 3), L=5):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(batch, grid[0] * grid[1], shape["in_channels"], generator=g)  # [B, N, in_channels]
    txt = torch.randn(batch, L, shape["joint_attention_dim"], generator=g)  # [B, L, Dj]
    mask = torch.arange(L)[None, :] < torch.tensor([L, 3])[:, None]  # [B, L] bool
    tau = torch.tensor([0.9, 0.25])
    return x, txt, mask, tau, grid


def _pair(diffusers_folder, shape, dtype):
    from diffusers import QwenImageTransformer2DModel

    _, folder = diffusers_folder(seed=5, **shape)
    ref = QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=dtype).eval()
    return ref, load_checkpoint(folder, dtype=dtype)


def _forwards(ref, ours, shape, dtype, mode):
    x, txt, mask, tau, grid = _inputs(shape)
    with torch.no_grad():
        want = ref(hidden_states=x.to(dtype), encoder_hidden_states=txt.to(dtype), encoder_hidden_states_mask=mask,
                   timestep=tau, img_shapes=[(1, *grid)] * x.shape[0], return_dict=False)[0]
        got = ours(x.to(dtype), txt.to(dtype), mask, tau, grid, Runtime(mode=mode))
    p = shape["patch_size"]
    out = p * p * (shape["out_channels"] or shape["in_channels"])
    assert got.shape == want.shape == (x.shape[0], x.shape[1], out)
    return got, want


def test_production_bf16_byte_parity(diffusers_folder, shape):
    got, want = _forwards(*_pair(diffusers_folder, shape, torch.bfloat16), shape, torch.bfloat16, "auto")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("mode, tol", [("off", 1e-6), ("strict", 1e-5)])
def test_fp32_parity(diffusers_folder, shape, mode, tol):
    got, want = _forwards(*_pair(diffusers_folder, shape, torch.float32), shape, torch.float32, mode)
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel <= tol
