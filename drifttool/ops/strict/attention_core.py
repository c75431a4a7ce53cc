"""Geometry and blocked building blocks of the strict joint attention operators (contract v2).

``AttnGeometry`` checks an attention call's key mask and ``text_len`` and holds the blocked
layouts of its query and key axes; the functions below take blocked tensors ([B,H,Pq,Pk] scores
or probabilities, [B,H,P,Dh] q/k/v rows) and run the forward and backward pieces with the key
block structure of ``attention_blocks``. The unfused operators (``attention``) and the fused one
(``attention_fused``) are both written with these, which is what makes them byte-equal; Ring and
SP code can call them on the blocks a rank holds.
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict._checks import f32
from drifttool.ops.strict.attention_blocks import BLOCK, JointLayout, row_sums, softmax_probs, softmax_state
from drifttool.ops.strict.attention_kernels import block_weighted, rowdot, weighted_sum

__all__ = ["AttnGeometry", "geometry", "heads_f32", "to_blocked2", "from_blocked2", "check_joint", "scores_blocked", "scores_dot", "softmax_blocked", "av_blocked",
           "over_queries", "query_block_parts", "softmax_backward_blocked", "masked_keys", "qk_scale"]


def heads_f32(t: torch.Tensor) -> torch.Tensor:
    """[B,S,H,D] → FP32 [B,H,S,D]."""
    return f32(t).permute(0, 2, 1, 3)


def qk_scale(d: int) -> torch.Tensor:
    """fp32(1/√Dh) as an FP32 scalar tensor."""
    return torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)


class AttnGeometry:
    """The blocked layouts of one joint attention call and the key/query validity in them.

    Attributes:
        lq, lk: ``JointLayout`` of the query and key axes (both with ``text_len``).
        valid_k: bool [B, Pk] (Pk = 64·nb_k); valid_q: bool [B, Pq] (the key mask on the query
            axis when Sq = Sk, else every real position); present_k [B, nb_k], present_q [B, nb_q].
    """

    def __init__(self, op: str, b: int, sq: int, sk: int, key_mask, text_len, device=None) -> None:
        if key_mask is not None and tuple(key_mask.shape) != (b, sk):
            raise UnsupportedConfigError(f"{op}: key_mask must be [B, S] = [{b}, {sk}], got {tuple(key_mask.shape)}")
        tl = 0 if text_len is None else text_len
        if isinstance(tl, bool) or not isinstance(tl, int) or not 0 <= tl <= min(sq, sk):
            raise UnsupportedConfigError(
                f"{op}: text_len must be an int in [0, {min(sq, sk)}] (the padded text length), got {text_len!r}")
        self.lq, self.lk = JointLayout(sq, tl), JointLayout(sk, tl)
        self.valid_k = self.lk.valid(key_mask, b, device)
        self.present_k = self.lk.present(self.valid_k)
        if not bool(self.present_k.any(-1).all()):
            raise UnsupportedConfigError(f"{op}: a sample has no valid key (its key_mask is all False)")
        qmask = key_mask if (key_mask is not None and sq == sk) else None
        self.valid_q = self.lq.valid(qmask, b, device)
        self.present_q = self.lq.present(self.valid_q)

    def key_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, M, Pk] → [B, H, M, nb_k, 64] (a view)."""
        return x.view(*x.shape[:-1], self.lk.n_blocks, BLOCK)

    def vk(self) -> torch.Tensor:
        """Key validity broadcastable against ``key_blocks``: [B, 1, 1, nb_k, 64]."""
        return self.valid_k.view(self.valid_k.shape[0], 1, 1, self.lk.n_blocks, BLOCK)


def geometry(op: str, b: int, sq: int, sk: int, key_mask, text_len, device=None) -> AttnGeometry:
    """Check the mask and ``text_len`` and build the layouts (raises ``UnsupportedConfigError``)."""
    return AttnGeometry(op, b, sq, sk, key_mask, text_len, device)


def scores_dot(qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """``rowdot`` of blocked [B,H,Mq,D] and blocked [B,H,Pk,D] → [B,H,Mq,Pk] FP32 (Σ over D)."""
    b, h, mq, d = qb.shape
    return rowdot(qb.reshape(b * h, mq, d), kb.reshape(b * h, -1, d)).view(b, h, mq, -1)


def scores_blocked(qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """Scaled scores of blocked q [B,H,Mq,D] and blocked k [B,H,Pk,D] → [B,H,Mq,Pk] FP32:
    ``rowdot`` × fp32(1/√Dh)."""
    return scores_dot(qb, kb) * qk_scale(qb.shape[-1])


def softmax_blocked(geo: AttnGeometry, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Probabilities of blocked FP32 scores x [B,H,M,Pk] → (P [B,H,M,Pk], m [B,H,M], l [B,H,M])."""
    xb, vk = geo.key_blocks(x), geo.vk()
    m, l = softmax_state(geo.lk, xb, vk, geo.present_k)
    return softmax_probs(xb, vk, m, l).view(x.shape), m, l


def masked_keys(geo: AttnGeometry, t: torch.Tensor) -> torch.Tensor:
    """Blocked [B,H,Pk,D] with the masked and absent keys' rows replaced by +0."""
    return torch.where(geo.valid_k[:, None, :, None], t, torch.zeros(()))


def av_blocked(geo: AttnGeometry, p: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """Σ_k P[k]·v[k] by the key block structure: p [B,H,M,Pk] (cast probabilities, FP32),
    vb [B,H,Pk,D] blocked values (masked keys +0) → [B,H,M,D] FP32."""
    b, h, m, pk = p.shape
    d = vb.shape[-1]
    w = torch.where(geo.valid_k[:, None, None, :], p, torch.zeros(())).view(b * h, m, geo.lk.n_blocks, BLOCK)
    return weighted_sum(geo.lk, w, vb.reshape(b * h, geo.lk.n_blocks, BLOCK, d), geo.present_k, h)


def over_queries(geo: AttnGeometry, w: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """Σ over queries by the query block structure: w [B,H,Pq,Pk] (weight of query q for key
    k), xb [B,H,Pq,D] blocked → [B,H,Pk,D] FP32 (dK = Gᵀ·Q, dV = P̃ᵀ·dO)."""
    b, h, pq, pk = w.shape
    d = xb.shape[-1]
    wt = w.transpose(-1, -2).reshape(b * h, pk, geo.lq.n_blocks, BLOCK)
    return weighted_sum(geo.lq, wt, xb.reshape(b * h, geo.lq.n_blocks, BLOCK, d), geo.present_q, h)


def query_block_parts(w: torch.Tensor, xb: torch.Tensor) -> list[torch.Tensor]:
    """Per-query-block partials of Σ_q w[q,k]·x[q] (dK = Gᵀ·Q, dV = P̃ᵀ·dO) for a run of whole
    query blocks: w [B,H,rows,Pk], xb [B,H,rows,D] FP32 (rows a multiple of 64, starting at a
    block boundary of the blocked query layout) → list of [B,H,Pk,D], one per block, to be
    merged in the fixed order of the query axis (an SP rank merges the blocks it holds)."""
    b, h, rows, pk = w.shape
    d = xb.shape[-1]
    nb = rows // BLOCK
    wt = w.transpose(-1, -2).reshape(b * h, pk, nb, BLOCK)
    parts = block_weighted(wt, xb.reshape(b * h, nb, BLOCK, d))  # [nb, BH, Pk, D]
    return list(parts.view(nb, b, h, pk, d).unbind(0))


def softmax_backward_blocked(geo: AttnGeometry, p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """dS = P·(dP − Σ_k P·dP) on blocked [B,H,M,Pk] FP32, Σ by the key block structure; masked
    keys +0."""
    pb, dpb, vk = geo.key_blocks(p), geo.key_blocks(dp), geo.vk()
    r = row_sums(geo.lk, pb * dpb, vk, geo.present_k)  # [B,H,M]
    ds = torch.where(vk, pb * (dpb - r[..., None, None]), torch.zeros(()))
    return ds.view(p.shape)


def to_blocked2(geo: AttnGeometry, t: torch.Tensor) -> torch.Tensor:
    """[B,H,Sq,Sk] → blocked [B,H,Pq,Pk]."""
    return geo.lk.to_blocked(geo.lq.to_blocked(t, 2), 3)


def from_blocked2(geo: AttnGeometry, t: torch.Tensor) -> torch.Tensor:
    return geo.lk.from_blocked(geo.lq.from_blocked(t, 2), 3)


def check_joint(op: str, key_mask, sq: int, sk: int) -> None:
    if key_mask is not None and sq != sk:
        raise UnsupportedConfigError(
            f"{op} backward: a key mask needs the joint self-attention layout "
            f"(as many queries as keys), got {sq} queries and {sk} keys")
