"""Triton kernels of the strict CUDA elementwise row operators (contract ``cuda1``): the gate
residual ``x + gate·y`` and the interleaved-pair RoPE rotation, each product rounded before its
sum (``kernels.rows``' conventions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drifttool.ops.strict_cuda.kernels.rows import ELEMENTS, _launch


@triton.jit
def _gate_residual_kernel(x_ptr, g_ptr, y_ptr, o_ptr, total, S, D, BLOCK: tl.constexpr):
    """o = x + gate[b]·y, FP32, the product rounded before the sum."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    b = o // (S * D)
    x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + o, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * D + o % D, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + o, (x + g * y).to(o_ptr.dtype.element_ty), mask=m)


def gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x + gate·y: x, y [B,S,d], gate [B,d] → [B,S,d] ``out_dtype``."""
    x, gate, y = x.contiguous(), gate.contiguous(), y.contiguous()
    bsz, s, d = x.shape
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = o.numel()
    if total:
        _launch(_gate_residual_kernel, (triton.cdiv(total, ELEMENTS),), x, gate, y, o, total, s, d,
                BLOCK=ELEMENTS)
    return o


@triton.jit
def _rope_kernel(x_ptr, f_ptr, o_ptr, pairs, S, HP, P2, BLOCK: tl.constexpr):
    """Pair p = (b, s, h, j): (x0, x1) = x[2p], x[2p+1]; (c, s) = freqs[s, j];
    y0 = x0·c − x1·s, y1 = x0·s + x1·c (each product rounded)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < pairs
    j = p % P2
    pos = (p // HP) % S
    x0 = tl.load(x_ptr + 2 * p, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + 2 * p + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(f_ptr + (pos * P2 + j) * 2, mask=m, other=0.0)
    s = tl.load(f_ptr + (pos * P2 + j) * 2 + 1, mask=m, other=0.0)
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    tl.store(o_ptr + 2 * p, y0.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(o_ptr + 2 * p + 1, y1.to(o_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation: x [B,S,H,Dh], freqs [S,Dh/2] complex64 → x's shape and dtype."""
    x = x.contiguous()
    f = torch.view_as_real(freqs.to(device=x.device, dtype=torch.complex64).contiguous()).contiguous()
    _, s, h, dh = x.shape
    o = torch.empty_like(x)
    pairs = x.numel() // 2
    if pairs:
        _launch(_rope_kernel, (triton.cdiv(pairs, ELEMENTS),), x, f, o, pairs, s, h * (dh // 2), dh // 2,
                BLOCK=ELEMENTS)
    return o
