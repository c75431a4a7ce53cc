"""Inputs and reference formulas shared by the strict CUDA kernels' interpreter suite
(``tests/ops/strict_cuda``) and their GPU suite (``tests/gpu/test_strict_cuda_*.py``). Plain torch;
imports no Triton and nothing under test."""

from __future__ import annotations

import dataclasses
import math

import torch


def _exp_f32_order(z: torch.Tensor) -> torch.Tensor:
    """``kernels.exact_math``'s FP32 exp (Cody–Waite, degree-7 Horner) by torch FP32 operations."""
    def f(v):
        return torch.tensor(v, dtype=torch.float32, device=z.device)

    zc = torch.where(z != z, f(0.0), z).clamp(-87.0, 88.0)
    k = ((zc * f(1.4426950408889634)) + f(12582912.0)) - f(12582912.0)
    r = (zc - k * f(0.693145751953125)) - k * f(1.428606765330187e-06)
    p = f(1.0 / 5040.0)
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + f(c)
    e = p * ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    e = torch.where(z > 88.0, f(math.inf), torch.where(z < -87.0, f(0.0), e))
    return torch.where(z != z, z, e)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def gelu_tanh_f32_order(x: torch.Tensor) -> torch.Tensor:
    """The FP32 GELU epilogue's stated formula (``kernels.exact_math``'s FP32 GELU) by torch FP32
    operations, each rounded, on ``x``'s device."""
    u = _f32(0.7978845608028654, x) * (x + _f32(0.044715, x) * ((x * x) * x))
    return x / (_f32(1.0, x) + _exp_f32_order(_f32(-2.0, x) * u))


def gelu_tanh_f32_grad_order(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g·GELU'(x) of the FP32 GELU, the stated order of ``kernels.gemm_backward``'s GELU
    derivative, by torch FP32 operations (FP32 result)."""
    c0 = _f32(0.7978845608028654, x)
    u = c0 * (x + _f32(0.044715, x) * ((x * x) * x))
    s = _f32(1.0, x) / (_f32(1.0, x) + _exp_f32_order(_f32(-2.0, x) * u))
    du = c0 * (_f32(1.0, x) + _f32(3 * 0.044715, x) * (x * x))
    return g.to(torch.float32) * (s + x * ((s * (_f32(1.0, x) - s)) * (_f32(2.0, x) * du)))


def rn(*shape, scale=1.0, seed=0, dtype=torch.bfloat16, device="cuda"):
    """Standard normals × ``scale`` drawn on the CPU (the same values on every device), cast, moved."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def lin(n, k, seed, dtype=torch.bfloat16, device="cuda"):
    """A linear layer's weight [n, k] (std 1/√k) and bias [n] (std 0.1), as ``rn`` draws them."""
    return rn(n, k, scale=1 / math.sqrt(k), seed=seed, dtype=dtype, device=device), \
        rn(n, scale=0.1, seed=seed + 1, dtype=dtype, device=device)


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


def segment_order(gb, dy: torch.Tensor, x: torch.Tensor, live: list[int]) -> torch.Tensor:
    """The contract's segmented weight gradient rebuilt from its parts: per sample, each
    ``gb.SEG_ROWS``-row segment of its live rows run alone as a one-sample, one-segment launch,
    the segments' partials then added in ascending order from +0 in FP32 (torch). ``gb``: the
    kernels module (imported by the caller, compiled or interpreted). → [B, N, K] FP32."""
    n, k = dy.shape[2], x.shape[2]
    one = dataclasses.replace(gb.wgrad_config(n, k, True), seg_rows=None)
    out = []
    for b, rows in enumerate(live):
        acc = torch.zeros(n, k, dtype=torch.float32, device=dy.device)
        for s0 in range(0, rows, gb.SEG_ROWS):
            s1 = min(rows, s0 + gb.SEG_ROWS)
            seg = gb.weight_grad_parts(dy[b:b + 1, s0:s1], x[b:b + 1, s0:s1],
                                       torch.tensor([s1 - s0], device=dy.device), config=one)
            acc = acc + seg[0]
        out.append(acc)
    return torch.stack(out)
