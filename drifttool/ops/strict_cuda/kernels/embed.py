"""Strict CUDA elementwise kernels of the GEMM-bearing operators (contract ``cuda1``): ``silu32``
(the CPU's ``strict_math.silu32``) and ``sinusoid`` (the CPU's ``strict.embed.sinusoid``), each
byte-equal to the CPU's on the same input (FP64 exact operations of ``kernels.exact_math``,
rounded once to FP32; FMA contraction off).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from drifttool.ops.strict_cuda.kernels.exact_math import _NAN_BITS, _c, _f64_bits, _round_half_even, _silu64
from drifttool.ops.strict_math import exp32

_ELEMS = 1024  # elements per program of the elementwise kernels (no reduction: bytes unaffected)


@triton.jit
def _silu_kernel(X, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < numel
    x = tl.load(X + offs, mask=live, other=0.0).to(tl.float64)
    tl.store(Y + offs, _silu64(x).to(tl.float32), mask=live)


def silu32(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x`` in FP64 from exact operations, rounded once to FP32: the CPU's
    ``strict_math.silu32`` operation for operation (byte-equal to it on the same input).

    Args:
        x: any shape, bf16 or FP32.
    Returns:
        FP32, x's shape, on x's device.
    """
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if xc.numel():
        _silu_kernel[(triton.cdiv(xc.numel(), _ELEMS),)](xc, y, xc.numel(), BLOCK=_ELEMS,
                                                         enable_fp_fusion=False)
    return y


@triton.jit
def _sinusoid_kernel(T, F, Y, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Row b: a_k = (τ_b·f_k)·1000 in FP32; (sin, cos) by strict_math.sincos64; [cos | sin]."""
    row = tl.program_id(0)
    kk = tl.arange(0, BLOCK)
    live = kk < HALF
    tau = tl.load(T + row).to(tl.float32)
    f = tl.load(F + kk, mask=live, other=0.0)
    x = ((tau * f) * 1000.0).to(tl.float64)
    n = _round_half_even(x * _c(6.36619772367581382433e-01))
    r = ((x - n * _c(1.57079632673412561417e00)) - n * _c(6.07710050650619224932e-11)) \
        - n * _c(2.02226624879595063154e-21)
    r2 = r * r
    s = _c(1.0 / 121645100408832000.0)  # (-1)^9 / 19! with the sign below
    s = -s
    s = s * r2 + _c(1.0 / 355687428096000.0)
    s = s * r2 + _c(-1.0 / 1307674368000.0)
    s = s * r2 + _c(1.0 / 6227020800.0)
    s = s * r2 + _c(-1.0 / 39916800.0)
    s = s * r2 + _c(1.0 / 362880.0)
    s = s * r2 + _c(-1.0 / 5040.0)
    s = s * r2 + _c(1.0 / 120.0)
    s = s * r2 + _c(-1.0 / 6.0)
    s = s * r2 + _c(1.0)
    s = s * r
    c = -_c(1.0 / 6402373705728000.0)  # (-1)^9 / 18!
    c = c * r2 + _c(1.0 / 20922789888000.0)
    c = c * r2 + _c(-1.0 / 87178291200.0)
    c = c * r2 + _c(1.0 / 479001600.0)
    c = c * r2 + _c(-1.0 / 3628800.0)
    c = c * r2 + _c(1.0 / 40320.0)
    c = c * r2 + _c(-1.0 / 720.0)
    c = c * r2 + _c(1.0 / 24.0)
    c = c * r2 + _c(-1.0 / 2.0)
    c = c * r2 + _c(1.0)
    q = n.to(tl.int64) & 3  # torch.remainder(n, 4) of an integral n
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    bad = tl.abs(x) >= _c(1048576.0)  # the CPU raises for |a| >= 2^20; here: NaN
    sin = tl.where(bad, _f64_bits(_NAN_BITS), sin)
    cos = tl.where(bad, _f64_bits(_NAN_BITS), cos)
    base = Y + row.to(tl.int64) * (2 * HALF)
    tl.store(base + kk, cos.to(tl.float32), mask=live)
    tl.store(base + HALF + kk, sin.to(tl.float32), mask=live)


@functools.lru_cache(maxsize=16)
def _frequencies(half: int, device: str) -> torch.Tensor:
    """f_k = exp32(fp32(−ln 1e4)·k / half) [half] FP32, computed on the CPU by the CPU's own
    arithmetic (``strict.embed.sinusoid``) and kept on ``device`` (a constant of the model)."""
    expo = (-math.log(10000.0) * torch.arange(half, dtype=torch.float32)) / half
    return exp32(expo).to(device)


def sinusoid(tau: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Cos-first timestep sinusoid φ(τ) [B, dim] FP32, the CPU's ``strict.embed.sinusoid``
    operation for operation (frequencies from the CPU; phases in FP32; sin/cos by the FP64
    exact-op ``sincos64``, rounded once). Phases with |a| ≥ 2^20 give NaN (the CPU raises).

    Args:
        tau: [B] FP32.  dim: even channel count.
    Returns:
        [B, dim] FP32 on tau's device.
    """
    half = dim // 2
    f = _frequencies(half, str(tau.device))
    t = tau.to(torch.float32).contiguous()
    y = torch.empty((t.shape[0], 2 * half), dtype=torch.float32, device=tau.device)
    if t.shape[0]:
        _sinusoid_kernel[(t.shape[0],)](t, f, y, HALF=half, BLOCK=triton.next_power_of_2(half),
                                        enable_fp_fusion=False)
    return y
