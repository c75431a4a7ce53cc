"""Strict arithmetic primitives: fixed reduction trees and exact-op transcendentals.

Why these exist (measured on the 2-core CI CPU, see docs/strict-arithmetic.md):

* ``F.linear`` / ``torch.matmul`` are not row-invariant (a row's bytes at M=1 differ from M≥2):
  the strict GEMMs, tile by tile in fixed shapes with K reduced in the segmented order of
  contract v2, live in ``drifttool.ops.strict_gemm``.
* ``torch.sum`` may pick its reduction order from the tensor size and thread count. Reductions
  here are explicit pairwise trees of elementwise adds (IEEE-exact, so the same bytes whatever
  the vectorisation or threading).
* ``torch.exp``/``tanh``/``sin`` use SIMD (Sleef) code for the body of a buffer and libm for its
  tail, which can differ by an ULP — a row's bytes would depend on where it sits in the batch.
  The transcendentals here are built only from +, −, ×, ÷, round and exact power-of-two scaling,
  evaluated in FP64 and rounded once to FP32; each of those is correctly rounded in both SIMD and
  scalar code, so the result depends on the input value alone.

All functions take and return FP32 (FP64 internally where stated). Nothing here reads global
state; no TF32 (checked by ``drifttool.runtime.check_strict_environment``).
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.strict_trees import (  # noqa: F401  (the trees are re-exported here)
    CHUNK,
    TreeAccumulator,
    local_spans,
    segment_spans,
    segmented_sum,
    shard_spans,
    tree_finish,
    tree_mean,
    tree_sum,
    tree_sum_stack,
)


# ----------------------------------------------------------------------------- transcendentals
# FP64 evaluation from exact operations only; callers round once to FP32.

_LN2_HI = 6.93147180369123816490e-01  # 32 significant bits: k * _LN2_HI is exact for |k| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_COEF = [1.0 / math.factorial(i) for i in range(11)]  # Taylor on |r| <= ln2/2: rel. err < 3e-13


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k for integer-valued FP64 ``k`` in [-1022, 1023], built from its exponent bits (exact)."""
    bits = (k.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in FP64 from exact operations (Cody–Waite reduction, degree-10 Taylor).

    Relative error < 3e-13 (about 1/200000 of an FP32 ULP): ample for one rounding to FP32. ``-inf`` → 0, ``+inf`` → inf,
    NaN → NaN (payload of the input kept).
    """
    x = x.to(torch.float64)
    xc = torch.clamp(torch.nan_to_num(x, nan=0.0), -700.0, 700.0)
    k = torch.round(xc * _INV_LN2)
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        p = p * r + c
    y = p * _pow2(k)
    y = torch.where(x > 700.0, torch.full_like(y, math.inf), y)
    y = torch.where(x < -700.0, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


_LOG_COEF = [1.0 / (2 * i + 1) for i in range(12)]  # atanh series: 2s·Σ s^2i/(2i+1), |s| ≤ 0.1716
_SQRT2 = 1.41421356237309514547e00
_TWO54 = 18014398509481984.0  # 2^54: lifts subnormals into the normal range (exact scaling)


def log64(x: torch.Tensor) -> torch.Tensor:
    """ln(x) in FP64 from exact operations: exponent/mantissa split from the bits, then
    ln m = 2·atanh(s), s = (m − 1)/(m + 1), on m ∈ [√2/2, √2) (12-term odd series, truncation
    < 1e-18), recombined as (k·ln2_hi + (k·ln2_lo + ln m)) with k·ln2_hi exact.

    Relative error below 1e-15 (a few FP64 ULPs): the bytes depend on the input value alone,
    never on the SIMD dispatch (no torch/numpy transcendental is used). ``0`` → ``-inf``,
    negative → NaN, ``+inf`` → ``inf``, NaN → NaN.

    Args:
        x: tensor of any floating dtype (upcast to FP64). Returns FP64 of the same shape.
    """
    x = x.to(torch.float64)
    ok = torch.isfinite(x) & (x > 0)
    xs = torch.where(ok, x, torch.ones_like(x))
    tiny = xs < 2.2250738585072014e-308  # subnormal: scale by 2^54 first
    xs = torch.where(tiny, xs * _TWO54, xs)
    bits = xs.view(torch.int64)
    k = (bits >> 52) - 1023 - torch.where(tiny, 54, 0)  # unbiased exponent
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # mantissa in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)  # exact
    k = (k + big.to(torch.int64)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)  # m − 1 is exact (Sterbenz)
    s2 = s * s
    p = torch.full_like(s, _LOG_COEF[-1])
    for c in reversed(_LOG_COEF[:-1]):
        p = p * s2 + c
    y = k * _LN2_HI + (k * _LN2_LO + 2.0 * s * p)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, x, y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, math.nan), y)


def silu64(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x) = x / (1 + exp(−x)) in FP64 (exact-op ``exp64``)."""
    x = x.to(torch.float64)
    return x / (1.0 + exp64(-x))


def tanh64(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = sign(x)·(1 − 2/(exp(2|x|) + 1)) in FP64 (exact-op ``exp64``)."""
    x = x.to(torch.float64)
    a = torch.abs(x)
    t = 1.0 - 2.0 / (exp64(2.0 * a) + 1.0)
    return torch.where(x < 0, -t, t)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximate GELU ½x(1 + tanh(√(2/π)(x + 0.044715x³))) in FP64 (numerics §2.3)."""
    x = x.to(torch.float64)
    inner = _GELU_C * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + tanh64(inner))


_PIO2_1 = 1.57079632673412561417e00  # first 33 bits of pi/2
_PIO2_2 = 6.07710050650619224932e-11  # next 33 bits
_PIO2_3 = 2.02226624879595063154e-21
_INV_PIO2 = 6.36619772367581382433e-01
_SIN_COEF = [(-1) ** i / math.factorial(2 * i + 1) for i in range(10)]
_COS_COEF = [(-1) ** i / math.factorial(2 * i) for i in range(10)]


def _taylor_sincos(r: torch.Tensor, sin_coef: list[float], cos_coef: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin r, cos r) in FP64 by Horner's rule on r² (coefficients lowest order first)."""
    r2 = r * r
    s = torch.full_like(r, sin_coef[-1])
    for c in reversed(sin_coef[:-1]):
        s = s * r2 + c
    s = s * r
    c_ = torch.full_like(r, cos_coef[-1])
    for c in reversed(cos_coef[:-1]):
        c_ = c_ * r2 + c
    return s, c_


def _rotate_quadrant(q: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of r + q·π/2 from (sin r, cos r), q in {0, 1, 2, 3}: exact sign/swap."""
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in FP64 from exact operations: three-part Cody–Waite reduction by π/2
    (exact products for |x| < 2^20), Taylor polynomials on |r| ≤ π/4, quadrant selection.

    Valid for |x| < 2^20 (timestep phases are at most 1000, RoPE angles at most 4096); larger
    |x| raises ValueError.
    """
    x = x.to(torch.float64)
    if x.numel() and torch.nan_to_num(torch.abs(x)).max().item() >= 2.0**20:
        raise ValueError("sincos64 supports |x| < 2^20")
    n = torch.round(x * _INV_PIO2)
    r = ((x - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3
    return _rotate_quadrant(torch.remainder(n, 4.0), *_taylor_sincos(r, _SIN_COEF, _COS_COEF))


_HALF_PI = 1.57079632679489655800e00  # fl64(π/2)
_SIN_COEF_Q = [(-1) ** i / math.factorial(2 * i + 1) for i in range(13)]  # |r| < π/2: < 1e-19
_COS_COEF_Q = [(-1) ** i / math.factorial(2 * i) for i in range(13)]


def sincos_quadrant64(q: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin θ, cos θ) in FP64 for θ = (π/2)·(q + f), given exactly as an integer quadrant and a
    fraction: no argument reduction, no rounding (``torch.round`` wakes the thread pool on
    every call). r = fl64(fl64(π/2)·f); sin r, cos r by 13-term Taylor polynomials on
    [0, π/2) (truncation < 1e-19); the quadrant rotates them exactly.

    Args:
        q: int64, values in {0, 1, 2, 3}.  f: FP64 in [0, 1), same shape.
    Returns:
        (sin, cos), FP64 of that shape; absolute error a few FP64 ULPs.
    """
    r = _HALF_PI * f.to(torch.float64)
    return _rotate_quadrant(q, *_taylor_sincos(r, _SIN_COEF_Q, _COS_COEF_Q))


def sqrt32(v: torch.Tensor) -> torch.Tensor:
    """sqrt in FP64, rounded once to FP32.

    Measured: FP32 ``torch.sqrt`` gave different bytes on an Intel Xeon (torch 2.11) and an AMD
    EPYC (torch 2.13) for the same inputs. Some SIMD builds are not correctly rounded. A FP64
    square root that is off by one FP64 ULP changes the FP32 result only when it straddles an
    FP32 rounding boundary (p ≈ 2^-29 per element).
    """
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def rsqrt64(v: torch.Tensor) -> torch.Tensor:
    """1/sqrt(v) in FP64 (sqrt and division are correctly rounded)."""
    return 1.0 / torch.sqrt(v.to(torch.float64))


_BLOCK = 1 << 16  # elements per block: keeps the ~25 FP64 passes in cache (10x faster)


def pointwise32(fn64, x: torch.Tensor) -> torch.Tensor:
    """Apply an FP64 exact-op function elementwise in cache-sized blocks, rounding each result
    once to FP32. Blocking changes no bytes: every operation is elementwise."""
    flat = x.reshape(-1)
    res = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    for i in range(0, flat.numel(), _BLOCK):
        res[i : i + _BLOCK] = fn64(flat[i : i + _BLOCK])
    return res.view(x.shape)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """exp of ``x`` rounded once to FP32 (see ``exp64``)."""
    return pointwise32(exp64, x)


def silu32(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x`` rounded once to FP32 (see ``silu64``)."""
    return pointwise32(silu64, x)


def gelu_tanh32(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximate GELU of ``x`` rounded once to FP32 (see ``gelu_tanh64``)."""
    return pointwise32(gelu_tanh64, x)


_SQRT_PI = math.sqrt(math.pi)
_ERF_TERMS = 64  # the erf series on −1.5 ≤ u ≤ 2.5: truncation below 1e-30 relative
_ERFC_DEPTH = 120  # the erfc continued fraction beyond: truncation below 1e-15 relative
_ERF_LOW, _ERF_HIGH = -1.5, 2.5


def phi64(u: torch.Tensor) -> torch.Tensor:
    """½·erfc(−u) = ½(1 + erf(u)) in FP64 from exact operations (``exp64``). On −1.5 ≤ u ≤ 2.5
    the series erf(u) = (2/√π)·e^(−u²)·Σₙ u(2u²)ⁿ/(2n+1)!! (terms of one sign, 64 of them);
    beyond, ½·erfc(|u|) = e^(−u²)/(2√π·K) with the continued fraction K = |u| + (1/2)/(|u| +
    1/(|u| + (3/2)/(…))) evaluated bottom-up from depth 120, taken as is for u < −1.5 and as
    1 − it for u > 2.5 — so the small left tail is not a difference of nearly equal numbers.
    Relative error below 2e-11 (measured against ``math.erfc``)."""
    u = u.to(torch.float64)
    a = torch.clamp(u, _ERF_LOW, _ERF_HIGH)
    term, series, two_a2 = a, a, 2.0 * a * a
    for n in range(1, _ERF_TERMS):
        term = term * two_a2 / (2 * n + 1)
        series = series + term
    near = 0.5 + exp64(-a * a) * series / _SQRT_PI
    z = torch.clamp(torch.abs(u), min=-_ERF_LOW)
    k = z
    for n in range(_ERFC_DEPTH, 0, -1):
        k = z + (n / 2.0) / k
    tail = 0.5 * exp64(-z * z) / (_SQRT_PI * k)  # ½·erfc(|u|)
    far = torch.where(u < 0, tail, 1.0 - tail)
    return torch.where((u >= _ERF_LOW) & (u <= _ERF_HIGH), near, far)


def gelu_erf64(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU x·Φ(x), Φ(x) = ½(1 + erf(x/√2)), in FP64 (``phi64``; PyTorch's ``nn.GELU()``)."""
    x = x.to(torch.float64)
    return x * phi64(x / math.sqrt(2.0))


def gelu_erf32(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU of ``x`` rounded once to FP32 (see ``gelu_erf64``)."""
    return pointwise32(gelu_erf64, x)
