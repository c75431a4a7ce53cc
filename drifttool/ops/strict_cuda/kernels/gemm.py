"""Strict CUDA GEMM (contract ``cuda1``): ``y = act(x·wᵀ + b)`` with one fixed order over K.

    >>> y = linear(x, w, b, act="gelu_tanh")          # x [..., K], w [N, K], b [N] → [..., N]

Order of every output element y[m, n] (the contract; docs/strict-cuda/gemm.md):

1. one program per (BLOCK_M × BLOCK_N) output tile walks all of K itself (no split-K, stream-K or
   atomics), in chunks of ``CHUNK`` = 64 columns from k = 0 upwards; chunk c's products are
   accumulated into the FP32 accumulator by the MMA (``tl.dot(a, wᵀ, acc)``), chunk after chunk;
   the tail chunk of a K that is not a multiple of 64 is zero-filled (zero products);
2. operands: bf16 × bf16 on the tensor cores (wgmma, FP32 accumulation); if either operand is FP32
   both are upcast to FP32 and multiplied in IEEE FP32 (``input_precision="ieee"``, never TF32);
3. epilogue: the bias (upcast to FP32) is added once, in FP32; then the activation: ``gelu_tanh``
   or ``silu`` evaluated in FP64 from exact operations exactly as the CPU's ``strict_math.
   gelu_tanh32`` / ``silu32`` (Cody–Waite ``exp64``, Horner, exponent-bit scaling), rounded once
   to FP32; then one cast to the output dtype. The kernel is compiled with FMA contraction off
   (``enable_fp_fusion=False``), so every ×, + and ÷ rounds separately as the CPU's do: given the
   same FP32 pre-activation the activation's bytes equal the CPU's.

Row invariance holds by construction: a row's loads, products and sums never involve other rows
(rows past M are zero-filled by TMA or re-read from valid rows and never stored), nothing depends
on M, and the tile configuration is fixed per operand precision (``BF16_CONFIG``, ``FP32_CONFIG``),
never chosen from the shape. The TMA path (tensor descriptors, used when the operands' strides
allow it) and the pointer path load the same values and run the same MMAs in the same order.

Also here: ``silu32`` (elementwise SiLU, the CPU's ``strict_math.silu32``) and ``sinusoid``
(the CPU's ``strict.embed.sinusoid``), the other arithmetic of the GEMM-bearing operators.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_math import exp32

CHUNK = 64
"""K chunk width of every strict CUDA GEMM (part of the contract, not of the configuration)."""

ACTS = {None: 0, "gelu_tanh": 1, "silu": 2}
"""Epilogue activations (the kernel's ``ACT`` constant)."""

_INF = tl.constexpr(float("inf"))
_NAN = tl.constexpr(float("nan"))


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """One fixed launch configuration (tile sizes, warps, pipeline depth, TMA loads).

    Changing it changes no byte on sm_90 (the MMA of a row does not depend on the tile it sits
    in; ``tests/gpu/test_strict_cuda_gemm.py`` proves it); it is fixed per operand precision all
    the same (the contract: no per-shape choice)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    tma: bool = True

    @property
    def id(self) -> str:
        return (f"bm{self.block_m}bn{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'.tma' if self.tma else ''}")


BF16_CONFIG = GemmConfig()
"""bf16 × bf16 (tensor cores): 128×128 tiles, 8 warps, 3 stages, TMA loads (the anchor's best)."""

FP32_CONFIG = GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=1, tma=False)
"""Any FP32 operand (IEEE FMA dot): 16-row tiles (these GEMMs have few rows: SiLU(temb), φ(τ),
LoRA factors), no software pipelining (with it the FMA dot spills: offline ptxas, sm_90a)."""

KERNEL_ID = f"triton.gemm.k{CHUNK}.seq.{BF16_CONFIG.id}|fp32.ieee.{FP32_CONFIG.id}"
"""Kernel identity written to the trace."""


# ---------------------------------------------------------------------------------------------
# FP64 exact-op transcendentals (strict_math's, operation for operation)


@triton.jit
def _c(v: tl.constexpr):
    """The Python float ``v`` as an exact FP64 constant (a bare literal would be rounded to FP32)."""
    return tl.full((), v, tl.float64)


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
    y = tl.where(x > _c(700.0), _c(_INF), y)
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
def _activate(y, ACT: tl.constexpr):
    """FP32 → activation in FP64 → rounded once to FP32 (ACT 0: identity)."""
    if ACT == 1:
        y = _gelu_tanh64(y.to(tl.float64)).to(tl.float32)
    elif ACT == 2:
        y = _silu64(y.to(tl.float64)).to(tl.float32)
    return y


# ---------------------------------------------------------------------------------------------
# GEMM


@triton.jit
def _mma(a, w, acc, IEEE: tl.constexpr):
    """acc + a·wᵀ for one K chunk: bf16 on the tensor cores, or IEEE FP32 (never TF32)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _store(Y, y, rm, rn, M, N, sym, syn):
    """Cast the FP32 tile y [rows rm, columns rn] once to Y's dtype; store the rows < M, columns < N."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(Y + rm.to(tl.int64)[:, None] * sym + rn[None, :] * syn, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, B, Y, M, N, K, sxm, sxk, swn, swk, sym, syn,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr,
                   TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One program per output tile; K walked once in BLOCK_K chunks from 0 (module docstring)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n  # raster grouping for L2 reuse; touches no arithmetic
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % group_size)
    pid_n = (pid % in_group) // group_size
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:  # descriptors zero-fill rows past M, columns past N and the K tail
        for k0 in range(0, K, BLOCK_K):
            a = X.load([off_m, k0])
            w = W.load([off_n, k0])
            acc = _mma(a, w, acc, IEEE)
    else:
        offs_m = (rm % M).to(tl.int64)  # rows past M re-read valid rows; never stored
        offs_n = (rn % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a_ptrs = X + offs_m[:, None] * sxm + kk[None, :] * sxk
            w_ptrs = W + offs_n[:, None] * swn + kk[None, :] * swk
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
                w = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0)
            acc = _mma(a, w, acc, IEEE)
    if HAS_BIAS:
        bias = tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if ACT == 0:
        _store(Y, acc, rm, rn, M, N, sym, syn)
    else:  # the FP64 activation a quarter tile at a time (fewer live registers; same bytes)
        h0, h1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        q0, q1 = tl.split(tl.permute(tl.reshape(h0, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
        _store(Y, _activate(q0, ACT), rm, off_n + tl.arange(0, BLOCK_N // 4), M, N, sym, syn)
        _store(Y, _activate(q1, ACT), rm, off_n + BLOCK_N // 4 + tl.arange(0, BLOCK_N // 4), M, N, sym, syn)
        q2, q3 = tl.split(tl.permute(tl.reshape(h1, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
        _store(Y, _activate(q2, ACT), rm, off_n + BLOCK_N // 2 + tl.arange(0, BLOCK_N // 4), M, N, sym, syn)
        _store(Y, _activate(q3, ACT), rm, off_n + 3 * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4), M, N, sym, syn)


_OPERANDS = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride on its last axis (a copy only when needed; bytes unchanged)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides, and unit last strides."""
    return all(t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in ts)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, act: str | None = None,
           out_dtype: torch.dtype | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """``act(x·wᵀ + b)`` by the strict CUDA GEMM (order in the module docstring).

    Args:
        x: [..., K] bf16 or FP32 (leading axes flattened to rows).
        w: [N, K] bf16 or FP32.  b: [N] or None (any float dtype; upcast to FP32).
        act: None, ``"gelu_tanh"`` or ``"silu"`` (FP64 exact ops, rounded once to FP32).
        out_dtype: output dtype (default x's); the FP32 result is cast to it once.
        config: launch configuration override (tests prove the bytes do not depend on it);
            default ``BF16_CONFIG`` for bf16 × bf16, ``FP32_CONFIG`` otherwise.
    Returns:
        [..., N] in ``out_dtype``, on x's device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Raises:
        UnsupportedConfigError: operand dtypes other than bf16/FP32, mismatched K, an unknown
            activation, or tensors on different devices.
    """
    if act not in ACTS:
        raise UnsupportedConfigError(f"strict CUDA linear: unknown activation {act!r} (one of {list(ACTS)})")
    if x.dtype not in _OPERANDS or w.dtype not in _OPERANDS:
        raise UnsupportedConfigError(f"strict CUDA linear: operands {x.dtype} × {w.dtype}; bf16 or float32 only")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or (b is not None and b.shape != (w.shape[0],)):
        raise UnsupportedConfigError(
            f"strict CUDA linear: shapes x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"b {None if b is None else tuple(b.shape)} do not fit x [..., K], w [N, K], b [N]")
    if w.device != x.device or (b is not None and b.device != x.device):
        raise UnsupportedConfigError("strict CUDA linear: x, w and b must be on one device")
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    out_dtype = out_dtype or x.dtype
    ieee = not (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16)
    cfg = config or (FP32_CONFIG if ieee else BF16_CONFIG)
    x2 = _rows(x.reshape(lead.numel(), k))  # [M, K]
    w2 = _rows(w)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    tma = cfg.tma and k > 0 and _tma_ok(x2, w2)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(x2, [cfg.block_m, CHUNK])
        wa = TensorDescriptor.from_tensor(w2, [cfg.block_n, CHUNK])
    else:
        xa, wa = x2, w2
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _linear_kernel[grid](
        xa, wa, b if b is not None else y, y, m, n, k,
        x2.stride(0), x2.stride(1), w2.stride(0), w2.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=b is not None, ACT=ACTS[act], IEEE=ieee, TMA=tma, EVEN_K=k % CHUNK == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=CHUNK, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------
# elementwise: SiLU, timestep sinusoid

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
    sin = tl.where(bad, _c(_NAN), sin)
    cos = tl.where(bad, _c(_NAN), cos)
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
