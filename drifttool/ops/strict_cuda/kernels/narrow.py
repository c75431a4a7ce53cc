"""Strict CUDA GEMMs whose output is a LoRA rank wide (contract ``cuda1``): K in fixed segments.

    >>> u = linear(x, a)             # x [..., K] bf16 or FP32, a [r, K] FP32 → [..., r] FP32

An unfused adapter's u = x·Aᵀ (forward) and du = dt·B (backward) have r = 16 output columns. Walked
as ``kernels.gemm`` walks K (one chain per output tile), they leave the GPU nearly idle: M/32
programs, each a chain of K/64 dependent chunks (about 100 µs on an H100 for 128 rows as for
4,096, docs/benchmarks.md). Here K is cut into segments, which run as programs of their own.

Order of every output element y[m, n] (the contract; docs/strict-arithmetic.md, "Unfused LoRA"):

1. [0, K) is cut into **segments** of ``SEG_K`` = 256 columns from k = 0 (the last one shorter);
2. segment s's partial is ``kernels.gemm``'s order over the segment's columns alone: chunks of
   ``CHUNK`` = 64 from the segment's start, each chunk's products accumulated by the IEEE FP32
   dot (both operands upcast to FP32, never TF32) into an accumulator that starts at +0, chunk
   after chunk, the K tail zero-filled; so a partial equals ``kernels.gemm.linear`` of the
   segment's columns, byte for byte;
3. y = ((p0 + p1) + p2) + … in ascending segment order, each an FP32 addition (one segment: y = p0,
   the bytes of ``kernels.gemm.linear``).

Nothing depends on M, the row's position or the batch (a row's loads, products and sums involve
that row alone), and the segment length is fixed, not chosen from the shape: row invariance holds
as in ``kernels.gemm``. The tile (``CONFIG``) changes no byte. The kernels call only Triton
builtins (see ``kernels.gemm``'s module docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drifttool.ops.strict_cuda.kernels.gemm import CHUNK, GemmConfig, _check, _mma, _rows

SEG_K = 256
"""Columns of K per segment (part of the contract: the partials are added in order, so the
segment length fixes the bytes). A multiple of ``CHUNK``."""

CONFIG = GemmConfig(block_m=32, block_n=16, num_warps=2, num_stages=3, tma=False)
"""One segment's tile: 32 × 16 on 2 warps (a rank of 16 fills one column tile), three stages
loading the next chunks while a chunk's FMAs run. The same bytes as any tile."""

KERNEL_ID = f"triton.narrow.k{CHUNK}.seg{SEG_K}.seq.fp32.ieee.{CONFIG.id}"
"""Kernel identity (part of the adapted block GEMMs' kernel id in the trace)."""

SUM_BLOCK = 1024
"""Elements per program of the partials' sum."""


@triton.jit(do_not_specialize=["M"])
def _parts_kernel(X, W, P, M, N, K, SEG, sxm, sxk, swn, swk, sps, spm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """P[s, m, n] = Σ x[m, k]·w[n, k] over segment s's columns, in BLOCK_K chunks from its start
    (``kernels.gemm``'s chain on [s·SEG, min((s + 1)·SEG, K)))."""
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (rm % M).to(tl.int64)  # rows past M re-read valid rows; never stored
    offs_n = (rn % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    start = s * SEG
    end = tl.minimum(start + SEG, K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(start, end, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(X + offs_m[:, None] * sxm + kk[None, :] * sxk, mask=kk[None, :] < end, other=0.0)
        w = tl.load(W + offs_n[:, None] * swn + kk[None, :] * swk, mask=kk[None, :] < end, other=0.0)
        acc = _mma(a, w, acc, True)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(P + s.to(tl.int64) * sps + rm.to(tl.int64)[:, None] * spm + rn[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["NSEG"])
def _sum_kernel(P, Y, NUMEL, NSEG, sps, BLOCK: tl.constexpr):
    """Y = ((P[0] + P[1]) + P[2]) + … over the NSEG segments, in FP32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    part = P + offs  # 64-bit addresses: segment s is s·sps elements further
    acc = tl.load(part, mask=ok, other=0.0)
    for _ in range(1, NSEG):
        part += sps
        acc = acc + tl.load(part, mask=ok, other=0.0)
    tl.store(Y + offs, acc, mask=ok)


def linear(x: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """x·wᵀ in FP32 by K segments (module docstring).

    Args:
        x: [..., K] bf16 or FP32 (leading axes flattened to rows).
        w: [N, K] FP32 (or bf16; any strides).
        config: the segment's tile (tests and benchmarks prove the bytes do not depend on it);
            default ``CONFIG``.
    Returns:
        [..., N] FP32, on x's device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Raises:
        UnsupportedConfigError: operand dtypes other than bf16/FP32, mismatched K, tensors on
            different devices.
    """
    _check(x, w, None, "rank-wide linear")
    cfg = config or CONFIG
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    x2, w2 = _rows(x.reshape(lead.numel(), k)), _rows(w)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if k == 0:
        return y.zero_().reshape(*lead, n)
    segs = triton.cdiv(k, SEG_K)
    parts = y if segs == 1 else torch.empty((segs, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), segs)
    _parts_kernel[grid](x2, w2, parts, m, n, k, SEG_K, x2.stride(0), x2.stride(1), w2.stride(0),
                        w2.stride(1), m * n, n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        BLOCK_K=CHUNK, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        enable_fp_fusion=False)
    if segs > 1:
        _sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](parts, y, m * n, segs, m * n, BLOCK=SUM_BLOCK,
                                                      enable_fp_fusion=False)
    return y.reshape(*lead, n)

