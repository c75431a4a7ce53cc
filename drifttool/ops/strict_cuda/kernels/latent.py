"""Triton kernels of the strict CUDA latent operators (contract ``cuda1``): ``pack`` / ``unpack``
(pure copies) and ``normalize`` (per channel, one IEEE FP32 operation per step, as
``strict.latent``), under ``kernels.rows``' conventions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drifttool.ops.strict_cuda.kernels.rows import ELEMENTS, _launch


@triton.jit
def _pack_kernel(z_ptr, o_ptr, total, C, h, w, BLOCK: tl.constexpr):
    """o[b, i·w + j, c·4 + dy·2 + dx] = z[b, c, 2i + dy, 2j + dx] (a pure copy)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    c4 = 4 * C
    n = (o // c4) % (h * w)
    b = o // (c4 * h * w)
    ch = o % c4
    i = n // w
    j = n % w
    src = ((b * C + ch // 4) * (2 * h) + 2 * i + (ch // 2) % 2) * (2 * w) + 2 * j + ch % 2
    tl.store(o_ptr + o, tl.load(z_ptr + src, mask=m), mask=m)


@triton.jit
def _unpack_kernel(x_ptr, o_ptr, total, C, h, w, BLOCK: tl.constexpr):
    """o[b, c, 0, 2i + dy, 2j + dx] = x[b, i·w + j, c·4 + dy·2 + dx] (a pure copy)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    xx = o % (2 * w)
    yy = (o // (2 * w)) % (2 * h)
    c = (o // (4 * h * w)) % C
    b = o // (4 * h * w * C)
    src = (b * (h * w) + (yy // 2) * w + xx // 2) * (4 * C) + c * 4 + (yy % 2) * 2 + xx % 2
    tl.store(o_ptr + o, tl.load(x_ptr + src, mask=m), mask=m)


def pack(z: torch.Tensor) -> torch.Tensor:
    """[B,C,H',W'] (even H', W'; shape checked by the caller) → [B,(H'/2)(W'/2),4C], same dtype
    and bytes as ``strict.latent.pack``."""
    z = z.contiguous()
    b, c, hh, ww = z.shape
    h, w = hh // 2, ww // 2
    o = torch.empty(b, h * w, 4 * c, dtype=z.dtype, device=z.device)
    total = o.numel()
    if total:
        _launch(_pack_kernel, (triton.cdiv(total, ELEMENTS),), z, o, total, c, h, w, BLOCK=ELEMENTS)
    return o


def unpack(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[B,h·w,4C] → [B,C,1,2h,2w] (shape checked by the caller), the exact inverse of ``pack``."""
    x = x.contiguous()
    b, _, c4 = x.shape
    h, w = grid
    o = torch.empty(b, c4 // 4, 1, 2 * h, 2 * w, dtype=x.dtype, device=x.device)
    total = o.numel()
    if total:
        _launch(_unpack_kernel, (triton.cdiv(total, ELEMENTS),), x, o, total, c4 // 4, h, w, BLOCK=ELEMENTS)
    return o


@triton.jit
def _normalize_kernel(z_ptr, mean_ptr, std_ptr, o_ptr, total, C, inner, INVERSE: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Per channel c = (flat ÷ inner) mod C: std_inv = 1 ÷ std (FP32); forward (z − mean)·std_inv,
    inverse z ÷ std_inv + mean."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    ch = (o // inner) % C
    z = tl.load(z_ptr + o, mask=m, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + ch, mask=m, other=0.0)
    std = tl.load(std_ptr + ch, mask=m, other=1.0)
    std_inv = tl.div_rn(tl.full(std.shape, 1.0, tl.float32), std)
    if INVERSE:
        y = tl.div_rn(z, std_inv) + mean
    else:
        y = (z - mean) * std_inv
    tl.store(o_ptr + o, y.to(o_ptr.dtype.element_ty), mask=m)


def normalize(z: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``strict.latent.latent_normalize``'s forward: z [B,C,...] (FP32/BF16), mean/std [C] (taken
    as FP32) → z's shape and dtype."""
    z = z.contiguous()
    mean = mean.to(device=z.device, dtype=torch.float32).contiguous()
    std = std.to(device=z.device, dtype=torch.float32).contiguous()
    o = torch.empty_like(z)
    total = z.numel()
    if total:
        inner = z[0, 0].numel()
        _launch(_normalize_kernel, (triton.cdiv(total, ELEMENTS),), z, mean, std, o, total, z.shape[1],
                inner, INVERSE=bool(inverse), BLOCK=ELEMENTS)
    return o
