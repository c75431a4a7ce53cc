"""Inputs and reference formulas shared by the strict CUDA kernels' interpreter suite
(``tests/ops/strict_cuda``) and their GPU suite (``tests/gpu/test_strict_cuda_*.py``). Plain torch;
imports no Triton and nothing under test."""

from __future__ import annotations

import math

import torch


def gelu_tanh_f32_order(x: torch.Tensor) -> torch.Tensor:
    """The FP32 GELU epilogue's stated formula (``kernels.exact_math``'s FP32 GELU) by torch FP32
    operations, each rounded, on ``x``'s device."""
    def f(v):
        return torch.tensor(v, dtype=torch.float32, device=x.device)

    u = f(0.7978845608028654) * (x + f(0.044715) * ((x * x) * x))
    z = f(-2.0) * u
    zc = torch.where(z != z, f(0.0), z).clamp(-87.0, 88.0)
    k = ((zc * f(1.4426950408889634)) + f(12582912.0)) - f(12582912.0)
    r = (zc - k * f(0.693145751953125)) - k * f(1.428606765330187e-06)
    p = f(1.0 / 5040.0)
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + f(c)
    e = p * ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    e = torch.where(z > 88.0, f(math.inf), torch.where(z < -87.0, f(0.0), e))
    return x / (f(1.0) + torch.where(z != z, z, e))


def joint(lens, text_len, n_img, heads, dh, dtype=torch.float32, seed=0, device="cpu", nan_pads=False):
    """q, k, v [B, L+N, H, Dh] and the joint key mask [valid text prefix, image ones]; drawn on the
    CPU (same values on every device); NaN in every masked K/V slot when ``nan_pads``."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lens), text_len + n_img
    q, k, v = (torch.randn(b, s, heads, dh, generator=g) * sc for sc in (1.5, 1.5, 1.0))
    km = torch.ones(b, s, dtype=torch.bool)
    for i, n in enumerate(lens):
        km[i, n:text_len] = False
    if nan_pads:
        k = k.masked_fill(~km[:, :, None, None], float("nan"))
        v = v.masked_fill(~km[:, :, None, None], float("nan"))
    q, k, v = (t.to(dtype).to(device) for t in (q, k, v))
    return q, k, v, km.to(device)
