"""Strict AdaLN operators: adaln_mod_projection, adaln_modulation, adaln_gate_residual,
final_adaln_out (numerics §2.3, §2 step 8).

LayerNorm order: mean = tree_mean(x); xc = x − mean; var = tree_mean(xc²) (biased);
rstd = 1/sqrt(var + eps) in FP64 rounded to FP32; y = xc·rstd; then y·(1 + scale) + shift in FP32.
"""

from __future__ import annotations

import torch

from drifttool.ops.registry import implements
from drifttool.ops.strict._checks import check, f32, out
from drifttool.ops.strict_math import LINEAR_KERNEL, rsqrt64, silu32, tiled_linear, tree_mean

LN_KERNEL = "cpu.tree_layernorm"


def layer_norm(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free LayerNorm over the last axis, FP32 in and out (order in module doc)."""
    mean = tree_mean(xf)
    xc = xf - mean.unsqueeze(-1)
    var = tree_mean(xc * xc)
    rstd = rsqrt64(var.double() + eps).to(torch.float32)
    return xc * rstd.unsqueeze(-1)


def _silu_linear(temb, w, b) -> torch.Tensor:
    s = silu32(f32(temb))
    return tiled_linear(s, f32(w), f32(b))


@implements("adaln_mod_projection", "strict", kernel="cpu.silu_f64+" + LINEAR_KERNEL)
def adaln_mod_projection(temb, w, b):
    """img_mod / txt_mod: SiLU(temb)·wᵀ + b, temb [B,d] → [B,6d], chunks
    [shift1, scale1, gate1, shift2, scale2, gate2]."""
    dt = check("adaln_mod_projection", temb, w, b)
    return out(_silu_linear(temb, w, b), dt)


@implements("adaln_modulation", "strict", kernel=LN_KERNEL)
def adaln_modulation(x, shift, scale, eps: float = 1e-6):
    """LN(x)·(1 + scale) + shift; x [B,S,d], shift/scale [B,d] → [B,S,d]."""
    dt = check("adaln_modulation", x, shift, scale)
    y = layer_norm(f32(x), eps)
    y = y * (1.0 + f32(scale)).unsqueeze(1) + f32(shift).unsqueeze(1)
    return out(y, dt)


@implements("adaln_gate_residual", "strict", kernel="cpu.elementwise")
def adaln_gate_residual(x, gate, y):
    """x + gate·y in FP32, one cast; x, y [B,S,d], gate [B,d]."""
    dt = check("adaln_gate_residual", x, gate, y)
    return out(f32(x) + f32(gate).unsqueeze(1) * f32(y), dt)


@implements("final_adaln_out", "strict", kernel=LN_KERNEL + "+" + LINEAR_KERNEL)
def final_adaln_out(x, temb, w, b, eps: float = 1e-6):
    """norm_out: (scale, shift) = split(SiLU(temb)·wᵀ + b) — scale first (numerics trap 5);
    LN(x)·(1 + scale) + shift; x [B,N,d], temb [B,d] → [B,N,d]."""
    dt = check("final_adaln_out", x, temb, w, b)
    emb = _silu_linear(temb, w, b)  # [B,2d]
    scale, shift = emb.chunk(2, dim=-1)
    y = layer_norm(f32(x), eps) * (1.0 + scale).unsqueeze(1) + shift.unsqueeze(1)
    return out(y, dt)
