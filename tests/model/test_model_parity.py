"""MMDiT vs diffusers' QwenImageTransformer2DModel on small random models (numerics §2, §2.6).

- production backend (``Runtime(mode="auto")``), bf16: byte for byte;
- production backend, fp32: ≤ 1e-6 relative L2 (in practice byte-equal too);
- strict backend, fp32: ≤ 1e-5 relative L2.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from drifttool.model.checkpoint import load_checkpoint
from drifttool.runtime import Runtime

try:
    importlib.import_module("drifttool.ops.strict")
    STRICT_SKIP = ""
except ImportError as e:  # pragma: no cover - only while the strict backends are being written
    STRICT_SKIP = f"drifttool.ops.strict is not importable yet ({e})"

# (id, diffusers shape kwargs, batch, (h, w), L, valid lengths per row or None for no mask)
CASES = [
    ("tiny_4x6_b3_masked", dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                joint_attention_dim=32, axes_dims_rope=(4, 6, 6)), 3, (4, 6), 7, [7, 5, 2]),
    ("tiny_5x3_b1_nomask", dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                joint_attention_dim=32, axes_dims_rope=(4, 6, 6)), 1, (5, 3), 5, None),
    ("h3_5x3_b3_oddL", dict(num_layers=1, attention_head_dim=16, num_attention_heads=3,
                            joint_attention_dim=48, axes_dims_rope=(4, 6, 6)), 3, (5, 3), 9, [9, 1, 4]),
    ("dh32_3x2_b2", dict(num_layers=3, attention_head_dim=32, num_attention_heads=2,
                         joint_attention_dim=24, axes_dims_rope=(8, 12, 12)), 2, (3, 2), 4, [4, 3]),
    ("tiny_2x7_b1_allones_mask", dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                      joint_attention_dim=32, axes_dims_rope=(4, 6, 6)), 1, (2, 7), 3, [3]),
]


def _inputs(seed, shape, batch, grid, L, lens):
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    x = torch.randn(batch, h * w, 64, generator=g)
    txt = torch.randn(batch, L, shape["joint_attention_dim"], generator=g)
    mask = None
    if lens is not None:
        mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]  # [B, L] bool, right padding
    # sigmas across the trajectory, including the endpoints of the Qwen-Image schedule
    tau = torch.tensor([1.0, 0.5123, 0.019999980926513672, 0.7777])[:batch].clone()
    if batch > 4:  # pragma: no cover
        tau = torch.rand(batch, generator=g)
    return x, txt, mask, tau


def _diffusers_forward(model, x, txt, mask, tau, grid, dtype):
    with torch.no_grad():
        return model(hidden_states=x.to(dtype), encoder_hidden_states=txt.to(dtype),
                     encoder_hidden_states_mask=mask, timestep=tau,
                     img_shapes=[(1, *grid)] * x.shape[0], return_dict=False)[0]


def _ours(folder, x, txt, mask, tau, grid, dtype, mode):
    model = load_checkpoint(folder, dtype=dtype)
    with torch.no_grad():
        return model(x.to(dtype), txt.to(dtype), mask, tau, grid, Runtime(mode=mode))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request, diffusers_folder):
    name, shape, batch, grid, L, lens = request.param
    seed = CASES.index(request.param)
    ref, folder = diffusers_folder(seed=seed, patch_size=2, in_channels=64, out_channels=16, **shape)
    return ref, folder, _inputs(seed, shape, batch, grid, L, lens), grid


def test_production_bf16_byte_parity(case):
    from diffusers import QwenImageTransformer2DModel

    _, folder, (x, txt, mask, tau), grid = case
    ref_model = QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    ref = _diffusers_forward(ref_model, x, txt, mask, tau, grid, torch.bfloat16)
    out = _ours(folder, x, txt, mask, tau, grid, torch.bfloat16, "auto")
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    diff = (out.view(torch.int16) != ref.view(torch.int16)).sum().item()
    assert diff == 0, f"{diff} of {out.numel()} bf16 values differ (max abs {(out.float() - ref.float()).abs().max()})"


def test_production_fp32_parity(case):
    ref_model, folder, (x, txt, mask, tau), grid = case
    ref = _diffusers_forward(ref_model, x, txt, mask, tau, grid, torch.float32)
    out = _ours(folder, x, txt, mask, tau, grid, torch.float32, "off")
    assert _rel(out, ref) <= 1e-6


@pytest.mark.skipif(bool(STRICT_SKIP), reason=STRICT_SKIP or "strict backends available")
def test_strict_fp32_parity(case):
    ref_model, folder, (x, txt, mask, tau), grid = case
    ref = _diffusers_forward(ref_model, x, txt, mask, tau, grid, torch.float32)
    out = _ours(folder, x, txt, mask, tau, grid, torch.float32, "strict")
    assert _rel(out, ref) <= 1e-5


def test_mask_none_equals_all_ones_mask(diffusers_folder):
    """§5.11: an all-ones mask and no mask give the same image output (production, fp32)."""
    _, folder = diffusers_folder(seed=7, patch_size=2, in_channels=64, out_channels=16, **CASES[0][1])
    x, txt, _, tau = _inputs(7, CASES[0][1], 2, (4, 6), 5, None)
    ones = torch.ones(2, 5, dtype=torch.bool)
    a = _ours(folder, x, txt, None, tau, (4, 6), torch.float32, "auto")
    b = _ours(folder, x, txt, ones, tau, (4, 6), torch.float32, "auto")
    assert _rel(a, b) < 1e-6
