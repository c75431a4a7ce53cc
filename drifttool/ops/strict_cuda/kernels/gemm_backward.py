"""Strict CUDA GEMM backward kernels (contract ``cuda1``): per-sample weight and bias partials,
and the tanh-GELU derivative of ``mlp_up_gemm_gelu``'s epilogue.

    >>> parts = weight_grad_parts(dy3, x3, live)     # dy [B, R, N], x [B, R, K] → [B, N, K] FP32
    >>> sums = bias_grad_parts(dy3, live)             # [B, N] FP32
    >>> dpre = gelu_tanh_f32_grad(dy, pre, out_dtype) # dy · GELU'(pre), one cast

Order of every element (the contract; docs/strict-arithmetic.md, "Strict CUDA backward"):

* ``weight_grad_parts``: the sample's live rows ``r < live[b]`` are cut into **segments** of
  ``SEG_ROWS`` = 512 rows from r = 0 when dW has fewer than ``SPLIT_TILES`` = 256 output tiles (a
  LoRA factor's dA [r, K] or dB [N, r]: too few tiles to fill the GPU), else into one segment (a
  full weight's dW). One program per (BLOCK_N × BLOCK_K tile of dW, segment, sample) walks its
  segment's rows in chunks of ``ROW_CHUNK`` = 64 rows ascending (no atomics); chunk c's products
  dy[b, r, n]·x[b, r, k] are accumulated into an FP32 accumulator that starts at +0 by the MMA
  (``tl.dot(dyᵀ, x, acc)``), chunk after chunk; the rows of the last chunk at or past the
  segment's end are zero-filled (zero products). A sample's segment partials are then added in
  ascending segment order, each an FP32 addition, from +0 (``_segsum_kernel``; the segments at or
  past ``live[b]`` are not added). Operands: bf16 × bf16 on the tensor cores, else both upcast and
  multiplied in IEEE FP32 (never TF32). The tiles and the split follow dW's shape [N, K] only
  (``wgrad_config``), never the rows or the batch: a sample's partial depends on that sample's
  rows alone, not on the other samples, its position in the batch, B, or rows past ``live[b]``.
* ``bias_grad_parts``: one program per (BLOCK_N columns, sample b): s = ((0 + dy[b, 0]) +
  dy[b, 1]) + … over r < live[b] ascending, each an FP32 addition (the loads of ``UNROLL`` rows
  issued together, the additions one after the other): IEEE FP32 in a stated order, so its bytes
  are the same on any device (torch reproduces them).
* ``gelu_tanh_f32_grad``: elementwise, FP32 from exact FP32 operations in this order (each
  rounded, no FMA): u = c0·(x + c1·((x·x)·x)); s = 1 / (1 + e^(−2u)) (``kernels.exact_math``'s FP32
  exp, IEEE division); du = c0·(1 + c3·(x·x)) (c3 = fp32(3·0.044715)); GELU'(x) =
  s + x·((s·(1 − s))·(2·du)); then g·GELU'(x) (g upcast), one cast to ``out_dtype``. It is the
  derivative of the forward's FP32 formula x·σ(2u), not the CPU's FP64 ``gelu_tanh_grad32``.

The kernels call only Triton builtins (see ``kernels.gemm``'s module docstring for why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_cuda.kernels.exact_math import _exp_f32, _f

ROW_CHUNK = 64
"""Rows per MMA chunk of the weight-gradient reduction (part of the contract)."""

SEG_ROWS, SPLIT_TILES = 512, 256
"""Rows per segment of a weight gradient with fewer than ``SPLIT_TILES`` output tiles (part of the
contract: the segments' partials are added in order, so the segment length fixes the bytes)."""


@dataclass(frozen=True)
class WgradConfig:
    """One weight-gradient launch: the dW tile, warps, pipeline depth and the segment length in
    rows (None: one segment, the sample's live rows in one chain)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    seg_rows: int | None

    @property
    def id(self) -> str:
        seg = f".seg{self.seg_rows}" if self.seg_rows else ""
        return f"bn{self.block_n}bk{self.block_k}w{self.num_warps}s{self.num_stages}{seg}"


WGRAD_BF16 = WgradConfig(128, 128, 8, 3, None)
"""bf16 × bf16 weight-gradient tiles (the forward GEMM's BF16 tile and pipeline)."""


def _fit(d: int) -> int:
    """A tile side for an FP32 dW axis of d: 16, 32 or 64 (a LoRA rank fills its tile)."""
    return 16 if d <= 16 else 32 if d <= 32 else 64


def wgrad_config(n: int, k: int, ieee: bool) -> WgradConfig:
    """The launch of a dW [n, k] (module docstring): bf16 operands the tensor-core tile, an FP32
    operand tiles of ``_fit`` per axis; fewer than ``SPLIT_TILES`` tiles: segments of
    ``SEG_ROWS`` rows. A function of dW's shape and the operand precision only."""
    cfg = WgradConfig(_fit(n), _fit(k), 4, 1, None) if ieee else WGRAD_BF16
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k)
    return replace(cfg, seg_rows=SEG_ROWS) if tiles < SPLIT_TILES else cfg


BIAS_BLOCK_N, BIAS_UNROLL = 128, 8
"""The bias sums' columns per program and rows whose loads are issued together."""

KERNEL_ID = (f"triton.wgrad.rows{ROW_CHUNK}.seq.persample.{WGRAD_BF16.id}|fp32.ieee.fit64w4s1"
             f".seg{SEG_ROWS}<{SPLIT_TILES}tiles+bgrad.rows.seq.bn{BIAS_BLOCK_N}u{BIAS_UNROLL}"
             f"+gelu_tanh_f32_grad")
"""Kernel identity of the backward kernels."""

_OPERANDS = (torch.float32, torch.bfloat16)


@triton.jit(do_not_specialize=["SEG"])
def _wgrad_kernel(DY, X, LIVE, P, N, K, SEG, sdb, sdr, sdn, sxb, sxr, sxk, spb, sps, spn,
                  IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """P[b, s, n-tile, k-tile] = Σ dy[b, r, n]·x[b, r, k] over the rows r of segment s
    (s·SEG ≤ r < min((s + 1)·SEG, LIVE[b])), in BLOCK_R chunks from the segment's start."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_pid_k = (K + BLOCK_K - 1) // BLOCK_K
    pid_n = pid // num_pid_k
    pid_k = pid % num_pid_k
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    start = s * SEG
    end = tl.minimum(start + SEG, tl.load(LIVE + b))
    dy_base = DY + b * sdb
    x_base = X + b * sxb
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + rr
        ok = rows < end
        dy = tl.load(dy_base + rows.to(tl.int64)[:, None] * sdr + rn[None, :] * sdn,
                     mask=ok[:, None] & (rn[None, :] < N), other=0.0)  # [BLOCK_R, BLOCK_N]
        x = tl.load(x_base + rows.to(tl.int64)[:, None] * sxr + rk[None, :] * sxk,
                    mask=ok[:, None] & (rk[None, :] < K), other=0.0)  # [BLOCK_R, BLOCK_K]
        if IEEE:
            acc = tl.dot(tl.trans(dy.to(tl.float32)), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(dy), x, acc)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    tl.store(P + b * spb + s.to(tl.int64) * sps + rn.to(tl.int64)[:, None] * spn + rk[None, :], acc,
             mask=mask)


@triton.jit(do_not_specialize=["SEG"])
def _segsum_kernel(PS, LIVE, OUT, NK, SEG, spb, sps, sob, BLOCK: tl.constexpr):
    """OUT[b] = ((+0 + PS[b, 0]) + PS[b, 1]) + … over the segments s·SEG < LIVE[b], in FP32."""
    b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NK
    nseg = (tl.load(LIVE + b) + SEG - 1) // SEG
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in range(0, nseg):
        acc = acc + tl.load(PS + b * spb + s * sps + offs, mask=ok, other=0.0)
    tl.store(OUT + b * sob + offs, acc, mask=ok)


@triton.jit(do_not_specialize=["sdr"])
def _bgrad_kernel(DY, LIVE, S, N, sdb, sdr, ssb, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    """S[b, n] = ((0 + dy[b, 0, n]) + dy[b, 1, n]) + … over r < LIVE[b], ascending, in FP32."""
    b = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = rn < N
    live = tl.load(LIVE + b)
    base = DY + b * sdb + rn
    step = sdr.to(tl.int64)  # row offsets in int64 (a sample may hold more than 2^31 elements)
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    whole = (live // UNROLL) * UNROLL
    for r0 in range(0, whole, UNROLL):
        for u in tl.static_range(UNROLL):
            acc = acc + tl.load(base + (r0 + u) * step, mask=live_n, other=0.0).to(tl.float32)
    for r in range(whole, live):
        acc = acc + tl.load(base + r * step, mask=live_n, other=0.0).to(tl.float32)
    tl.store(S + b * ssb + rn, acc, mask=live_n)


@triton.jit
def _gelu_tanh_f32_prime(x):
    """d/dx of the forward's FP32 GELU x·σ(2u) (module docstring, in its order)."""
    u = _f(0.7978845608028654) * (x + _f(0.044715) * ((x * x) * x))
    s = tl.div_rn(_f(1.0), _f(1.0) + _exp_f32(_f(-2.0) * u))
    du = _f(0.7978845608028654) * (_f(1.0) + _f(0.134145) * (x * x))
    return s + x * ((s * (_f(1.0) - s)) * (_f(2.0) * du))


@triton.jit
def _gelu_grad_kernel(G, PRE, OUT, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    pre = tl.load(PRE + offs, mask=ok, other=0.0)
    tl.store(OUT + offs, (g * _gelu_tanh_f32_prime(pre)).to(OUT.dtype.element_ty), mask=ok)


def _check3(what: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype not in _OPERANDS:
            raise UnsupportedConfigError(f"strict CUDA {what}: operand {t.dtype}; bf16 or float32 only")
        if t.dim() != 3 or t.device != ts[0].device:
            raise UnsupportedConfigError(f"strict CUDA {what}: needs [B, R, C] tensors on one device")


def weight_grad_parts(dy: torch.Tensor, x: torch.Tensor, live: torch.Tensor,
                      config: WgradConfig | None = None) -> torch.Tensor:
    """Per-sample weight-gradient partials Σ_{r < live[b]} dy[b, r] ⊗ x[b, r] (module docstring).

    Args:
        dy: [B, R, N] bf16 or FP32 (the output gradient, a sample's rows on axis 1).
        x: [B, R, K] bf16 or FP32 (the forward input).
        live: [B] int64 on the same device: the rows of each sample that take part (≤ R).
        config: launch override (benchmarks); default ``wgrad_config`` of dW's shape. Its tile
            changes no byte; its ``seg_rows`` does (the contract's is ``SEG_ROWS`` or none).
    Returns:
        [B, N, K] FP32 (a sample with no live row: +0).
    Raises:
        UnsupportedConfigError: other dtypes, shapes or devices.
    """
    _check3("weight gradient", dy, x)
    bsz, rows, n = dy.shape
    k = x.shape[2]
    if x.shape[:2] != (bsz, rows) or live.shape != (bsz,) or live.device != dy.device:
        raise UnsupportedConfigError(f"strict CUDA weight gradient: dy {tuple(dy.shape)}, x {tuple(x.shape)}, "
                                     f"live {tuple(live.shape)} do not match")
    ieee = not (dy.dtype == torch.bfloat16 and x.dtype == torch.bfloat16)
    cfg = config or wgrad_config(n, k, ieee)
    p = torch.empty((bsz, n, k), dtype=torch.float32, device=dy.device)
    if p.numel() == 0:
        return p
    live = live.to(torch.int64).contiguous()
    segs = triton.cdiv(max(rows, 1), cfg.seg_rows) if cfg.seg_rows else 1
    ps = p if segs == 1 else torch.empty((bsz, segs, n, k), dtype=torch.float32, device=dy.device)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(k, cfg.block_k), segs, bsz)
    _wgrad_kernel[grid](dy, x, live, ps, n, k, cfg.seg_rows or max(rows, 1),
                        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
                        ps.stride(0), n * k if segs > 1 else 0, k, IEEE=ieee, BLOCK_N=cfg.block_n,
                        BLOCK_K=cfg.block_k, BLOCK_R=ROW_CHUNK, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, enable_fp_fusion=False)
    if segs > 1:
        _segsum_kernel[(triton.cdiv(n * k, 1024), bsz)](ps, live, p, n * k, cfg.seg_rows, ps.stride(0),
                                                         n * k, p.stride(0), BLOCK=1024,
                                                         enable_fp_fusion=False)
    return p


def bias_grad_parts(dy: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Per-sample column sums over the live rows, sequential in FP32 (module docstring).

    Args:
        dy: [B, R, N] bf16 or FP32.  live: [B] int64 on dy's device.
    Returns:
        [B, N] FP32.
    """
    _check3("bias gradient", dy)
    bsz, _, n = dy.shape
    d = dy if dy.stride(2) == 1 else dy.contiguous()
    s = torch.empty((bsz, n), dtype=torch.float32, device=dy.device)
    if s.numel():
        _bgrad_kernel[(triton.cdiv(n, BIAS_BLOCK_N), bsz)](
            d, live.to(torch.int64).contiguous(), s, n, d.stride(0), d.stride(1), s.stride(0),
            BLOCK_N=BIAS_BLOCK_N, UNROLL=BIAS_UNROLL, enable_fp_fusion=False)
    return s


def gelu_tanh_f32_grad(g: torch.Tensor, pre: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """g·GELU'(pre) for the forward's FP32 GELU (module docstring), one cast to ``out_dtype``.

    Args:
        g: output gradient, bf16 or FP32.  pre: FP32 pre-activation, g's shape.
    Returns:
        ``out_dtype``, g's shape, on g's device.
    """
    if pre.dtype != torch.float32 or pre.shape != g.shape or g.dtype not in _OPERANDS:
        raise UnsupportedConfigError(f"strict CUDA GELU backward: g {g.dtype} {tuple(g.shape)}, pre "
                                     f"{pre.dtype} {tuple(pre.shape)}; FP32 pre of g's shape needed")
    gc, pc = g.contiguous(), pre.contiguous()
    out = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    if gc.numel():
        _gelu_grad_kernel[(triton.cdiv(gc.numel(), 1024),)](gc, pc, out, gc.numel(), BLOCK=1024,
                                                            enable_fp_fusion=False)
    return out
