"""Strict CUDA GEMM (contract ``cuda1``): ``y = act(x·wᵀ + b)`` with one fixed order over K.

    >>> y = linear(x, w, b, act="gelu_tanh")          # x [..., K], w [N, K], b [N] → [..., N]

Order of every output element y[m, n] (the contract; docs/strict-arithmetic.md, "The strict CUDA family"):

1. one program per (BLOCK_M × BLOCK_N) output tile walks all of K itself (no split-K, stream-K or
   atomics), in chunks of ``CHUNK`` = 64 columns from k = 0 upwards; chunk c's products are
   accumulated into the FP32 accumulator by the MMA (``tl.dot(a, wᵀ, acc)``), chunk after chunk;
   the tail chunk of a K that is not a multiple of 64 is zero-filled (zero products);
2. operands: bf16 × bf16 on the tensor cores (wgmma, FP32 accumulation); if either operand is FP32
   both are upcast to FP32 and multiplied in IEEE FP32 (``input_precision="ieee"``, never TF32);
3. epilogue: the bias (upcast to FP32) is added once, in FP32; with ``merge_into`` R the result
   becomes fp32(R) + fp32(scale)·acc (product, then sum, each rounded); then the activation: ``gelu_tanh``
   or ``silu`` evaluated in FP64 from exact operations exactly as the CPU's ``strict_math.
   gelu_tanh32`` / ``silu32`` (Cody–Waite ``exp64``, Horner, exponent-bit scaling), rounded once
   to FP32; then one cast to the output dtype. The kernel is compiled with FMA contraction off
   (``enable_fp_fusion=False``), so every ×, + and ÷ rounds separately as the CPU's do: given the
   same FP32 pre-activation the activation's bytes equal the CPU's. Option ``gelu_tanh_f32``: the
   FP32 formula of ``exact_math._gelu_tanh_f32`` (exact FP32 operations in a stated order;
   faster, not the CPU's bytes), for ``mlp_up_gemm_gelu`` when ``strict_cuda.linear.GELU_EPILOGUE``
   is ``"f32"``.

Row invariance holds by construction: a row's loads, products and sums never involve other rows
(rows past M are zero-filled by TMA or re-read from valid rows and never stored), nothing depends
on M, and the tile configuration is fixed by the operands' and the output's precision
(``BF16_CONFIG``, ``BF16_WIDE_CONFIG``, ``FP32_CONFIG``), never chosen from the shape. The TMA
path (tensor descriptors, used when the operands' strides allow it) and the pointer path load
the same values and run the same MMAs in the same order.

The kernels call only Triton builtins, never ``triton.language.standard``'s ``@jit`` helpers
(``tl.cdiv``, ``tl.zeros``, ...): those are decorated when Triton is first imported, so in a test
process that imported Triton before setting ``TRITON_INTERPRET=1`` they are compiled-mode functions
that an interpreted kernel cannot call.

See also: ``kernels.gemv`` (few rows with an FP32 operand: its own exactly stated order),
``kernels.embed`` (``silu32``, ``sinusoid``: the other arithmetic of the GEMM-bearing operators)
and ``kernels.exact_math`` (the epilogue's activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from drifttool.capture import gpu_rows, produced
from drifttool.capture.gpu_rows_kernels import (_fold_into, _no_summary, _store_tile_digest, _tile_limbs,
                                                _tile_summary)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_cuda.kernels.exact_math import ACTS, _activate

CHUNK = 64
"""K chunk width of every strict CUDA GEMM (part of the contract, not of the configuration)."""


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
    persistent: int = 0
    """Persistent programs per SM (0: one program per tile). With n = this × #SMs programs,
    program p computes tiles p, p + n, ... in turn, its tile loop and K loop flattened so that
    the next tile's loads can overlap this tile's epilogue (TMA loads and an activation none or
    the FP32 GELU; other calls run one program per tile). Each tile's arithmetic is the
    one-program-per-tile kernel's: the same bytes."""

    @property
    def id(self) -> str:
        return (f"bm{self.block_m}bn{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'.g' + str(self.group_m) if self.group_m != 8 else ''}"
                f"{'.tma' if self.tma else ''}{f'.p{self.persistent}' if self.persistent else ''}"
                f"{f'.r{self.maxnreg}' if self.maxnreg else ''}")


BF16_CONFIG = GemmConfig(block_n=256, persistent=1)
"""bf16 × bf16 (tensor cores): 128×256 tiles, 8 warps, 3 stages, TMA loads, one persistent program
per SM walking the tiles in turn (the same bytes as any tile: ``tests/gpu/test_strict_cuda_gemm.py``
compares launch geometries). 2–7 % faster than 128×128 tiles, one program per tile, at the image
stream's projections, 9–22 % slower at the text stream's 128–256 rows; a captured forward runs
the text stream beside the image stream (``model.lanes``), where the whole 60-block forward is
4–6 % faster with it (``benchmarks/bench_gpu_forward.py`` ``+alt``, docs/benchmarks.md). For a
16-bit output without a merge; otherwise ``BF16_WIDE_CONFIG``. Chosen by the operands' and the
output's precision, never by shape."""

BF16_WIDE_CONFIG = GemmConfig(block_n=256, num_stages=4)
"""bf16 × bf16 with an FP32 output or a merged epilogue (the backward's FP32 gradients, an
adapter's FP32 pre-activation): 128×256 tiles, 8 warps, 4 stages, TMA loads, one program per tile
(persistent with 3 stages needs 278,552 bytes of shared memory, over a block's). On an H100 the
three (K, N) of a block at 4,096 and 8,192 rows took 18 % less than the 128×128 tiles before it,
1.03–1.18× cuBLAS's bf16 GEMM, with the same bytes (``benchmarks/sweep_strict_gemm.py --out
fp32``)."""


FP32_CONFIG = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=1, tma=False)
"""Any FP32 operand (IEEE FMA dot): 64×128 tiles, 4 warps, no software pipelining (with it the
FMA dot spills: offline ptxas, sm_90a). On the H200 it runs at 22.6 TFLOP/s on the full-size
projections, against 6.7 for the 16×64 tiles before it, with the same bytes
(``benchmarks/sweep_strict_gemm_fp32.py``, docs/benchmarks.md)."""

MERGE_ACT_CONFIG = GemmConfig(block_m=64, block_n=128, num_warps=8, num_stages=1, tma=False)
"""The unfused adapter's up-projection merged into the FP32 pre-activation with the activation in
the epilogue (act(pre + fp32(s)·(u·Bᵀ)), K = r): ``FP32_CONFIG``'s tile on 8 warps, whose
registers hold the GELU's temporaries (on 4 warps the epilogue took 2.3× the same launch without
the activation). Chosen by that role; the same bytes as any tile. On an H100, 4096 × 16 → 12288:
0.51 ms against 0.76 ms (``benchmarks/sweep_strict_gemm_fp32.py --merge``)."""

LORA_CONFIG = GemmConfig(block_m=64, block_n=64, num_warps=4, num_stages=1, tma=False)
"""``lora_merge``'s B·A (FP32, K = r, M = N = the layer's width): 64×64 tiles (the same bytes as
any tile: the FMA dot of an element does not depend on its tile; the GPU test checks it)."""

KERNEL_ID = f"triton.gemm.k{CHUNK}.seq.{BF16_CONFIG.id}|wide.{BF16_WIDE_CONFIG.id}|fp32.ieee.{FP32_CONFIG.id}"
"""Kernel identity written to the trace."""


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


@triton.jit
def _stored(Y, rm, col0, M, N, sym, syn, BC: tl.constexpr):
    """The BC columns from ``col0`` of rows ``rm`` that this program stored in Y (rows past M read
    as 0: not part of any table), and which of them are the row's (``[1, BC]``)."""
    rn = col0 + tl.arange(0, BC)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    return tl.load(Y + rm.to(tl.int64)[:, None] * sym + rn[None, :] * syn, mask=mask, other=0.0), (rn < N)[None, :]


@triton.jit
def _tile_offsets(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The first row and column of output tile number ``tile`` (grouped raster order for L2
    reuse; it touches no arithmetic)."""
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M  # (tl.cdiv and tl.zeros are avoided: see module doc)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((tile % in_group) % group_size)
    pid_n = (tile % in_group) // group_size
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _epilogue(acc, B, Y, R, scale, off_m, off_n, M, N, sym, syn, srm, DK, ktab, DR, DS, shift_t,
              shift_t2, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, MERGE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIGEST: tl.constexpr,
              WBYTES: tl.constexpr):
    """Bias, merge, activation and the one cast of a finished tile (module docstring, step 3).
    With ``DIGEST``: digest v2's row terms of the values stored (keys ``DK``, ``ktab`` columns),
    read back by the program that stored them, written as column split ``off_n // BLOCK_N`` of
    the row table ``DR``/``DS`` (``linear``'s ``digest``)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if MERGE:  # y = fp32(R) + scale·acc: the product rounded, then the sum (two FP32 operations)
        r_mask = (rm[:, None] < M) & (rn[None, :] < N)
        res = tl.load(R + rm.to(tl.int64)[:, None] * srm + rn[None, :], mask=r_mask, other=0.0)
        acc = res.to(tl.float32) + scale * acc
    Q: tl.constexpr = BLOCK_N // 4
    if ACT == 0 or ACT == 3:  # none, or the FP32 GELU on the whole tile
        _store(Y, _activate(acc, ACT), rm, rn, M, N, sym, syn)
    else:  # the FP64 activation a quarter tile at a time (fewer live registers; same bytes)
        h0, h1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        q0, q1 = tl.split(tl.permute(tl.reshape(h0, (BLOCK_M, 2, Q)), (0, 2, 1)))
        _store(Y, _activate(q0, ACT), rm, off_n + tl.arange(0, Q), M, N, sym, syn)
        _store(Y, _activate(q1, ACT), rm, off_n + Q + tl.arange(0, Q), M, N, sym, syn)
        q2, q3 = tl.split(tl.permute(tl.reshape(h1, (BLOCK_M, 2, Q)), (0, 2, 1)))
        _store(Y, _activate(q2, ACT), rm, off_n + 2 * Q + tl.arange(0, Q), M, N, sym, syn)
        _store(Y, _activate(q3, ACT), rm, off_n + 3 * Q + tl.arange(0, Q), M, N, sym, syn)
    if DIGEST:  # the tile read back from where it was just stored (the L2 cache), a quarter at a time
        tl.debug_barrier()  # every thread's stores seen by the block; the accumulator is dead by now
        acc32 = tl.zeros([BLOCK_M, 16], tl.int32)  # the quarters' limb sums, folded once (≤ 1 KiB of bytes)
        sq, mx, mn, bad = _no_summary(BLOCK_M)
        for i in tl.static_range(0, 4):
            y, ok = _stored(Y, rm, off_n + i * Q, M, N, sym, syn, Q)
            acc32 = _tile_limbs(y, off_n + i * Q, ok, DK, ktab, acc32, BLOCK_M, Q, WBYTES)
            sq1, mx1, mn1, bad1 = _tile_summary(y, ok)
            sq, mx, mn, bad = sq + sq1, tl.maximum(mx, mx1), tl.minimum(mn, mn1), bad + bad1
        zero = tl.zeros([BLOCK_M], tl.int64)
        t, t2 = _fold_into(zero, zero, acc32, 8, 16, 8)
        _store_tile_digest(DR, DS, rm, M, off_n // BLOCK_N, shift_t, shift_t2, (t, t2, sq, mx, mn, bad))


@triton.jit(do_not_specialize=["M"])
def _linear_persistent_kernel(X, W, B, Y, R, scale, M, N, K, sym, syn, srm, n_programs,
                              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr,
                              MERGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``_linear_kernel`` (TMA loads) as ``n_programs`` persistent programs: program p computes
    tiles p, p + n_programs, ... in turn, each exactly as one program per tile would."""
    n_tiles = ((M + BLOCK_M - 1) // BLOCK_M) * ((N + BLOCK_N - 1) // BLOCK_N)
    n_k = (K + BLOCK_K - 1) // BLOCK_K
    for tile in tl.range(tl.program_id(0), n_tiles, n_programs, flatten=True):
        off_m, off_n = _tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for kc in range(0, n_k):
            acc = _mma(X.load([off_m, kc * BLOCK_K]), W.load([off_n, kc * BLOCK_K]), acc, IEEE)
        _epilogue(acc, B, Y, R, scale, off_m, off_n, M, N, sym, syn, srm, Y, 0, Y, Y, 0, 0,
                  HAS_BIAS, ACT, MERGE, BLOCK_M, BLOCK_N, False, 0)  # no digest (see linear)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, B, Y, R, scale, M, N, K, sxm, sxk, swn, swk, sym, syn, srm,
                   DK, ktab, DR, DS, shift_t, shift_t2,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr,
                   TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   DIGEST: tl.constexpr, WBYTES: tl.constexpr):
    """One program per output tile; K walked once in BLOCK_K chunks from 0 (module docstring)."""
    off_m, off_n = _tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
    _epilogue(acc, B, Y, R, scale, off_m, off_n, M, N, sym, syn, srm, DK, ktab, DR, DS, shift_t, shift_t2,
              HAS_BIAS, ACT, MERGE, BLOCK_M, BLOCK_N, DIGEST, WBYTES)


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
           merge_into: torch.Tensor | None = None, scale: float = 1.0, digest: bool = False
           ) -> torch.Tensor:
    """``act(x·wᵀ + b)`` by the strict CUDA GEMM (order in the module docstring).

    Args:
        x: [..., K] bf16 or FP32 (leading axes flattened to rows).
        w: [N, K] bf16 or FP32.  b: [N] or None (any float dtype; upcast to FP32).
        act: None, ``"gelu_tanh"`` or ``"silu"`` (FP64 exact ops, rounded once to FP32), or
            ``"gelu_tanh_f32"`` (the FP32 formula of ``_gelu_tanh_f32``: faster, not the CPU's bytes).
        out_dtype: output dtype (default x's); the FP32 result is cast to it once.
        config: launch configuration override (tests prove the bytes do not depend on it);
            default ``BF16_CONFIG`` for bf16 × bf16 to a 16-bit output (``BF16_WIDE_CONFIG`` with
            an FP32 output or ``merge_into``), ``FP32_CONFIG`` with an FP32 operand.
        merge_into: [..., N], the output's shape (any float dtype): the epilogue computes
            fp32(merge_into) + fp32(scale)·(x·wᵀ + b), the product and the sum each rounded to FP32,
            then the activation, then the cast. A LoRA merge's base weight W (strict
            ``lora_merge``: fp32(W) + fp32(s)·(B·A)) or an unfused adapter's base pre-activation
            (strict ``qkv_bias_gemm`` … ``mlp_down_gemm`` with ``lora``: act(pre + fp32(s)·(u·Bᵀ))).
        scale: the merge's scale (a python float, rounded once to FP32).
        digest: also write digest v2's row table of the output in the epilogue, from the values
            it stores (one column split per column tile; ``capture.produced.offer``): a capture
            of the output then reads no byte of it again (``gpu_rows.row_table`` returns this
            table). Where ``digestible`` says no, nothing is written and the row kernel reads
            the output at its capture, as without it; the output's bytes never change.
    Returns:
        [..., N] in ``out_dtype``, on x's device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Raises:
        UnsupportedConfigError: operand dtypes other than bf16/FP32, mismatched K, an unknown
            activation, tensors on different devices, or ``merge_into`` not of the output's shape.
    """
    if act not in ACTS:
        raise UnsupportedConfigError(f"strict CUDA linear: unknown activation {act!r} (one of {list(ACTS)})")
    _check(x, w, b, "linear")
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    if merge_into is not None and (merge_into.shape != (*lead, n) or merge_into.device != x.device):
        raise UnsupportedConfigError(
            f"strict CUDA linear: merge_into {tuple(merge_into.shape)} must have the output's shape "
            f"[..., N] = {(*lead, n)} and be on x's device")
    out_dtype = out_dtype or x.dtype
    ieee = not (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16)
    cfg = config or registered_config(x.dtype, w.dtype, out_dtype, merge_into is not None)
    x2 = _rows(x.reshape(lead.numel(), k))  # [M, K]
    w2 = _rows(w)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    d = _Digest(y, cfg.block_n) if digest and digestible(cfg, out_dtype) else None
    dargs = (y, 0, y, y, 0, 0) if d is None else d.args
    tma = cfg.tma and k > 0 and _tma_ok(x2, w2)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(x2, [cfg.block_m, CHUNK])
        wa = TensorDescriptor.from_tensor(w2, [cfg.block_n, CHUNK])
    else:
        xa, wa = x2, w2
    n_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    r = y if merge_into is None else _rows(merge_into.reshape(m, n))  # [M, N]
    extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
    if persists(cfg, tma, act, d is not None):
        n_programs = min(n_tiles, cfg.persistent * _sm_count(x.device))
        _linear_persistent_kernel[(n_programs,)](
            xa, wa, b if b is not None else y, y, r, float(scale), m, n, k, y.stride(0), y.stride(1),
            r.stride(0), n_programs, HAS_BIAS=b is not None, ACT=ACTS[act], IEEE=ieee,
            MERGE=merge_into is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=CHUNK,
            GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=False, **extra)
        return y.reshape(*lead, n)
    _linear_kernel[(n_tiles,)](
        xa, wa, b if b is not None else y, y, r, float(scale), m, n, k,
        x2.stride(0), x2.stride(1), w2.stride(0), w2.stride(1), y.stride(0), y.stride(1), r.stride(0),
        *dargs, HAS_BIAS=b is not None, ACT=ACTS[act], IEEE=ieee, MERGE=merge_into is not None, TMA=tma,
        EVEN_K=k % CHUNK == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=CHUNK, GROUP_M=cfg.group_m,
        DIGEST=d is not None, WBYTES=0 if d is None else d.wbytes,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **extra)
    return _done(y, d, lead, n)


def registered_config(x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype,
                      merge: bool) -> GemmConfig:
    """The launch configuration ``linear`` uses without a ``config``: by the operands' and the
    output's precision (module docstring), never by shape."""
    if not (x_dtype == torch.bfloat16 and w_dtype == torch.bfloat16):
        return FP32_CONFIG
    return BF16_WIDE_CONFIG if out_dtype.itemsize > 2 or merge else BF16_CONFIG


def persists(cfg: GemmConfig, tma: bool, act: str | None, digest: bool) -> bool:
    """Whether ``linear`` runs ``cfg`` as persistent programs: when it asks for them, with TMA
    loads, an activation none or the FP32 GELU, and no digest (a digesting epilogue's read-back
    in the flattened loop stops the software pipelining: offline sm_90a, 32 KiB of shared memory
    instead of 100; ``tools/strict_launches_sm90.py``)."""
    return bool(cfg.persistent) and tma and ACTS[act] in (0, 3) and not digest


def digestible(cfg: GemmConfig, out_dtype: torch.dtype) -> bool:
    """Whether ``linear(..., digest=True)`` writes a row table under ``cfg`` for an output of
    ``out_dtype`` (otherwise it writes none and a capture reads the output with the row kernel):
    a bf16, fp16 or FP32 output, and quarter tiles of at least 16 bytes a row (the int8
    product's depth)."""
    return out_dtype in (torch.bfloat16, torch.float16, torch.float32) and \
        cfg.block_n // 4 * out_dtype.itemsize >= 16


class _Digest:
    """The row table a digesting launch writes (``linear``'s ``digest``): ``gpu_rows.row_table``'s
    format with one column split per column tile, its key table and ``u − 128`` corrections."""

    def __init__(self, y: torch.Tensor, block_n: int) -> None:
        m, n = y.shape
        self.wbytes = y.element_size()
        self.splits = triton.cdiv(n, block_n)
        self.table = gpu_rows.empty_table(m, self.splits, y.device)
        keys = gpu_rows.byte_key_table(y.device, self.splits * block_n, self.wbytes)
        self.args = (keys, keys.shape[1], *self.table, *gpu_rows.shift_constants(n, self.wbytes))


def _done(y: torch.Tensor, d: _Digest | None, lead: torch.Size, n: int) -> torch.Tensor:
    """The output as ``[..., N]``; a digesting launch's table offered for its capture."""
    if d is not None:
        produced.offer(y, d.table)
    return y.reshape(*lead, n)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (persistent programs: one per SM); 4 on the CPU
    (Triton's interpreter), so that the tests walk several tiles per program."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
