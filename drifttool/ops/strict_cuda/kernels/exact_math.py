"""Triton device functions of the strict CUDA GEMMs' exact-op arithmetic: ``strict_math``'s FP64
transcendentals operation for operation (``_exp64``, ``_silu64``, ``_gelu_tanh64``), the FP32
GELU-tanh of the faster GEMM epilogue (``_gelu_tanh_f32``) and the epilogue's activation
(``_activate``, coded by ``ACTS``).

Called by the kernels of ``kernels.gemm`` (the epilogue), ``kernels.gemv`` and ``kernels.embed``,
all compiled with FMA contraction off (``enable_fp_fusion=False``): every ×, + and ÷ here rounds
separately, as the CPU's do. Like those kernels, these functions call only Triton builtins
(``kernels.gemm``'s module docstring says why).
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTS = {None: 0, "gelu_tanh": 1, "silu": 2, "gelu_tanh_f32": 3}
"""Epilogue activations (the kernel's ``ACT`` constant): ``gelu_tanh`` and ``silu`` in FP64 from
exact operations (the CPU's bytes given the same FP32 pre-activation); ``gelu_tanh_f32`` the faster
FP32 GELU-tanh of ``_gelu_tanh_f32`` (its own fixed formula, not the CPU's bytes)."""

_INF_BITS = tl.constexpr(0x7FF0000000000000)
"""FP64 +inf as bits. Kernels build inf and NaN from integer bits (``_f64_bits``): Triton's jit
compares the globals a kernel used with ``!=`` at every launch, and a NaN global is never equal
to itself ("Global variable ... has changed since we compiled this kernel")."""
_NAN_BITS = tl.constexpr(0x7FF8000000000000)
"""FP64 quiet NaN as bits (the canonical NaN)."""


@triton.jit
def _c(v: tl.constexpr):
    """The Python float ``v`` as an exact FP64 constant (a bare literal would be rounded to FP32)."""
    return tl.full((), v, tl.float64)


@triton.jit
def _f64_bits(bits: tl.constexpr):
    """The FP64 value with the bit pattern ``bits`` (inf, NaN), made in the kernel from an integer."""
    return tl.full((), bits, tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _round_half_even(t):
    """torch.round of FP64 |t| < 2^51: adding and removing 1.5·2^52 rounds to an integer, ties to even."""
    big = _c(6755399441055744.0)
    return (t + big) - big


@triton.jit
def _exp64(x):
    """strict_math.exp64: Cody–Waite reduction by ln2, degree-10 Taylor by Horner, 2^k from bits."""
    xc = tl.where(x != x, _c(0.0), x)
    xc = tl.minimum(tl.maximum(xc, _c(-700.0)), _c(700.0))
    k = _round_half_even(xc * _c(1.44269504088896338700e00))
    r = (xc - k * _c(6.93147180369123816490e-01)) - k * _c(1.90821492927058770002e-10)
    p = _c(1.0 / 3628800.0)
    p = p * r + _c(1.0 / 362880.0)
    p = p * r + _c(1.0 / 40320.0)
    p = p * r + _c(1.0 / 5040.0)
    p = p * r + _c(1.0 / 720.0)
    p = p * r + _c(1.0 / 120.0)
    p = p * r + _c(1.0 / 24.0)
    p = p * r + _c(1.0 / 6.0)
    p = p * r + _c(1.0 / 2.0)
    p = p * r + _c(1.0)
    p = p * r + _c(1.0)
    pow2 = ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    y = p * pow2
    y = tl.where(x > _c(700.0), _f64_bits(_INF_BITS), y)
    y = tl.where(x < _c(-700.0), _c(0.0), y)
    return tl.where(x != x, x, y)


@triton.jit
def _silu64(x):
    """strict_math.silu64: x / (1 + exp64(−x)), FP64."""
    return x / (_c(1.0) + _exp64(-x))


@triton.jit
def _gelu_tanh64(x):
    """strict_math.gelu_tanh64: ½x(1 + tanh(√(2/π)(x + 0.044715·x³))), tanh = sign·(1 − 2/(e^{2|u|} + 1))."""
    inner = _c(0.7978845608028654) * (x + _c(0.044715) * ((x * x) * x))
    a = tl.abs(inner)
    t = _c(1.0) - _c(2.0) / (_exp64(_c(2.0) * a) + _c(1.0))
    t = tl.where(inner < _c(0.0), -t, t)
    return (_c(0.5) * x) * (_c(1.0) + t)


@triton.jit
def _f(v: tl.constexpr):
    """The Python float ``v`` rounded to an FP32 constant."""
    return tl.full((), v, tl.float32)


@triton.jit
def _exp_f32(z):
    """e^z in FP32 from exact FP32 operations (each rounded, no FMA): z clamped to [−87, 88];
    k = rne(z·log2e) (by ±1.5·2^23); r = (z − k·ln2_hi) − k·ln2_lo (ln2_hi = 0x3F317200, so k·ln2_hi
    is exact); p = Taylor of degree 7 by Horner (1/5040, 1/720, 1/120, 1/24, 1/6, 1/2, 1, 1);
    2^k from exponent bits; e^z = p·2^k; +inf above 88, 0 below −87, NaN kept."""
    zc = tl.where(z != z, _f(0.0), z)
    zc = tl.minimum(tl.maximum(zc, _f(-87.0)), _f(88.0))
    big = _f(12582912.0)
    k = ((zc * _f(1.4426950408889634)) + big) - big
    r = (zc - k * _f(0.693145751953125)) - k * _f(1.428606765330187e-06)
    p = _f(1.0 / 5040.0)
    p = p * r + _f(1.0 / 720.0)
    p = p * r + _f(1.0 / 120.0)
    p = p * r + _f(1.0 / 24.0)
    p = p * r + _f(1.0 / 6.0)
    p = p * r + _f(0.5)
    p = p * r + _f(1.0)
    p = p * r + _f(1.0)
    pow2 = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    y = p * pow2
    y = tl.where(z > _f(88.0), _f64_bits(_INF_BITS).to(tl.float32), y)
    y = tl.where(z < _f(-87.0), _f(0.0), y)
    return tl.where(z != z, z, y)


@triton.jit
def _gelu_tanh_f32(x):
    """tanh-approximate GELU in FP32 from exact FP32 operations, in this order (each rounded, no
    FMA): u = c0·(x + c1·((x·x)·x)) with c0 = fp32(√(2/π)), c1 = fp32(0.044715); then
    x / (1 + e^(−2u)) with ``_exp_f32`` and an IEEE division (= ½x(1 + tanh u), the sigmoid form:
    no cancellation for negative x). Not the CPU's bytes (the CPU's GELU is FP64); a few FP32 ulps
    from the exact value."""
    u = _f(0.7978845608028654) * (x + _f(0.044715) * ((x * x) * x))
    return tl.div_rn(x, _f(1.0) + _exp_f32(_f(-2.0) * u))  # IEEE division (``/`` would be div.full)


@triton.jit
def _activate(y, ACT: tl.constexpr):
    """FP32 → activation in FP64 → rounded once to FP32 (ACT 0: identity; ACT 3: the FP32 GELU)."""
    if ACT == 1:
        y = _gelu_tanh64(y.to(tl.float64)).to(tl.float32)
    elif ACT == 2:
        y = _silu64(y.to(tl.float64)).to(tl.float32)
    elif ACT == 3:
        y = _gelu_tanh_f32(y)
    return y

