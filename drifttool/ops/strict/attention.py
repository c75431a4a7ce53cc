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
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.registry import implements
from drifttool.ops.strict._checks import check, f32, out
from drifttool.ops.strict.embed import rms_normalize
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


@implements("qk_rmsnorm", "strict", kernel="cpu.tree_rmsnorm")
def qk_rmsnorm(x, gain, eps: float = 1e-6):
    """Learned-gain RMSNorm over the head dim: x [B,S,H,Dh], gain [Dh] → [B,S,H,Dh]."""
    dt = check("qk_rmsnorm", x, gain)
    return out(rms_normalize(f32(x), eps) * f32(gain), dt)


@implements("multi_axis_rope", "strict", kernel="cpu.rope_interleaved_f32")
def multi_axis_rope(x, freqs):
    """Rotate adjacent pairs (x[2j], x[2j+1]) by the angle table: y0 = x0·c − x1·s,
    y1 = x0·s + x1·c in FP32 (separate roundings); x [B,S,H,Dh], freqs [S,Dh/2] complex64."""
    dt = check("multi_axis_rope", x)
    c = freqs.real.to(torch.float32)[None, :, None, :]  # [1,S,1,Dh/2]
    s = freqs.imag.to(torch.float32)[None, :, None, :]
    xp = f32(x).unflatten(-1, (-1, 2))  # [B,S,H,Dh/2,2]
    x0, x1 = xp[..., 0], xp[..., 1]
    y = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    return out(y, dt)


@implements("joint_attn_qk_gemm", "strict", kernel="strict.qk[exact if Dh<=32 else tile16x64]")
def joint_attn_qk_gemm(q, k):
    """scores[b,h,i,j] = (q_i · k_j) · (1/√Dh) in FP32; q, k [B,S,H,Dh] → [B,H,S,S] FP32."""
    check("joint_attn_qk_gemm", q, k)
    b, s, h, d = q.shape
    scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    qh = _pad_axis(f32(q).permute(0, 2, 1, 3).reshape(b * h, s, d), 1, ROW_TILE)
    kh = _pad_axis(f32(k).permute(0, 2, 1, 3).reshape(b * h, s, d), 1, KEY_TILE)
    if d <= EXACT_MAX_HEAD_DIM:
        res = torch.stack([exact_matmul(qh[i, :s], kh[i, :s]) for i in range(b * h)])  # [BH,S,S]
        return (res * scale).view(b, h, s, s)
    tq, tk = qh.shape[1] // ROW_TILE, kh.shape[1] // KEY_TILE
    res = torch.empty(b * h, tq * ROW_TILE, tk * KEY_TILE)
    for g in _groups(b * h, tq * tk * ROW_TILE * d):
        qt = qh[g].view(-1, tq, 1, ROW_TILE, d)  # [G,Tq,1,16,D]
        kt = kh[g].view(-1, 1, tk, KEY_TILE, d).transpose(-1, -2)  # [G,1,Tk,D,64]
        st = torch.matmul(qt, kt)  # [G,Tq,Tk,16,64]
        res[g] = st.permute(0, 1, 3, 2, 4).reshape(-1, tq * ROW_TILE, tk * KEY_TILE)
    return (res[:, :s, :s] * scale).view(b, h, s, s)


@implements("joint_attn_softmax", "strict", kernel="cpu.compacted_tree_softmax")
def joint_attn_softmax(scores, key_mask=None):
    """Key-masked softmax over the last axis in the compacted key order: max (exact), exp from
    exact ops, pairwise-tree sum, one division. scores [B,H,S,S] FP32 → probs FP32; masked keys
    get exactly 0."""
    check("joint_attn_softmax", scores)
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
    return p


@implements("joint_attn_av_gemm", "strict", kernel="strict.av[exact if Dh<=32 else tile16.k64.tree]")
def joint_attn_av_gemm(probs, v, key_mask=None):
    """out_i = Σ_j p_ij v_j over keys in the compacted order: 16-query tiles × 64-key chunks,
    chunk partials summed in the pairwise tree, FP32; probs [B,H,S,S], v [B,S,H,Dh] →
    [B,S,H,Dh] in v's dtype. Masked keys' values are zeroed (their probabilities are 0)."""
    check("joint_attn_av_gemm", probs, v)
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
    if d <= EXACT_MAX_HEAD_DIM:
        vt = vf.reshape(b * h, sk, d).transpose(1, 2)  # [BH,D,S]
        pr = p.reshape(b * h, sq, sk)
        y = torch.stack([exact_matmul(pr[i], vt[i]) for i in range(b * h)])  # [BH,Sq,D]
        return out(y.view(b, h, sq, d).permute(0, 2, 1, 3), dt)
    p = _pad_axis(_pad_axis(p.reshape(b * h, sq, sk), 1, ROW_TILE), 2, KEY_TILE)
    vf = _pad_axis(vf.reshape(b * h, sk, d), 1, KEY_TILE)
    tq, tk = p.shape[1] // ROW_TILE, p.shape[2] // KEY_TILE
    res = torch.empty(b * h, tq * ROW_TILE, d)
    for g in _groups(b * h, tk * tq * ROW_TILE * d):
        pt = p[g].view(-1, tq, ROW_TILE, tk, KEY_TILE).permute(0, 3, 1, 2, 4)  # [G,Tk,Tq,16,64]
        vt = vf[g].view(-1, tk, 1, KEY_TILE, d)  # [G,Tk,1,64,D]
        parts = torch.matmul(pt, vt)  # [G,Tk,Tq,16,D]
        res[g] = tree_sum(parts, dim=1).reshape(-1, tq * ROW_TILE, d)
    y = res[:, :sq].view(b, h, sq, d).permute(0, 2, 1, 3)  # [B,S,H,D]
    return out(y, dt)


@implements("joint_attention_fused", "strict", kernel="cpu.composed_unfused")
def joint_attention_fused(q, k, v, key_mask=None):
    """The three unfused strict operators in one call — byte-equal to them by construction."""
    p = joint_attn_softmax(joint_attn_qk_gemm(q, k), key_mask)
    return joint_attn_av_gemm(p, v, key_mask)
