"""Strict ``joint_attention_fused`` (contract v2): a blocked two-pass implementation over
(query chunk × 64-key block) that never materialises the [B,H,S,S] scores, byte-equal to the
three unfused strict operators (``drifttool.ops.strict.attention``), forward and backward.

Why it is byte-equal: every number is produced by the same functions of
``attention_blocks`` / ``attention`` on the same values. Query rows are independent in the
forward (scores, block states, merge, P, AV all act per row), so cutting the query axis into
chunks of whole 64-row blocks changes no byte: the per-element kernels (exact trees, or one
fixed matmul member per (16-row tile, 64-key block)) see the same operands. The backward's
reductions over queries (dK, dV) collect one partial per query block from the chunks and merge
them in the fixed order of the query axis, as the unfused backward does.

Pass 1 per chunk: scores → block states (m_b, l_b) → merged (m, l). Pass 2: P, the declared cast
to the activation dtype, AV by key blocks. The (m, l) of every row are kept for the backward
(FP32 [B,H,S]), which recomputes scores and P per chunk.
"""

from __future__ import annotations

import torch

from drifttool.ops.strict._checks import out, strict_cpu
from drifttool.ops.strict.attention_blocks import (
    BLOCK,
    add_combine,
    block_partials,
    merge_blocks,
    softmax_probs,
)
from drifttool.ops.strict.attention_core import (
    AttnGeometry,
    av_blocked,
    check_joint,
    geometry,
    heads_f32,
    masked_keys,
    qk_scale,
    query_block_parts,
    scores_blocked,
    scores_dot,
    softmax_backward_blocked,
    softmax_blocked,
)
from drifttool.ops.strict.grad import cast_like, g32

QUERY_CHUNK_ELEMS = 1 << 22  # bound on one chunk's [B, H, rows, Pk] tensors, in query blocks and samples (bytes do not depend on it)


def _chunks(geo: AttnGeometry, bh: int, elems: int):
    """Query row ranges [lo, hi) of the blocked layout, whole 64-row blocks each."""
    pq, pk = geo.lq.padded, geo.lk.padded
    rows = BLOCK * max(1, elems // max(1, bh * pk * BLOCK))
    for lo in range(0, pq, rows):
        yield lo, min(pq, lo + rows)


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, text_len, elems):
        dt = v.dtype
        b, sq, h, d = q.shape
        geo = geometry("joint_attention_fused", b, sq, k.shape[1], key_mask, text_len, q.device)
        qb, kb = geo.lq.to_blocked(heads_f32(q), 2), geo.lk.to_blocked(heads_f32(k), 2)
        vb = masked_keys(geo, geo.lk.to_blocked(heads_f32(v), 2))
        y = torch.empty(b, h, geo.lq.padded, v.shape[-1], device=q.device)
        m_all = torch.empty(b, h, geo.lq.padded, device=q.device)
        l_all = torch.empty(b, h, geo.lq.padded, device=q.device)
        for lo, hi in _chunks(geo, b * h, elems):
            p, m, l = softmax_blocked(geo, scores_blocked(qb[:, :, lo:hi], kb))  # pass 1 (+ P)
            pc = p.to(dt).to(torch.float32)  # the declared cast: P → activation dtype
            y[:, :, lo:hi] = av_blocked(geo, pc, vb)  # pass 2
            m_all[:, :, lo:hi], l_all[:, :, lo:hi] = m, l
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, key_mask, m_all, l_all)
            ctx.text_len, ctx.elems = text_len, elems
        return out(geo.lq.from_blocked(y, 2).permute(0, 2, 1, 3), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        q, k, v, key_mask, m_all, l_all = ctx.saved_tensors
        b, sq, h, d = q.shape
        sk = k.shape[1]
        check_joint("joint_attention_fused", key_mask, sq, sk)
        geo = geometry("joint_attention_fused", b, sq, sk, key_mask, ctx.text_len, q.device)
        qb, kb = geo.lq.to_blocked(heads_f32(q), 2), geo.lk.to_blocked(heads_f32(k), 2)
        vb = masked_keys(geo, geo.lk.to_blocked(heads_f32(v), 2))
        kbm = masked_keys(geo, kb)
        gob = geo.lq.to_blocked(heads_f32(g32(go)), 2)  # [B,H,Pq,D]
        vk = geo.vk()
        dq = torch.empty(b, h, geo.lq.padded, d, device=q.device)
        dk_parts, dv_parts = [], []  # one partial per query block, [B,H,Pk,D]
        for lo, hi in _chunks(geo, b * h, ctx.elems):
            s = geo.key_blocks(scores_blocked(qb[:, :, lo:hi], kb))
            p = softmax_probs(s, vk, m_all[:, :, lo:hi], l_all[:, :, lo:hi]).view(b, h, hi - lo, -1)
            pc = p.to(v.dtype).to(torch.float32)
            dp = torch.where(geo.valid_k[:, None, None, :], scores_dot(gob[:, :, lo:hi], vb), torch.zeros(()))
            g = softmax_backward_blocked(geo, p, dp) * qk_scale(d)  # G = dS·fp32(1/√Dh)
            dq[:, :, lo:hi] = av_blocked(geo, g, kbm)
            dk_parts += query_block_parts(g, qb[:, :, lo:hi])
            dv_parts += query_block_parts(pc, gob[:, :, lo:hi])
        res = []
        for parts, like in ((dk_parts, k), (dv_parts, v)):
            blocks = block_partials((torch.stack(parts),), geo.present_q, dim=0)
            (t,) = merge_blocks(geo.lq, blocks, add_combine).values
            t = masked_keys(geo, t)
            res.append(cast_like(geo.lk.from_blocked(t, 2).permute(0, 2, 1, 3).contiguous(), like))
        dqo = cast_like(geo.lq.from_blocked(dq, 2).permute(0, 2, 1, 3).contiguous(), q)
        return dqo, res[0], res[1], None, None, None


@strict_cpu("joint_attention_fused", "q", "k", "v", kernel="strict.fused_blocked_two_pass.v2",
            decomposable=True)
def joint_attention_fused(q, k, v, key_mask=None, *, text_len: int | None = None):
    """Joint attention in one call, byte-equal to ``joint_attn_qk_gemm`` → ``joint_attn_softmax``
    → ``joint_attn_av_gemm`` (contract v2), forward and backward, without the [B,H,S,S] tensors.

    Args:
        q, k, v: [B,S,H,Dh] (joint sequence [text, image]), FP32 or BF16.
        key_mask: [B,S] bool (True = valid key) or None.
        text_len: the padded text length L (where image keys start); None = 0.
    Returns:
        [B,S,H,Dh] in v's dtype (probabilities cast to v's dtype before the value product).
    Raises:
        UnsupportedConfigError: bad dtype/device, mask shape, ``text_len``, or a sample without
            a valid key.
    """
    b, h, keys = q.shape[0], q.shape[2], k.shape[1] + 2 * BLOCK  # keys: at most their padded length
    per = max(1, QUERY_CHUNK_ELEMS // max(1, h * keys * BLOCK))  # samples a query block of which fits
    if b <= per:
        return _Fused.apply(q, k, v, key_mask, text_len, QUERY_CHUNK_ELEMS)
    # a large batch in sample chunks too (each sample's rows are its own: no byte changes), so that
    # one chunk's [B, H, rows, Pk] tensors stay within the bound at any batch
    return torch.cat([_Fused.apply(q[i:i + per], k[i:i + per], v[i:i + per],
                                   None if key_mask is None else key_mask[i:i + per], text_len,
                                   QUERY_CHUNK_ELEMS) for i in range(0, b, per)])
