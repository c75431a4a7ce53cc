"""Strict attention contract v2, the kernels: per-block partial sums over a head dim or over one
key block's 64 positions, from fixed-shape tiles (docs/strict-arithmetic.md, "Attention
(contract v2)").

    >>> s = rowdot(q, k)                   # q [G, Mq, D], k [G, Mk, D] FP32 → [G, Mq, Mk]
    >>> o = weighted_sum(layout, p, v, present, heads)   # [B, H, M, D]: blocks merged in order

They work on the blocked layouts of ``drifttool.ops.strict.attention_blocks`` (tiles start at
block boundaries); ``weighted_sum`` merges the block partials in its fixed order.

Kernels (chosen from the head dim alone, never from S or B):

* ``rowdot`` (Σ over the head dim: QKᵀ, dP = dO·Vᵀ): Dh ≤ 32 exact products summed by the
  pairwise tree over Dh (portable bytes); otherwise members [16, Dh] @ [Dh, 64] per
  (16-row tile, 64-key block) of the blocked layouts.
* ``block_weighted`` (Σ over one block's 64 positions: AV, dQ, dK, dV): Dh ≤ 32 exact products
  summed by the pairwise tree over the 64 slots; otherwise one member [16, 64] @ [64, Dh] per
  (16-row tile, block).
"""

from __future__ import annotations

import torch

from drifttool.ops.strict.attention_blocks import BLOCK, JointLayout, add_combine, block_partials, merge_blocks
from drifttool.ops.strict_gemm import ROW_TILE, exact_matmul
from drifttool.ops.strict_math import tree_sum

EXACT_MAX_HEAD_DIM = 32  # head dims up to this use exact products (portable bytes)

_EXACT_ELEMS = 1 << 22  # products materialised at once by the exact kernels
_TILED_ELEMS = 1 << 25  # bound on the expanded operands of one batched matmul


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_d a[g,i,d]·b[g,j,d]: a [G, Ma, D], b [G, Mb, D] FP32 → [G, Ma, Mb] FP32 (unscaled).

    D ≤ 32: ``exact_matmul`` (pairwise tree over D, correctly rounded products). Otherwise tiles
    of 16 rows of a × 64 rows of b, the whole D in one matmul member [16, D] @ [D, 64]; pass
    blocked layouts so that tiles start at block boundaries (Ma, Mb multiples of 64 there)."""
    g_, ma, d = a.shape
    mb = b.shape[1]
    if d <= EXACT_MAX_HEAD_DIM:
        return torch.stack([exact_matmul(a[i], b[i]) for i in range(g_)])
    ap = _pad_axis(a.contiguous(), 1, ROW_TILE)
    bp = _pad_axis(b.contiguous(), 1, BLOCK)
    tq, tk = ap.shape[1] // ROW_TILE, bp.shape[1] // BLOCK
    res = torch.empty(g_, tq * ROW_TILE, tk * BLOCK, device=a.device)
    step = max(1, _TILED_ELEMS // max(1, tq * tk * ROW_TILE * d))
    for i in range(0, g_, step):
        g = slice(i, min(g_, i + step))
        qt = ap[g].view(-1, tq, 1, ROW_TILE, d)  # [G,Tq,1,16,D]
        kt = bp[g].view(-1, 1, tk, BLOCK, d).transpose(-1, -2)  # [G,1,Tk,D,64]
        st = torch.matmul(qt, kt)  # [G,Tq,Tk,16,64]
        res[g] = st.permute(0, 1, 3, 2, 4).reshape(-1, tq * ROW_TILE, tk * BLOCK)
    return res[:, :ma, :mb]


def block_weighted(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-block partials Σ_{r ∈ block j} w[g,i,j,r]·x[g,j,r,:] with FP32 accumulation.

    Args:
        w: [G, M, nb, 64] FP32 (probabilities or gradients; +0 at masked/absent slots).
        x: [G, nb, 64, D] FP32 (values, keys, queries or output gradients).
    Returns:
        [nb, G, M, D] FP32: one partial per block, to be merged in the fixed order.

    D ≤ 32: correctly rounded products summed by ``tree_sum`` over the block's 64 slots.
    Otherwise one matmul member [16, 64] @ [64, D] per (16-row tile, block); M is zero-padded to
    a multiple of 16 (pass blocked layouts so tiles start at block boundaries).
    """
    g_, m, nb, _ = w.shape
    d = x.shape[-1]
    res = torch.empty(nb, g_, m, d, device=w.device)
    if d <= EXACT_MAX_HEAD_DIM:
        rows = max(1, _EXACT_ELEMS // max(1, nb * BLOCK * d))
        for g in range(g_):
            for i in range(0, m, rows):
                prod = w[g, i : i + rows, :, :, None] * x[g, None]  # [r, nb, 64, D]
                res[:, g, i : i + rows] = tree_sum(prod, dim=-2).transpose(0, 1)
        return res
    wp = _pad_axis(w.contiguous(), 1, ROW_TILE)
    tm = wp.shape[1] // ROW_TILE
    step = max(1, _TILED_ELEMS // max(1, tm * ROW_TILE * (BLOCK + d)))
    for j in range(0, nb, step):
        blk = slice(j, min(nb, j + step))
        wt = wp[:, :, blk].reshape(g_, tm, ROW_TILE, -1, BLOCK).permute(0, 3, 1, 2, 4)  # [G,nb',Tm,16,64]
        xt = x[:, blk].unsqueeze(2)  # [G,nb',1,64,D]
        part = torch.matmul(wt, xt).reshape(g_, -1, tm * ROW_TILE, d)  # [G,nb',Mp,D]
        res[blk] = part[:, :, :m].transpose(0, 1)
    return res


def weighted_sum(layout: JointLayout, w: torch.Tensor, x: torch.Tensor, present: torch.Tensor,
                 heads: int) -> torch.Tensor:
    """Σ over a blocked axis: ``block_weighted`` partials merged in the fixed order (plain FP32 adds).

    Args:
        layout: the layout of the summed axis.  w: [B·H, M, nb, 64].  x: [B·H, nb, 64, D].
        present: [B, nb] (blocks of the summed axis with a valid position).  heads: H.
    Returns:
        [B, H, M, D] FP32.
    """
    parts = block_weighted(w, x)  # [nb, BH, M, D]
    parts = parts.view(parts.shape[0], -1, heads, *parts.shape[2:])  # [nb, B, H, M, D]
    (r,) = merge_blocks(layout, block_partials((parts,), present, dim=0), add_combine).values
    return r


def _pad_axis(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    p = -(-n // multiple) * multiple
    if p == n:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, p - n]
    return torch.nn.functional.pad(x, pad)
