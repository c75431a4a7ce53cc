"""Strict input embeddings: txt_in_rmsnorm_linear, timestep_embed_mlp (numerics §2 steps 3, 5).
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implements
from drifttool.ops.strict._checks import check, f32, out
from drifttool.ops.strict_math import (
    LINEAR_KERNEL, exp32, rsqrt64, silu32, sincos64, tiled_linear, tree_mean,
)


def rms_normalize(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) over the last axis, FP32 in and out.

    mean(x²): pairwise ``tree_mean``; ``+ eps``, sqrt and reciprocal in FP64, rounded once to FP32.
    """
    var = tree_mean(xf * xf)  # [...]
    rstd = rsqrt64(var.double() + eps).to(torch.float32)
    return xf * rstd.unsqueeze(-1)


@implements("txt_in_rmsnorm_linear", "strict", kernel="cpu.tree_rmsnorm+" + LINEAR_KERNEL)
def txt_in_rmsnorm_linear(e, gain, w, b, eps: float = 1e-6):
    """txt_in(RMSNorm_3584(e)): e [B,L,Dj] → [B,L,d]. FP32 seam between norm and linear, one cast.

    Raises UnsupportedConfigError for an unsupported device or dtype.
    """
    dt = check("txt_in_rmsnorm_linear", e, gain, w, b)
    y = rms_normalize(f32(e), eps) * f32(gain)  # [B,L,Dj] fp32
    return out(tiled_linear(y, f32(w), f32(b)), dt)


def sinusoid(tau: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Cos-first timestep sinusoid φ(τ) [B, dim] FP32 (numerics §2.1).

    f_k = exp(−ln(10000)·k/half) (exponent in FP32, exp from exact ops, rounded to FP32);
    a_k = (τ·f_k)·1000 in FP32 — product first, then ×1000; cos and sin from exact ops in FP64,
    rounded to FP32.
    """
    half = dim // 2
    expo = (-math.log(10000.0) * torch.arange(half, dtype=torch.float32)) / half
    freqs = exp32(expo)  # [half]
    a = (tau.to(torch.float32)[:, None] * freqs[None, :]) * 1000.0  # [B, half]
    sin, cos = sincos64(a)
    return torch.cat([cos, sin], dim=-1).to(torch.float32)  # [B, dim]


@implements("timestep_embed_mlp", "strict", kernel="cpu.sincos_f64+" + LINEAR_KERNEL)
def timestep_embed_mlp(tau, w1, b1, w2, b2):
    """temb = linear_2(SiLU(linear_1(φ(τ)))): tau [B] fp32 → [B,d] in the weights' dtype.

    Unlike diffusers (which rounds φ and τ to the model dtype), strict keeps FP32 throughout and
    casts once at the output (RFC cast policy).
    """
    dt = check("timestep_embed_mlp", w1, b1, w2, b2)
    if tau.dtype != torch.float32:
        raise UnsupportedConfigError(f"timestep_embed_mlp: tau must be float32, got {tau.dtype}")
    phi = sinusoid(tau, w1.shape[1])  # [B,256]
    h = silu32(tiled_linear(phi, f32(w1), f32(b1)))  # [B,d]
    return out(tiled_linear(h, f32(w2), f32(b2)), dt)
