"""The backward of SP attention: gradients of a rank's image rows that equal one device's bytes.

    o = agrs_attention(shard, gather, run, q, k, v, key_mask, L, kwargs)   # differentiable
    o = ring_attention_grad(shard, gather, ring, q, k, v, key_mask, L)     # Ring fwd, AG/RS bwd
    t = all_to_all_grad(sends, shapes, group)                               # Ulysses, differentiable
    t = head_slice(x, lo, hi, group)                                        # replicated → my heads

All-gather / reduce-scatter attention (``agrs``). The forward gathers the image K/V rows of every
SP rank (rank order) and attends the rank's queries (text rows, replicated, and its image rows).
The backward computes, for the rank's queries only:

* dQ of its rows: dS = P·(dP − Σ_k P·dP) and dQ = Σ_keys (dS·fp32(1/√Dh))·K by the key block
  structure (the AV kernel) — per row, so the rows' bytes are one device's;
* its dK, dV **partials** over the query axis: the text query blocks (replicated, each rank the
  same) and the image query segments it holds, merged by the contract's query structure into its
  subtree (``rank_subtree``); the subtrees of every SP rank are gathered in rank order and
  finished by ``finish_ranks(text, subtrees)`` (docs/strict-arithmetic.md, "Attention (contract
  v2)", Backward) — the reduce-scatter of AG/RS, done as an ordered gather and the fixed tree,
  never a plain sum. Every rank then holds the full dK, dV; a rank's K/V input gets the text
  rows and its own image rows.

Ring attention (``distributed.ring``) gives AG/RS's forward bytes without holding every K/V
row; its backward is AG/RS's (``ring_attention_grad``), which gathers K/V for the backward.

The arithmetic is the one ``tests/ops/test_shard_attention.py`` simulates against the unsharded
strict operators (``_sp``); here it runs on real ranks. Ulysses needs no arithmetic of its own:
its all-to-all and head slices are exact moves whose backward moves the gradient back
(``all_to_all_grad``, ``head_slice``); each rank's heads run the strict fused operator's own
backward over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from drifttool.distributed.canonical import all_to_all, gather_cat, gather_list
from drifttool.ops.strict.attention_blocks import (BLOCK, Partial, add_combine, block_partials,
                                                   finish_ranks, merge_sequential, rank_segments,
                                                   rank_subtree)
from drifttool.ops.strict.attention_core import (av_blocked, geometry, heads_f32, masked_keys,
                                                 qk_scale, query_block_parts, scores_blocked,
                                                 scores_dot, softmax_backward_blocked, softmax_blocked)


@dataclass(frozen=True)
class Shard:
    """Where this SP rank stands: its image rows ``[lo, hi)``, its coordinate, the degree and the
    SP process group."""

    lo: int
    hi: int
    coord: int
    sp: int
    group: Any


class _AGAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shard, gather, run, key_mask, text_len, kwargs):
        kf, vf = gather(k), gather(v)
        ctx.shard, ctx.key_mask, ctx.text_len = shard, key_mask, text_len
        ctx.save_for_backward(q, kf, vf)
        return run(q, kf, vf, key_mask, **kwargs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        q, kf, vf = ctx.saved_tensors
        dq, dk, dv = _agrs_backward(ctx.shard, q, kf, vf, go, ctx.key_mask, ctx.text_len)
        return dq, dk, dv, None, None, None, None, None, None


def agrs_attention(shard: Shard, gather: Callable[[torch.Tensor], torch.Tensor],
                   run: Callable[..., torch.Tensor], q, k, v, key_mask, text_len: int,
                   kwargs: dict[str, Any]) -> torch.Tensor:
    """AG/RS attention of this rank's queries ``q [B, L + n_r, H, Dh]`` against every key:
    ``gather`` turns the rank's ``k``/``v`` (text rows, then its image rows) into every rank's in
    rank order; differentiable with the canonical backward (module docstring). ``run`` is the
    strict fused operator (or its decomposition at L2)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return run(q, gather(k), gather(v), key_mask, **kwargs)
    return _AGAttention.apply(q, k, v, shard, gather, run, key_mask, text_len, kwargs)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shard, gather, ring, key_mask, text_len):
        ctx.shard, ctx.gather, ctx.key_mask, ctx.text_len = shard, gather, key_mask, text_len
        ctx.save_for_backward(q, k, v)
        return ring(q, k, v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        q, k, v = ctx.saved_tensors
        kf, vf = ctx.gather(k), ctx.gather(v)
        dq, dk, dv = _agrs_backward(ctx.shard, q, kf, vf, go, ctx.key_mask, ctx.text_len)
        return dq, dk, dv, None, None, None, None, None


def ring_attention_grad(shard: Shard, gather: Callable[[torch.Tensor], torch.Tensor],
                        ring: Callable[..., torch.Tensor], q, k, v, key_mask,
                        text_len: int) -> torch.Tensor:
    """Ring attention ``ring(q, k, v)`` (``distributed.ring``: K/V blocks passed around the SP
    ranks, never all held) made differentiable with AG/RS's canonical backward: the backward
    gathers the image K/V rows (rank order) and computes dQ of the rank's rows and its dK/dV
    subtree, finished over the ranks by the fixed tree (module docstring). The Ring forward's
    output is AG/RS's bytes, so the gradient is one device's; the backward holds every K/V row
    (AG/RS's memory, not the Ring's)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return ring(q, k, v)
    return _RingAttention.apply(q, k, v, shard, gather, ring, key_mask, text_len)


def _agrs_backward(shard: Shard, q, kf, vf, go, key_mask, text_len: int):
    b, _, h, d = q.shape
    sk = kf.shape[1]
    lo, hi = shard.lo, shard.hi
    mine_q = torch.cat([torch.arange(text_len), torch.arange(text_len + lo, text_len + hi)])
    geo = geometry("sp_attention_agrs", b, sk, sk, key_mask, text_len, device=q.device)
    lq = geo.lq

    def blocked_rows(t: torch.Tensor) -> torch.Tensor:  # this rank's rows at their global place
        full = t.new_zeros((b, sk, h, d), dtype=torch.float32)
        full[:, mine_q] = t.to(torch.float32)
        return lq.to_blocked(heads_f32(full), 2)

    qb, gob = blocked_rows(q), blocked_rows(go)
    kb = geo.lk.to_blocked(heads_f32(kf), 2)
    vb = masked_keys(geo, geo.lk.to_blocked(heads_f32(vf), 2))
    kbm = masked_keys(geo, kb)
    scale = qk_scale(d)

    def rows_of(blocks: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in blocks])

    dq_blocked = torch.zeros_like(qb)

    def parts(blocks: list[int]):
        """dQ of the rows of ``blocks`` and their dK, dV per-query-block partials."""
        rows = rows_of(blocks)
        p, _, _ = softmax_blocked(geo, scores_blocked(qb[:, :, rows], kb))
        dp = torch.where(geo.valid_k[:, None, None, :], scores_dot(gob[:, :, rows], vb), torch.zeros(()))
        g = softmax_backward_blocked(geo, p, dp) * scale
        dq_blocked[:, :, rows] = av_blocked(geo, g, kbm)
        pc = p.to(vf.dtype).to(torch.float32)
        pres = geo.present_q[:, blocks]
        return (block_partials((torch.stack(query_block_parts(g, qb[:, :, rows])),), pres),
                block_partials((torch.stack(query_block_parts(pc, gob[:, :, rows])),), pres))

    text_blocks = list(range(lq.text_blocks))
    tk, tv = parts(text_blocks) if text_blocks else ([], [])
    owned = rank_segments(lq, shard.sp)[shard.coord]
    mine = {lo_: parts(list(range(lo_, hi_))) for lo_, hi_ in owned if hi_ > lo_}
    sub_k = rank_subtree(owned, lambda bl: mine[bl[0]][0], add_combine)
    sub_v = rank_subtree(owned, lambda bl: mine[bl[0]][1], add_combine)
    group = shard.group
    out = []
    for text, sub, like in ((tk, sub_k, kf), (tv, sub_v, vf)):
        subtrees = _gather_subtrees(sub, (b, h, geo.lk.padded, d), q.device, group)
        full = finish_ranks(merge_sequential(text, add_combine) if text else None, subtrees, add_combine)
        t = geo.lk.from_blocked(masked_keys(geo, full.values[0]), 2).permute(0, 2, 1, 3)
        out.append(torch.cat([t[:, :text_len], t[:, text_len + lo:text_len + hi]], 1).to(like.dtype))
    dq = lq.from_blocked(dq_blocked, 2).permute(0, 2, 1, 3)[:, mine_q].to(q.dtype)
    return dq, out[0], out[1]


def _gather_subtrees(sub: Partial | None, shape: tuple[int, ...], device, group: Any) -> list[Partial]:
    """Every SP rank's subtree partial in rank order (values and per-sample presence gathered;
    a rank without image query rows contributes an absent partial, which the merge skips)."""
    b = shape[0]
    vals = torch.zeros(shape, dtype=torch.float32, device=device) if sub is None else sub.values[0]
    pres = torch.zeros(b, dtype=torch.uint8, device=device) if sub is None else \
        sub.present.reshape(b).to(torch.uint8)
    return [Partial((v,), p.bool().view(-1, 1, 1, 1))
            for v, p in zip(gather_list(vals.contiguous(), group), gather_list(pres, group))]


# ---------------------------------------------------------------------------------------------
# Ulysses: exact moves with their backward


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, shapes, *sends):
        ctx.group = group
        ctx.send_shapes = [tuple(s.shape) for s in sends]
        return tuple(all_to_all(list(sends), shapes, group))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        back = all_to_all([g.contiguous() for g in grads], ctx.send_shapes, ctx.group)
        return (None, None, *back)


def all_to_all_grad(sends: list[torch.Tensor], shapes: list[tuple[int, ...]], group: Any) -> list[torch.Tensor]:
    """``canonical.all_to_all``, differentiable: the backward sends each gradient back to the
    rank its part came from (exact moves both ways)."""
    if group is None:
        return [sends[0]]
    return list(_AllToAll.apply(group, shapes, *sends))


class _HeadSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lo, hi, group):
        ctx.group = group
        return x[:, :, lo:hi].contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return gather_cat(g.contiguous(), 2, ctx.group), None, None, None


def head_slice(x: torch.Tensor, lo: int, hi: int, group: Any) -> torch.Tensor:
    """Heads [lo, hi) of a tensor ``[B, S, H, Dh]`` every rank of ``group`` holds whole (the
    replicated text rows); rank j of the group takes the j-th equal slice. Backward: every
    rank's slice gradient gathered over the heads in rank order, so each rank gets the whole
    gradient (each head's gradient comes from exactly one rank)."""
    if group is None:
        return x[:, :, lo:hi]
    return _HeadSlice.apply(x, lo, hi, group)
