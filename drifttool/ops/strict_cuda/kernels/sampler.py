"""Triton kernels of the strict CUDA family's sampler operators: ``cfg_combine_renorm`` and the
elementwise body and log-probability mean of ``flow_sde_step_logp`` (contract ``cuda1``).

The arithmetic is the strict CPU family's (``drifttool.ops.scheduler``), in the same order, with
the same conventions as ``kernels.rows``: one IEEE FP32 operation per step, no FMA contraction
(``enable_fp_fusion=False``), FP32 divisions by ``tl.div_rn``, square roots in FP64 rounded once,
and every sum the canonical pairwise tree of ``strict_trees.tree_sum`` — so the bytes equal the
CPU's.

* CFG: one program owns ``ROWS`` whole tokens; the two norms per token are pairwise trees over
  the C channels in registers.
* SDE log-probability: per sample, the N·C flattened elements, zero-padded to P = the next power
  of two, are summed by the pairwise tree in aligned chunks of W = min(1024, P) elements: the
  first kernel writes each chunk's tree sum (one program per (sample, chunk)), then
  ``tree_rows`` reduces the chunk sums the same way, level after level, until one is left. The
  chunks are aligned subtrees of the P-leaf tree, and a chunk past the data sums to +0 exactly
  as the tree's zero padding does, so the result is ``tree_sum`` over the sample's elements,
  whatever the batch or the launch. The last level divides by the element count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drifttool.ops.strict_cuda.kernels.rows import ELEMENTS, _launch, _pair_tree, pow2

TREE_CHUNK = 1024
"""Elements per program of the log-probability tree (an aligned subtree of the per-sample tree)."""


@triton.jit
def _sqrt32(t):
    """sqrt in FP64 (``sqrt.rn.f64``: correctly rounded), rounded once to FP32 (``strict_math.sqrt32``)."""
    return tl.sqrt(t.to(tl.float64)).to(tl.float32)


@triton.jit
def _cfg_kernel(c_ptr, u_ptr, s_ptr, o_ptr, rows, C: tl.constexpr, LOG2: tl.constexpr,
                ROWS: tl.constexpr):
    """Per token: comb = u + s·(c − u); ‖c‖, ‖comb‖ = sqrt32(tree_sum(a·a)); v = comb·(‖c‖ ÷ ‖comb‖)."""
    P: tl.constexpr = 2**LOG2
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, P)
    m = (r[:, None] < rows) & (k[None, :] < C)
    off = r[:, None] * C + k[None, :]
    c = tl.load(c_ptr + off, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr)
    comb = u + s * (c - u)
    c_norm = _sqrt32(_pair_tree(c * c, LOG2))
    comb_norm = _sqrt32(_pair_tree(comb * comb, LOG2))
    ratio = tl.div_rn(c_norm, comb_norm)
    tl.store(o_ptr + off, comb * ratio[:, None], mask=m)


def cfg_combine_renorm(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, *,
                       rows_per_program: int | None = None) -> torch.Tensor:
    """``scheduler.cfg_combine_renorm_strict``'s forward: v_cond, v_uncond [..., C] (FP32/BF16,
    same shape) → [..., C] FP32; ``scale`` rounded once to FP32."""
    c, u = v_cond.contiguous(), v_uncond.contiguous()
    ch = c.shape[-1]
    rows = c.numel() // ch
    o = torch.empty(c.shape, dtype=torch.float32, device=c.device)
    if rows:
        per = rows_per_program or max(1, 1024 // pow2(ch))
        s = torch.tensor([scale], dtype=torch.float32).to(c.device)
        _launch(_cfg_kernel, (triton.cdiv(rows, per),), c, u, s, o, rows, C=ch,
                LOG2=pow2(ch).bit_length() - 1, ROWS=per)
    return o


@triton.jit
def _sde_kernel(x_ptr, v_ptr, e_ptr, prev_ptr, coef_ptr, mu_ptr, xn_ptr, part_ptr, n, chunks,
                HAS_PREV: tl.constexpr, LOG2: tl.constexpr):
    """Program (b, chunk): coef[b] = (a, c, Δ, s, 2·s·s, ln s, ln√(2π)) FP32.
    mu = x·a + (v·c)·Δ; x_next = mu + s·noise, or prev_sample; d = x_next − mu;
    ℓ = (−(d·d) ÷ (2·s·s) − ln s) − ln√(2π); part[b, chunk] = tree_sum(ℓ over the chunk)."""
    W: tl.constexpr = 2**LOG2
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    k = j * W + tl.arange(0, W)
    m = k < n
    off = b * n + k
    a = tl.load(coef_ptr + b * 7)
    c = tl.load(coef_ptr + b * 7 + 1)
    dt = tl.load(coef_ptr + b * 7 + 2)
    s = tl.load(coef_ptr + b * 7 + 3)
    two_var = tl.load(coef_ptr + b * 7 + 4)
    log_s = tl.load(coef_ptr + b * 7 + 5)
    log_sqrt_2pi = tl.load(coef_ptr + b * 7 + 6)
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + off, mask=m, other=0.0).to(tl.float32)
    mu = x * a + (v * c) * dt
    if HAS_PREV:
        xn = tl.load(prev_ptr + off, mask=m, other=0.0).to(tl.float32)
    else:
        xn = mu + s * tl.load(e_ptr + off, mask=m, other=0.0)
    tl.store(mu_ptr + off, mu, mask=m)
    tl.store(xn_ptr + off, xn, mask=m)
    d = xn - mu
    elem = (tl.div_rn(-(d * d), tl.zeros_like(d) + two_var) - log_s) - log_sqrt_2pi
    elem = tl.where(m, elem, 0.0)
    total = _pair_tree(tl.reshape(elem, (1, W)), LOG2)
    tl.store(part_ptr + b * chunks + j + tl.arange(0, 1), total)


@triton.jit
def _tree_rows_kernel(x_ptr, o_ptr, n, chunks, count_ptr, DIVIDE: tl.constexpr, LOG2: tl.constexpr):
    """Program (row, chunk): o[row, chunk] = tree_sum(x[row, chunk·W : (chunk+1)·W]) (zeros past n),
    divided by count[0] (FP32, correctly rounded) when ``DIVIDE``."""
    W: tl.constexpr = 2**LOG2
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    k = j * W + tl.arange(0, W)
    x = tl.load(x_ptr + r * n + k, mask=k < n, other=0.0)
    total = _pair_tree(tl.reshape(x, (1, W)), LOG2)
    if DIVIDE:
        total = tl.div_rn(total, tl.load(count_ptr + tl.arange(0, 1)))
    tl.store(o_ptr + r * chunks + j + tl.arange(0, 1), total)


def tree_rows(x: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """``strict_trees.tree_sum`` over the last axis of x [R, n] FP32 (n ≥ 1) → [R], by levels of
    aligned ``TREE_CHUNK``-wide subtrees; ÷ count ([1] FP32) at the last level when given."""
    while True:
        rows, n = x.shape
        w = min(TREE_CHUNK, pow2(n))
        chunks = triton.cdiv(n, w)
        o = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
        last = chunks == 1
        _launch(_tree_rows_kernel, (rows, chunks), x, o, n, chunks, count if count is not None else x,
                DIVIDE=last and count is not None, LOG2=w.bit_length() - 1)
        x = o
        if last:
            return x[:, 0]


def sde_step(x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor | None, prev: torch.Tensor | None,
             coef: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SDE step's per-element body and its log-probability mean.

    Args:
        x, v: [B, ...] (FP32/BF16, widened in the kernel).  noise: [B, ...] FP32 or None.
        prev: [B, ...] the stored next latent (FP32/BF16) or None (then noise is used).
        coef: [B, 7] FP32 per-sample constants (a, c, Δ, s, 2·(s·s), ln s, ln√(2π)), computed on
            the host exactly as the CPU family does.  count: [1] FP32, the element count per sample.
    Returns:
        (x_next, logp [B], mu), FP32; x_next and mu of x's shape.
    """
    x, v = x.contiguous(), v.contiguous()
    bsz = x.shape[0]
    n = x[0].numel()
    mu = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    xn = torch.empty_like(mu)
    w = min(TREE_CHUNK, pow2(n))
    chunks = triton.cdiv(n, w)
    part = torch.empty(bsz, chunks, dtype=torch.float32, device=x.device)
    e = noise.contiguous() if noise is not None else x
    p = prev.contiguous() if prev is not None else x
    _launch(_sde_kernel, (bsz, chunks), x, v, e, p, coef.contiguous(), mu, xn, part, n, chunks,
            HAS_PREV=prev is not None, LOG2=w.bit_length() - 1)
    return xn, tree_rows(part, count), mu


@triton.jit
def _euler_kernel(x_ptr, v_ptr, dt_ptr, o_ptr, n, total, BLOCK: tl.constexpr):
    """mu = x + Δ[b]·v (FP32, the product rounded first)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    dt = tl.load(dt_ptr + o // n, mask=m, other=0.0)
    x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + o, x + dt * v, mask=m)


def euler(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """x + Δ·v FP32: x, v [B, ...] (FP32/BF16), dt [B] FP32 → [B, ...] FP32."""
    x, v = x.contiguous(), v.contiguous()
    mu = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    total = mu.numel()
    if total:
        _launch(_euler_kernel, (triton.cdiv(total, ELEMENTS),), x, v, dt.contiguous(), mu,
                max(1, x[0].numel()), total, BLOCK=ELEMENTS)
    return mu
