"""Strict joint attention: qk_rmsnorm, multi_axis_rope, joint_attn_qk_gemm, joint_attn_softmax,
joint_attn_av_gemm, joint_attention_fused (numerics §2.2, §2.4).

Key order. Keys are reduced in the *compacted* order: valid keys first (in sequence order:
valid text, then image), masked keys after. Masked keys contribute exact zeros at the end of
every pairwise tree, so a sample's bytes do not depend on how far its prompt was padded.

Kernels, chosen from the head dim alone (never from S or B). Head dim ≤ 32 (the embedded tiny
model): exact products summed by the pairwise tree (``strict_math.exact_matmul``) — the same
bytes on every IEEE-754 machine. Larger head dims: QKᵀ in fixed 16-query × 64-key tiles with the
whole head dim in one matmul; AV in 16-query tiles over 64-key chunks whose partials are summed
in the pairwise tree. Every matmul member has one fixed shape, which keeps each row's bytes
independent of S and B on a given machine.

Backward (``torch.autograd.Function``, FP32; every reduction by the forward's two kernels, chosen
from the head dim alone: ``_rowdot`` (Σ over Dh, the QKᵀ kernel) and ``_weighted_sum`` (Σ over a
key or query axis, the AV kernel)):

* softmax: dS = P·(dP − Σ_k P·dP), the sum the pairwise tree in the compacted key order; masked
  keys get +0.
* AV: dP = dO·Vᵀ (``_rowdot``; masked keys +0); dV = Pᵀ·dO (``_weighted_sum`` over the queries in
  the *compacted query order*: the joint sequence's queries are compacted with the same mask as
  its keys, so padded text queries come last; masked keys' dV is +0).
* QKᵀ: G = dS·fp32(1/√Dh); dQ = G·K over the keys in compacted order; dK = Gᵀ·Q over the
  queries in compacted order. ``joint_attn_qk_gemm`` takes the key mask for this (the forward
  does not use it).
* qk_rmsnorm: the RMSNorm backward of ``drifttool.ops.strict.embed`` (dgain over (token, head)
  rows per sample, then samples); multi_axis_rope: the transposed rotation
  dx0 = g0·c + g1·s, dx1 = g1·c − g0·s.

Padding invariance of the backward: padded text rows carry a zero output gradient in the model
(their outputs only reach masked keys), so in the compacted orders they are trailing zeros of
every tree, as in the forward; tests/ops/test_backward.py checks the bytes.
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict.embed import rms_gain_grads, rms_parts
from drifttool.ops.strict.grad import cast_like, g32
from drifttool.ops.strict_math import KEY_TILE, ROW_TILE, exact_matmul, exp32, tree_sum

EXACT_MAX_HEAD_DIM = 32  # head dims up to this use exact products (portable bytes)

_ELEMS_PER_CHUNK = 1 << 25  # bound on the expanded matmul operands per (batch·head) group


def _pad_axis(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    p = -(-n // multiple) * multiple
    if p == n:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, p - n]
    return torch.nn.functional.pad(x, pad)


def _groups(n: int, per_item: int):
    step = max(1, _ELEMS_PER_CHUNK // max(per_item, 1))
    for i in range(0, n, step):
        yield slice(i, min(n, i + step))


def key_order(key_mask: torch.Tensor | None, batch: int, s: int) -> torch.Tensor | None:
    """Compacted key permutation [B,S] int64: valid keys first, masked after, each in sequence
    order (a stable sort); ``None`` when there is no mask."""
    if key_mask is None:
        return None
    return torch.argsort((~key_mask.bool()).to(torch.int8), dim=-1, stable=True)


def _rowdot(a: torch.Tensor, bm: torch.Tensor) -> torch.Tensor:
    """Σ_d a[g,i,d]·b[g,j,d]: a [G,Sa,D], b [G,Sb,D] → [G,Sa,Sb] FP32 (the QKᵀ kernel, unscaled).

    D ≤ 32: ``exact_matmul`` (pairwise tree over D). Otherwise tiles of 16 rows of a × 64 rows
    of b, the whole D in one matmul member [16,D] @ [D,64].
    """
    g_, sa, d = a.shape
    sb = bm.shape[1]
    if d <= EXACT_MAX_HEAD_DIM:
        return torch.stack([exact_matmul(a[i], bm[i]) for i in range(g_)])  # [G,Sa,Sb]
    ap = _pad_axis(a.contiguous(), 1, ROW_TILE)
    bp = _pad_axis(bm.contiguous(), 1, KEY_TILE)
    tq, tk = ap.shape[1] // ROW_TILE, bp.shape[1] // KEY_TILE
    res = torch.empty(g_, tq * ROW_TILE, tk * KEY_TILE, device=a.device)
    for g in _groups(g_, tq * tk * ROW_TILE * d):
        qt = ap[g].view(-1, tq, 1, ROW_TILE, d)  # [G,Tq,1,16,D]
        kt = bp[g].view(-1, 1, tk, KEY_TILE, d).transpose(-1, -2)  # [G,1,Tk,D,64]
        st = torch.matmul(qt, kt)  # [G,Tq,Tk,16,64]
        res[g] = st.permute(0, 1, 3, 2, 4).reshape(-1, tq * ROW_TILE, tk * KEY_TILE)
    return res[:, :sa, :sb]


def _weighted_sum(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Σ_r p[g,i,r]·v[g,r,:]: p [G,M,R], v [G,R,D] → [G,M,D] FP32 (the AV kernel).

    D ≤ 32: ``exact_matmul`` (pairwise tree over R). Otherwise 16-row tiles of p over 64-wide
    chunks of R, one matmul member [16,64] @ [64,D] per chunk, chunk partials summed by the
    pairwise tree. R is reduced in the order given (callers pass compacted orders).
    """
    g_, m, r = p.shape
    d = v.shape[-1]
    if d <= EXACT_MAX_HEAD_DIM:
        return torch.stack([exact_matmul(p[i], v[i].t()) for i in range(g_)])  # [G,M,D]
    p = _pad_axis(_pad_axis(p.contiguous(), 1, ROW_TILE), 2, KEY_TILE)
    v = _pad_axis(v.contiguous(), 1, KEY_TILE)
    tq, tk = p.shape[1] // ROW_TILE, p.shape[2] // KEY_TILE
    res = torch.empty(g_, tq * ROW_TILE, d, device=p.device)
    for g in _groups(g_, tk * tq * ROW_TILE * d):
        pt = p[g].view(-1, tq, ROW_TILE, tk, KEY_TILE).permute(0, 3, 1, 2, 4)  # [G,Tk,Tq,16,64]
        vt = v[g].view(-1, tk, 1, KEY_TILE, d)  # [G,Tk,1,64,D]
        parts = torch.matmul(pt, vt)  # [G,Tk,Tq,16,D]
        res[g] = tree_sum(parts, dim=1).reshape(-1, tq * ROW_TILE, d)
    return res[:, :m]


def _take(t: torch.Tensor, dim: int, order: torch.Tensor | None) -> torch.Tensor:
    """Reorder axis ``dim`` (2: rows, 3: columns) of a [B,H,X,Y] tensor by ``order`` [B,n]."""
    if order is None:
        return t
    shape = list(t.shape)
    idx = order[:, None, :, None] if dim == 2 else order[:, None, None, :]
    return torch.gather(t, dim, idx.expand(shape))


def _put(t: torch.Tensor, dim: int, order: torch.Tensor | None) -> torch.Tensor:
    """The inverse of ``_take``: scatter axis ``dim`` of ``t`` back to sequence order."""
    if order is None:
        return t
    shape = list(t.shape)
    idx = order[:, None, :, None] if dim == 2 else order[:, None, None, :]
    return torch.empty_like(t).scatter_(dim, idx.expand(shape), t)


def _valid(key_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Validity of the compacted positions [B, S] (True first)."""
    return torch.gather(key_mask.bool(), 1, order)


def _check_mask(op: str, key_mask, b: int, s: int) -> None:
    if key_mask is not None and tuple(key_mask.shape) != (b, s):
        raise UnsupportedConfigError(f"{op}: key_mask must be [B, S] = [{b}, {s}], got {tuple(key_mask.shape)}")


def _check_joint(key_mask, sq: int, sk: int) -> None:
    if key_mask is not None and sq != sk:
        raise UnsupportedConfigError(
            f"joint attention backward: a key mask needs the joint self-attention layout "
            f"(as many queries as keys), got {sq} queries and {sk} keys")


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


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[B,S,H,D] → FP32 [B,H,S,D]."""
    return f32(t).permute(0, 2, 1, 3)


class _QK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, key_mask):
        b, s, h, d = q.shape
        scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
        qh = f32(q).permute(0, 2, 1, 3).reshape(b * h, s, d)
        kh = f32(k).permute(0, 2, 1, 3).reshape(b * h, s, d)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(q, k, key_mask)
        return (_rowdot(qh, kh) * scale).view(b, h, s, s)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gs):
        q, k, key_mask = ctx.saved_tensors
        b, s, h, d = q.shape
        _check_joint(key_mask, s, k.shape[1])
        scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
        gr = g32(gs) * scale  # [B,H,Sq,Sk]
        order = key_order(key_mask, b, s)
        dq = dk = None
        if ctx.needs_input_grad[0]:  # Σ over keys, compacted
            gk = _take(gr, 3, order).reshape(b * h, s, s)
            dq = _weighted_sum(gk, _take(_heads(k), 2, order).reshape(b * h, s, d))
            dq = cast_like(dq.view(b, h, s, d).permute(0, 2, 1, 3).contiguous(), q)
        if ctx.needs_input_grad[1]:  # Σ over queries, compacted
            gq = _take(gr.transpose(-1, -2), 3, order).reshape(b * h, s, s)
            dk = _weighted_sum(gq, _take(_heads(q), 2, order).reshape(b * h, s, d))
            dk = cast_like(dk.view(b, h, s, d).permute(0, 2, 1, 3).contiguous(), k)
        return dq, dk, None


@strict_cpu("joint_attn_qk_gemm", "q", "k", kernel="strict.qk[exact if Dh<=32 else tile16x64]")
def joint_attn_qk_gemm(q, k, key_mask=None):
    """scores[b,h,i,j] = (q_i · k_j) · (1/√Dh) in FP32; q, k [B,S,H,Dh] → [B,H,S,S] FP32.

    ``key_mask`` [B,S] bool (joint [text, image]) does not change the scores; it sets the
    compacted reduction order of the backward (padding-invariant dQ and dK)."""
    _check_mask("joint_attn_qk_gemm", key_mask, k.shape[0], k.shape[1])
    return _QK.apply(q, k, key_mask)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, key_mask):
        b, h, sq, sk = scores.shape
        order = key_order(key_mask, b, sk)
        x = f32(scores)
        if order is not None:
            idx = order[:, None, None, :].expand(b, h, sq, sk)
            valid = torch.gather(key_mask.bool(), 1, order)[:, None, None, :]  # [B,1,1,S]
            x = torch.gather(x, -1, idx)
            x = torch.where(valid, x, torch.tensor(-math.inf))
        mx = torch.amax(x, dim=-1, keepdim=True)
        e = exp32(x - mx)
        p = e / tree_sum(e).unsqueeze(-1)
        if order is not None:
            p = torch.empty_like(p).scatter_(-1, idx, p)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(p, key_mask)
            ctx.s_dtype = scores.dtype
        return p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gp):
        p, key_mask = ctx.saved_tensors
        order = key_order(key_mask, p.shape[0], p.shape[-1])
        pc, gc = _take(p, 3, order), _take(g32(gp), 3, order)
        ds = pc * (gc - tree_sum(pc * gc).unsqueeze(-1))
        if order is not None:
            ds = torch.where(_valid(key_mask, order)[:, None, None, :], ds, torch.zeros(()))
        return _put(ds, 3, order).to(ctx.s_dtype), None


@strict_cpu("joint_attn_softmax", "scores", kernel="compacted_tree_softmax")
def joint_attn_softmax(scores, key_mask=None):
    """Key-masked softmax over the last axis in the compacted key order: max (exact), exp from
    exact ops, pairwise-tree sum, one division. scores [B,H,S,S] FP32 → probs FP32; masked keys
    get exactly 0."""
    _check_mask("joint_attn_softmax", key_mask, scores.shape[0], scores.shape[-1])
    return _Softmax.apply(scores, key_mask)


class _AV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, v, key_mask):
        dt = v.dtype
        b, h, sq, sk = probs.shape
        d = v.shape[-1]
        p = f32(probs)
        vf = f32(v).permute(0, 2, 1, 3)  # [B,H,S,D]
        order = key_order(key_mask, b, sk)
        if order is not None:
            p = torch.gather(p, -1, order[:, None, None, :].expand(b, h, sq, sk))
            valid = torch.gather(key_mask.bool(), 1, order)  # [B,S]
            vf = torch.gather(vf, 2, order[:, None, :, None].expand(b, h, sk, d))
            vf = torch.where(valid[:, None, :, None], vf, torch.zeros(()))
        y = _weighted_sum(p.reshape(b * h, sq, sk), vf.reshape(b * h, sk, d))  # [BH,Sq,D]
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(p, vf, key_mask)  # compacted frame
            ctx.dtypes = (probs.dtype, v.dtype)
        return out(y.view(b, h, sq, d).permute(0, 2, 1, 3), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        pc, vc, key_mask = ctx.saved_tensors  # key-compacted probs [B,H,Sq,Sk], values [B,H,Sk,D]
        b, h, sq, sk = pc.shape
        d = vc.shape[-1]
        _check_joint(key_mask, sq, sk)
        order = key_order(key_mask, b, sk)
        goh = _heads(go.contiguous())  # [B,H,Sq,D]
        valid = None if order is None else _valid(key_mask, order)
        dp = dv = None
        if ctx.needs_input_grad[0]:  # Σ over Dh
            dpc = _rowdot(goh.reshape(b * h, sq, d), vc.reshape(b * h, sk, d)).view(b, h, sq, sk)
            if valid is not None:
                dpc = torch.where(valid[:, None, None, :], dpc, torch.zeros(()))
            dp = _put(dpc, 3, order).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:  # Σ over queries, compacted
            pq = _take(pc, 2, order).transpose(-1, -2).reshape(b * h, sk, sq)
            dvc = _weighted_sum(pq, _take(goh, 2, order).reshape(b * h, sq, d)).view(b, h, sk, d)
            if valid is not None:
                dvc = torch.where(valid[:, None, :, None], dvc, torch.zeros(()))
            dv = _put(dvc, 2, order).permute(0, 2, 1, 3).contiguous().to(ctx.dtypes[1])
        return dp, dv, None


@strict_cpu("joint_attn_av_gemm", "probs", "v", kernel="strict.av[exact if Dh<=32 else tile16.k64.tree]")
def joint_attn_av_gemm(probs, v, key_mask=None):
    """out_i = Σ_j p_ij v_j over keys in the compacted order: 16-query tiles × 64-key chunks,
    chunk partials summed in the pairwise tree, FP32; probs [B,H,S,S], v [B,S,H,Dh] →
    [B,S,H,Dh] in v's dtype. Masked keys' values are zeroed (their probabilities are 0)."""
    _check_mask("joint_attn_av_gemm", key_mask, v.shape[0], v.shape[1])
    return _AV.apply(probs, v, key_mask)


@strict_cpu("joint_attention_fused", "q", "k", "v", kernel="composed_unfused", decomposable=True)
def joint_attention_fused(q, k, v, key_mask=None):
    """The three unfused strict operators in one call — byte-equal to them by construction,
    forward and backward (autograd chains the three backwards); declared ``decomposable``, so
    dispatch runs the three named operators instead when their S×S outputs are captured."""
    p = joint_attn_softmax(joint_attn_qk_gemm(q, k, key_mask), key_mask)
    return joint_attn_av_gemm(p, v, key_mask)
