"""Strict CUDA GEMM (contract ``cuda1``): ``y = act(x·wᵀ + b)`` with one fixed order over K.

    >>> y = linear(x, w, b, act="gelu_tanh")          # x [..., K], w [N, K], b [N] → [..., N]

Order of every output element y[m, n] (the contract; docs/strict-arithmetic.md, "The strict CUDA family"):

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
   same FP32 pre-activation the activation's bytes equal the CPU's. Option ``gelu_tanh_f32``: the
   FP32 formula of ``_gelu_tanh_f32`` (exact FP32 operations in a stated order; faster, not the
   CPU's bytes), for ``mlp_up_gemm_gelu`` when ``strict_cuda.linear.GELU_EPILOGUE`` is ``"f32"``.

Row invariance holds by construction: a row's loads, products and sums never involve other rows
(rows past M are zero-filled by TMA or re-read from valid rows and never stored), nothing depends
on M, and the tile configuration is fixed per operand precision (``BF16_CONFIG``, ``FP32_CONFIG``),
never chosen from the shape. The TMA path (tensor descriptors, used when the operands' strides
allow it) and the pointer path load the same values and run the same MMAs in the same order.

The kernels call only Triton builtins, never ``triton.language.standard``'s ``@jit`` helpers
(``tl.cdiv``, ``tl.zeros``, ...): those are decorated when Triton is first imported, so in a test
process that imported Triton before setting ``TRITON_INTERPRET=1`` they are compiled-mode functions
that an interpreted kernel cannot call.

Also here: ``gemv`` (few rows with an FP32 operand: one program per row, 64 lane sums over K,
a pairwise lane tree; its own exactly stated order, used by operator: ``adaln_mod_projection``,
``timestep_embed_mlp``), ``silu32`` (elementwise SiLU, the CPU's ``strict_math.silu32``) and ``sinusoid``
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
    maxnreg: int | None = None
    """Register cap per thread (e.g. 128: two 8-warp CTAs per SM, one's epilogue beside the
    other's MMAs; the FP64 GELU then spills ~250 bytes, offline sm_90a). None: the compiler's."""

    @property
    def id(self) -> str:
        return (f"bm{self.block_m}bn{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'.tma' if self.tma else ''}{f'.r{self.maxnreg}' if self.maxnreg else ''}")


BF16_CONFIG = GemmConfig()
"""bf16 × bf16 (tensor cores): 128×128 tiles, 8 warps, 3 stages, TMA loads (the anchor's best)."""

FP32_CONFIG = GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=1, tma=False)
"""Any FP32 operand (IEEE FMA dot): 16-row tiles, no software pipelining (with it the FMA dot
spills: offline ptxas, sm_90a)."""

LORA_CONFIG = GemmConfig(block_m=64, block_n=64, num_warps=4, num_stages=1, tma=False)
"""``lora_merge``'s B·A (FP32, K = r, M = N = the layer's width): 64×64 tiles (the same bytes as
any tile: the FMA dot of an element does not depend on its tile; the GPU test checks it)."""

KERNEL_ID = f"triton.gemm.k{CHUNK}.seq.{BF16_CONFIG.id}|fp32.ieee.{FP32_CONFIG.id}"
"""Kernel identity written to the trace."""


# ---------------------------------------------------------------------------------------------
# FP64 exact-op transcendentals (strict_math's, operation for operation)


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
def _linear_kernel(X, W, B, Y, R, scale, M, N, K, sxm, sxk, swn, swk, sym, syn, srm,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr,
                   TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One program per output tile; K walked once in BLOCK_K chunks from 0 (module docstring)."""
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M  # (tl.cdiv and tl.zeros are avoided: see module doc)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_pid_n  # raster grouping for L2 reuse; touches no arithmetic
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % group_size)
    pid_n = (pid % in_group) // group_size
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
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
    if MERGE:  # y = fp32(R) + scale·acc: the product rounded, then the sum (two FP32 operations)
        r_mask = (rm[:, None] < M) & (rn[None, :] < N)
        res = tl.load(R + rm.to(tl.int64)[:, None] * srm + rn[None, :], mask=r_mask, other=0.0)
        acc = res.to(tl.float32) + scale * acc
    if ACT == 0 or ACT == 3:  # none, or the FP32 GELU on the whole tile
        _store(Y, _activate(acc, ACT), rm, rn, M, N, sym, syn)
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


def _check(x, w, b, what: str) -> None:
    """Fail closed on operand dtypes, shapes and devices the kernels do not take."""
    if x.dtype not in _OPERANDS or w.dtype not in _OPERANDS:
        raise UnsupportedConfigError(f"strict CUDA {what}: operands {x.dtype} × {w.dtype}; bf16 or float32 only")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or (b is not None and b.shape != (w.shape[0],)):
        raise UnsupportedConfigError(
            f"strict CUDA {what}: shapes x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"b {None if b is None else tuple(b.shape)} do not fit x [..., K], w [N, K], b [N]")
    if w.device != x.device or (b is not None and b.device != x.device):
        raise UnsupportedConfigError(f"strict CUDA {what}: x, w and b must be on one device")


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, act: str | None = None,
           out_dtype: torch.dtype | None = None, config: GemmConfig | None = None,
           merge_into: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``act(x·wᵀ + b)`` by the strict CUDA GEMM (order in the module docstring).

    Args:
        x: [..., K] bf16 or FP32 (leading axes flattened to rows).
        w: [N, K] bf16 or FP32.  b: [N] or None (any float dtype; upcast to FP32).
        act: None, ``"gelu_tanh"`` or ``"silu"`` (FP64 exact ops, rounded once to FP32), or
            ``"gelu_tanh_f32"`` (the FP32 formula of ``_gelu_tanh_f32``: faster, not the CPU's bytes).
        out_dtype: output dtype (default x's); the FP32 result is cast to it once.
        config: launch configuration override (tests prove the bytes do not depend on it);
            default ``BF16_CONFIG`` for bf16 × bf16, ``FP32_CONFIG`` otherwise.
        merge_into: [M, N] (2-D x only; a LoRA merge's base weight W, any float dtype): the
            epilogue returns fp32(W) + fp32(scale)·(x·wᵀ + b), the product and the sum each rounded
            to FP32 (the strict ``lora_merge``'s two torch operations, fused; no activation).
        scale: the merge's scale (a python float, rounded once to FP32).
    Returns:
        [..., N] in ``out_dtype``, on x's device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Raises:
        UnsupportedConfigError: operand dtypes other than bf16/FP32, mismatched K, an unknown
            activation, or tensors on different devices.
    """
    if act not in ACTS:
        raise UnsupportedConfigError(f"strict CUDA linear: unknown activation {act!r} (one of {list(ACTS)})")
    _check(x, w, b, "linear")
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    if merge_into is not None and (act is not None or merge_into.shape != (*lead, n) or x.dim() != 2
                                   or merge_into.device != x.device):
        raise UnsupportedConfigError(
            f"strict CUDA linear: merge_into {tuple(merge_into.shape)} needs a 2-D x, shape [M, N] = "
            f"{(*lead, n)} on x's device and no activation")
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
    r = y if merge_into is None else _rows(merge_into)
    _linear_kernel[grid](
        xa, wa, b if b is not None else y, y, r, float(scale), m, n, k,
        x2.stride(0), x2.stride(1), w2.stride(0), w2.stride(1), y.stride(0), y.stride(1), r.stride(0),
        HAS_BIAS=b is not None, ACT=ACTS[act], IEEE=ieee, MERGE=merge_into is not None, TMA=tma,
        EVEN_K=k % CHUNK == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=CHUNK, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------
# GEMV: few-row GEMMs with an FP32 operand (memory-bound on the weight)


@dataclass(frozen=True, kw_only=True)
class GemvConfig:
    """The GEMV's launch configuration: output columns per program, warps, pipeline depth. None of
    them enters the order of the sums (one row per program, lanes fixed by ``GEMV_CHUNK``, the
    lane tree written out), so the bytes do not depend on it; fixed all the same."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 1
    unroll: int = 4

    @property
    def id(self) -> str:
        return f"bn{self.block_n}w{self.num_warps}u{self.unroll}"


GEMV_CHUNK = 64
"""The GEMV's K chunk: the number of lanes each row's K is dealt into (part of the contract)."""

GEMV_CONFIG = GemvConfig()
"""The GEMV's one configuration: 64 output columns per program, 4 warps, 4 chunks' loads in
flight (Triton does not pipeline loads that feed no dot; offline sm_90a ptxas: no spills)."""

GEMV_ID = f"triton.gemv.row.lanes{GEMV_CHUNK}.seq.pairtree.fp32.{GEMV_CONFIG.id}"
"""Kernel identity of the GEMV written to the trace."""


@triton.jit
def _lane_tree(acc, BLOCK_N: tl.constexpr, LEVELS: tl.constexpr):
    """[BLOCK_N, LANES] → [BLOCK_N]: adjacent lanes added pairwise, level after level
    (lane j ← lane 2j + lane 2j+1), written out so no compiler layout decides the order."""
    for _ in tl.static_range(LEVELS):
        lo, hi = tl.split(tl.reshape(acc, (BLOCK_N, acc.shape[1] // 2, 2)))
        acc = lo + hi
    return tl.reshape(acc, (BLOCK_N,))


@triton.jit
def _lane_products(acc, x_row, W, offs_n, swn, kk, K, MASKED: tl.constexpr):
    """acc + the FP32 products of one K chunk (columns kk): rounded product, then rounded add."""
    w_ptrs = W + offs_n[:, None] * swn + kk[None, :]
    if MASKED:  # the tail: zero products
        a = tl.load(x_row + kk, mask=kk < K, other=0.0)
        w = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0)
    else:
        a = tl.load(x_row + kk)
        w = tl.load(w_ptrs)
    return acc + a.to(tl.float32)[None, :] * w.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, B, Y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                 BLOCK_N: tl.constexpr, LANES: tl.constexpr, LEVELS: tl.constexpr, UNROLL: tl.constexpr):
    """One program per (row m, BLOCK_N columns): lane sums over K, then the lane tree (``gemv``).
    The chunks are walked UNROLL at a time (their loads in flight together), then one at a time
    for the rest: the same chunks, in the same ascending order."""
    pid = tl.program_id(0)
    m = pid % M  # the rows of one column block run side by side (the weight tile stays in L2)
    pid_n = pid // M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = (rn % N).to(tl.int64)  # columns past N re-read valid columns; never stored
    rk = tl.arange(0, LANES)
    x_row = X + m.to(tl.int64) * sxm
    acc = tl.full((BLOCK_N, LANES), 0.0, tl.float32)
    k_whole = (K // (UNROLL * LANES)) * (UNROLL * LANES)
    for k0 in range(0, k_whole, UNROLL * LANES):
        for u in tl.static_range(UNROLL):
            acc = _lane_products(acc, x_row, W, offs_n, swn, k0 + u * LANES + rk, K, False)
    for k0 in range(k_whole, K, LANES):
        acc = _lane_products(acc, x_row, W, offs_n, swn, k0 + rk, K, True)
    y = _lane_tree(acc, BLOCK_N, LEVELS)
    if HAS_BIAS:
        y = y + tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = _activate(y, ACT)
    tl.store(Y + m.to(tl.int64) * sym + rn, y.to(Y.dtype.element_ty), mask=rn < N)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, act: str | None = None,
         out_dtype: torch.dtype | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``act(x·wᵀ + b)`` for few rows with FP32 products (the adaLN modulation projection, the
    timestep MLP, the final adaLN projection): a memory-bound GEMV whose order is fixed per row.

    Order of every output element y[m, n] (the contract; docs/strict-arithmetic.md, "The strict CUDA family"):

    1. one program per (row m, ``block_n`` columns): each row is its own program (the row block is
       one row, whatever M), walking all of K itself (no split-K or atomics);
    2. K is dealt into ``GEMV_CHUNK`` = 64 lanes (lane j holds k ≡ j mod 64); lane j's sum is
       s_j = (((0 + p_j) + p_{64+j}) + p_{128+j}) + …, k ascending, each product p_k =
       fp32(x[m, k])·fp32(w[n, k]) rounded to FP32 and then added (no FMA: contraction is off);
       a K tail is zero-filled (zero products);
    3. the 64 lane sums are added by a fixed pairwise tree over adjacent lanes, six levels
       (lane j ← lane 2j + lane 2j+1), written out in the kernel (no compiler layout decides it);
    4. the bias (upcast to FP32) is added once; the activation (``silu``: FP64 exact ops as in
       ``linear``, rounded once to FP32); one cast to ``out_dtype``.

    Every step is an IEEE FP32 operation in a stated order, so the bytes are the same on any
    device and for any launch configuration (the interpreter test compares them with the same
    order computed by torch on the CPU). Row invariance by construction: a row's loads, products
    and sums never involve other rows, nothing depends on M or on the row's position. Not the
    order of ``linear`` (MMA accumulation): an operator uses one or the other by its contract,
    never by its shape.

    Args:
        x: [..., K] FP32 or bf16 (leading axes flattened to rows; meant for a few rows: the
            weight is read once per row, mostly from L2 after the first).
        w: [N, K] bf16 or FP32.  b: [N] or None (upcast to FP32).
        act: None or ``"silu"``.  out_dtype: default x's.
        config: launch configuration override (tests only).
    Returns:
        [..., N] in ``out_dtype`` on x's device.
    Raises:
        UnsupportedConfigError: as ``linear``'s, or an activation other than None / ``"silu"``.
    """
    if act not in (None, "silu"):
        raise UnsupportedConfigError(f"strict CUDA gemv: unknown activation {act!r} (None or 'silu')")
    _check(x, w, b, "gemv")
    cfg = config or GEMV_CONFIG
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    x2 = _rows(x.reshape(lead.numel(), k))
    w2 = _rows(w)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    grid = (m * triton.cdiv(n, cfg.block_n),)
    _gemv_kernel[grid](x2, w2, b if b is not None else y, y, m, n, k, x2.stride(0), w2.stride(0), y.stride(0),
                       HAS_BIAS=b is not None, ACT=ACTS[act], BLOCK_N=cfg.block_n, LANES=GEMV_CHUNK,
                       LEVELS=GEMV_CHUNK.bit_length() - 1, UNROLL=cfg.unroll, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, enable_fp_fusion=False)
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
