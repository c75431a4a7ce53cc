"""Strict CUDA GEMV (contract ``cuda1``): ``act(x·wᵀ + b)`` for few rows with an FP32 operand.

    >>> y = gemv(x, w, b, act="silu")                 # x [..., K], w [N, K], b [N] → [..., N]

One program per row, 64 lane sums over K, a pairwise lane tree: its own exactly stated order
(``gemv``'s docstring), used by operator (``adaln_mod_projection``, ``timestep_embed_mlp``),
never chosen by shape instead of ``kernels.gemm.linear``. Operands are checked as ``linear``'s;
the activation is the GEMM epilogue's (``kernels.exact_math``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_cuda.kernels.exact_math import ACTS, _activate
from drifttool.ops.strict_cuda.kernels.gemm import _check, _rows


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
