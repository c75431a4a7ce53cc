"""Strict joint attention: qk_rmsnorm, multi_axis_rope, joint_attn_qk_gemm, joint_attn_softmax,
joint_attn_av_gemm (numerics §2.2, §2.4; contract v2). ``joint_attention_fused`` lives in
``drifttool.ops.strict.attention_fused``.

Contract v2 (docs/strict-arithmetic.md, "Attention (contract v2)"): every reduction over keys
(softmax sums, AV, dQ) runs over fixed 64-key blocks in global key order — text blocks from text
position 0, image blocks from image position 0 — and merges the block partials in one fixed
structure (text sequentially; image in 8 segments, sequential inside, depth-3 tree across;
text ⊕ image); the reductions over queries of the backward (dK, dV) use the same structure on
the query axis. The pieces are in ``drifttool.ops.strict.attention_blocks``,
``attention_kernels`` and ``attention_core``; each operator here maps its [B,H,S,S] / [B,S,H,Dh]
tensors to the blocked layout, calls them, and maps back.

The layout needs the padded text length: every operator takes ``text_len`` (keyword; default
``None`` = 0, every position an image position). The model passes it; without it a padded
prompt's keys sit in other blocks and the padding invariance is lost (the bytes are still a
valid strict softmax).

Declared casts: scores FP32; probabilities FP32 out of ``joint_attn_softmax``;
``joint_attn_av_gemm`` casts them to the activation dtype (v's dtype) before the value product
(a no-op for FP32, BF16 for BF16 runs, as a tensor-core kernel would) and accumulates in FP32;
its output is cast once to v's dtype.

Backward (``torch.autograd.Function``, FP32): softmax dS = P·(dP − Σ_k P·dP) with Σ by the key
block structure, masked keys +0; AV dP = dO·Vᵀ (``rowdot``; masked keys +0) and dV = P̃ᵀ·dO
(P̃ the cast probabilities) over the queries by the query block structure, masked keys +0;
QKᵀ: G = dS·fp32(1/√Dh), dQ = G·K over keys (key structure, masked keys' K taken as +0),
dK = Gᵀ·Q over queries (query structure), masked keys +0. A query block whose queries are all
masked is skipped (its output gradient is ignored; the model gives padded rows zero gradient).
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict.attention_core import (
    av_blocked,
    check_joint,
    from_blocked2,
    geometry,
    heads_f32,
    masked_keys,
    over_queries,
    qk_scale,
    scores_blocked,
    scores_dot,
    softmax_backward_blocked,
    softmax_blocked,
    to_blocked2,
)
from drifttool.ops.strict.embed import rms_gain_grads, rms_parts
from drifttool.ops.strict.grad import cast_like, g32


class _QKNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gain, eps, dt):
        xhat, rstd = rms_parts(f32(x), eps)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x, gain, xhat, rstd)
        return out(xhat * f32(gain), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, gain, xhat, rstd = ctx.saved_tensors
        dx, dgain = rms_gain_grads(g32(go), x, gain, xhat, rstd, ctx.needs_input_grad[:2])
        return dx, dgain, None, None


@strict_cpu("qk_rmsnorm", "x", "gain", kernel="tree_rmsnorm")
def qk_rmsnorm(x, gain, eps: float = 1e-6):
    """Learned-gain RMSNorm over the head dim: x [B,S,H,Dh], gain [Dh] → [B,S,H,Dh]."""
    dt = act_dtype(x, gain)
    return _QKNorm.apply(x, gain, eps, dt)


def _rope_cs(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = freqs.real.to(torch.float32)[None, :, None, :]  # [1,S,1,Dh/2]
    s = freqs.imag.to(torch.float32)[None, :, None, :]
    return c, s


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs, dt):
        c, s = _rope_cs(freqs)
        xp = f32(x).unflatten(-1, (-1, 2))  # [B,S,H,Dh/2,2]
        x0, x1 = xp[..., 0], xp[..., 1]
        y = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
        ctx.save_for_backward(freqs)
        ctx.x_dtype = x.dtype
        return out(y, dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        (freqs,) = ctx.saved_tensors
        c, s = _rope_cs(freqs)
        gp = g32(go).unflatten(-1, (-1, 2))
        g0, g1 = gp[..., 0], gp[..., 1]
        dx = torch.stack([g0 * c + g1 * s, g1 * c - g0 * s], dim=-1).flatten(-2)
        return dx.to(ctx.x_dtype), None, None


@strict_cpu("multi_axis_rope", "x", kernel="rope_interleaved_f32")
def multi_axis_rope(x, freqs):
    """Rotate adjacent pairs (x[2j], x[2j+1]) by the angle table: y0 = x0·c − x1·s,
    y1 = x0·s + x1·c in FP32 (separate roundings); x [B,S,H,Dh], freqs [S,Dh/2] complex64."""
    dt = act_dtype(x)
    if not freqs.is_complex() or tuple(freqs.shape) != (x.shape[1], x.shape[-1] // 2) or x.shape[-1] % 2:
        raise UnsupportedConfigError(
            f"multi_axis_rope: need a complex table [S, Dh/2] = {[x.shape[1], x.shape[-1] // 2]} for x "
            f"{tuple(x.shape)} (Dh even), got {freqs.dtype} {tuple(freqs.shape)}")
    return _Rope.apply(x, freqs, dt)


class _QK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, key_mask, text_len):
        b, s, h, d = q.shape
        geo = geometry("joint_attn_qk_gemm", b, s, k.shape[1], key_mask, text_len, q.device)
        qb, kb = geo.lq.to_blocked(heads_f32(q), 2), geo.lk.to_blocked(heads_f32(k), 2)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(q, k, key_mask)
            ctx.text_len = text_len
        return from_blocked2(geo, scores_blocked(qb, kb))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gs):
        q, k, key_mask = ctx.saved_tensors
        b, sq, h, d = q.shape
        check_joint("joint_attn_qk_gemm", key_mask, sq, k.shape[1])
        geo = geometry("joint_attn_qk_gemm", b, sq, k.shape[1], key_mask, ctx.text_len, q.device)
        g = to_blocked2(geo, g32(gs) * qk_scale(d))  # G = dS·fp32(1/√Dh), blocked [B,H,Pq,Pk]
        dq = dk = None
        if ctx.needs_input_grad[0]:  # Σ over keys
            kb = masked_keys(geo, geo.lk.to_blocked(heads_f32(k), 2))
            dq = geo.lq.from_blocked(av_blocked(geo, g, kb), 2)
            dq = cast_like(dq.permute(0, 2, 1, 3).contiguous(), q)
        if ctx.needs_input_grad[1]:  # Σ over queries
            dkb = masked_keys(geo, over_queries(geo, g, geo.lq.to_blocked(heads_f32(q), 2)))
            dk = cast_like(geo.lk.from_blocked(dkb, 2).permute(0, 2, 1, 3).contiguous(), k)
        return dq, dk, None, None


@strict_cpu("joint_attn_qk_gemm", "q", "k", kernel="strict.qk.v2[exact if Dh<=32 else tile16x64]")
def joint_attn_qk_gemm(q, k, key_mask=None, *, text_len: int | None = None):
    """scores[b,h,i,j] = (q_i · k_j) · fp32(1/√Dh) in FP32; q, k [B,S,H,Dh] → [B,H,S,S] FP32.

    Dh ≤ 32: exact products, pairwise tree over Dh; else members [16, Dh] @ [Dh, 64] per
    (16-query tile, 64-key block) of the blocked layouts. ``key_mask`` [B,S] bool and
    ``text_len`` (padded text length) do not change the scores; they set the block structure of
    the backward (dQ over key blocks, dK over query blocks).

    Raises:
        UnsupportedConfigError: bad dtype/device, mask shape, ``text_len``, or a sample without
            a valid key."""
    return _QK.apply(q, k, key_mask, text_len)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, key_mask, text_len):
        b, h, sq, sk = scores.shape
        geo = geometry("joint_attn_softmax", b, sq, sk, key_mask, text_len, scores.device)
        p, _, _ = softmax_blocked(geo, to_blocked2(geo, f32(scores)))
        p = from_blocked2(geo, p)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(p, key_mask)
            ctx.text_len, ctx.s_dtype = text_len, scores.dtype
        return p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gp):
        p, key_mask = ctx.saved_tensors
        b, h, sq, sk = p.shape
        geo = geometry("joint_attn_softmax", b, sq, sk, key_mask, ctx.text_len, p.device)
        ds = softmax_backward_blocked(geo, to_blocked2(geo, p), to_blocked2(geo, g32(gp)))
        return from_blocked2(geo, ds).to(ctx.s_dtype), None, None


@strict_cpu("joint_attn_softmax", "scores", kernel="strict.block64_merge_softmax.v2")
def joint_attn_softmax(scores, key_mask=None, *, text_len: int | None = None):
    """Key-masked softmax over the last axis by 64-key blocks in global key order (contract v2):
    block states (exact max, ``tree_sum`` of fp32(exp64(s − m_b)) over the block's 64 slots),
    merged in the fixed order (text sequential; image 8 segments, depth-3 tree; text ⊕ image);
    P = fp32(exp64(s − m)) / l. scores [B,H,S,S] FP32 → probs [B,H,S,S] FP32; masked keys +0.

    Raises:
        UnsupportedConfigError: bad dtype/device, mask shape, ``text_len``, or a sample without
            a valid key."""
    return _Softmax.apply(scores, key_mask, text_len)


class _AV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, v, key_mask, text_len):
        dt = v.dtype
        b, h, sq, sk = probs.shape
        geo = geometry("joint_attn_av_gemm", b, sq, sk, key_mask, text_len, v.device)
        pc = to_blocked2(geo, probs.to(dt).to(torch.float32))  # the declared cast: P → activation dtype
        vb = masked_keys(geo, geo.lk.to_blocked(heads_f32(v), 2))
        y = geo.lq.from_blocked(av_blocked(geo, pc, vb), 2)  # [B,H,Sq,D]
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(pc, vb, key_mask)  # blocked frame
            ctx.geo_args = (b, sq, sk, text_len)
            ctx.dtypes = (probs.dtype, v.dtype)
        return out(y.permute(0, 2, 1, 3), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        pc, vb, key_mask = ctx.saved_tensors  # cast probs [B,H,Pq,Pk], values [B,H,Pk,D] (masked +0)
        b, sq, sk, text_len = ctx.geo_args
        check_joint("joint_attn_av_gemm", key_mask, sq, sk)
        geo = geometry("joint_attn_av_gemm", b, sq, sk, key_mask, text_len, vb.device)
        gob = geo.lq.to_blocked(heads_f32(go.contiguous()), 2)  # [B,H,Pq,D]
        dp = dv = None
        if ctx.needs_input_grad[0]:  # dP = dO·Vᵀ, Σ over Dh; masked keys +0
            dpb = torch.where(geo.valid_k[:, None, None, :], scores_dot(gob, vb), torch.zeros(()))
            dp = from_blocked2(geo, dpb).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:  # dV = P̃ᵀ·dO, Σ over queries; masked keys +0
            dvb = masked_keys(geo, over_queries(geo, pc, gob))
            dv = geo.lk.from_blocked(dvb, 2).permute(0, 2, 1, 3).contiguous().to(ctx.dtypes[1])
        return dp, dv, None, None


@strict_cpu("joint_attn_av_gemm", "probs", "v", kernel="strict.av.v2[exact if Dh<=32 else tile16.block64]")
def joint_attn_av_gemm(probs, v, key_mask=None, *, text_len: int | None = None):
    """out_i = Σ_j P̃_ij v_j by the key block structure (contract v2), P̃ = probs cast to v's
    dtype (the declared cast; no-op for FP32), FP32 accumulation: per 64-key block exact products
    and ``tree_sum`` over its slots (Dh ≤ 32) or one member [16, 64] @ [64, Dh] per (16-query
    tile, block); block partials merged in the fixed order by FP32 adds. Masked keys'
    probabilities and values are taken as +0. probs [B,H,S,S], v [B,S,H,Dh] → [B,S,H,Dh] in
    v's dtype.

    Raises:
        UnsupportedConfigError: bad dtype/device, mask shape, ``text_len``, or a sample without
            a valid key."""
    return _AV.apply(probs, v, key_mask, text_len)
