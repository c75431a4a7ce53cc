"""A random full-width Qwen-Image transformer built on the device (shared by the GPU benchmarks).

    tr, ours = build(60, "cuda")      # diffusers' QwenImageTransformer2DModel and drifttool's MMDiT

Weights are bf16, drawn directly on the device (std 0.02; biases 0; RMSNorm gains N(1, 0.1)),
and shared by both models (same storage). diffusers' RoPE tables are rebuilt on the CPU after the
meta-device construction, as ``from_pretrained`` builds them (see tests/gpu/parity.py).
"""

from __future__ import annotations

import torch

from drifttool.model.config import from_diffusers_config
from drifttool.model.mmdit import MMDiT

FULL_WIDTH = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


def build(layers: int, device: str, seed: int = 0):
    """``(diffusers transformer, drifttool MMDiT)`` with ``layers`` blocks on ``device``."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            tr = QwenImageTransformer2DModel(num_layers=layers, **FULL_WIDTH)
    finally:
        torch.set_default_dtype(old)
    tr = tr.to_empty(device=device).eval()
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1) if "norm" in name else p.zero_()
            else:
                p.normal_(0.0, 0.02)
    tr.pos_embed = type(tr.pos_embed)(theta=10000, axes_dim=list(FULL_WIDTH["axes_dims_rope"]),
                                      scale_rope=True)
    with torch.device("meta"):
        ours = MMDiT(from_diffusers_config(dict(tr.config)), dtype=torch.bfloat16)
    ours.load_state_dict(dict(tr.state_dict()), strict=True, assign=True)
    return tr, ours
