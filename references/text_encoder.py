"""FP64 references of the Qwen2.5-VL text encoder's operators (``te_*``), written from
transformers' ``modeling_qwen2_5_vl.py`` and diffusers' ``_get_qwen_prompt_embeds``: plain torch
in FP64, no drifttool import. Inputs of any float dtype are upcast; results are FP64.

    >>> y = te_rmsnorm(x, gain, 1e-6)                     # [B, L, D] float64
    >>> emb, mask = te_prompt_extract(hidden, mask, 34)
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.to(F64)


def te_tokenize(prompts, template, encode, pad_id, max_length):
    """Ids of each templated prompt, truncated right, padded right with ``pad_id``; mask 1/0."""
    rows = [list(r)[:max_length] for r in encode([template.format(p) for p in prompts])]
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.int64)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
    return ids, mask


def te_embed_tokens(ids, table):
    return _d(table)[ids]


def te_rmsnorm(x, gain, eps=1e-6):
    x = _d(x)
    return _d(gain) * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def te_qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads, kv_heads):
    x = _d(x)
    q, k, v = (x @ _d(w).T + _d(b) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    return q.unflatten(-1, (heads, -1)), k.unflatten(-1, (kv_heads, -1)), v.unflatten(-1, (kv_heads, -1))


def te_mrope(x, positions, theta, section):
    """Rotate-half RoPE; frequency i of the first half uses position axis (its section) mod 3."""
    x = _d(x)
    d = x.shape[-1]
    inv = torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=F64)
    axis = [j % 3 for j, n in enumerate(section) for _ in range(n)]
    ang = torch.stack([_d(positions[a]) * inv[i] for i, a in enumerate(axis)], dim=-1)  # [B, L, Dh/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


def te_causal_attention(q, k, v, key_mask=None):
    """softmax(q·kᵀ/√Dh) over the valid keys j ≤ i; K/V head h // (H/Hkv)."""
    q, k, v = _d(q), _d(k), _d(v)
    b, n, h, d = q.shape
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    valid = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    if key_mask is not None:
        valid = valid & key_mask.bool()[:, None, None, :]
    p = torch.softmax(s.masked_fill(~valid, -math.inf), dim=-1)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def te_attn_out_residual(x, a, w):
    return _d(x) + _d(a) @ _d(w).T


def te_mlp_gate_up_silu(h, w_gate, w_up):
    h = _d(h)
    g = h @ _d(w_gate).T
    return g / (1 + torch.exp(-g)) * (h @ _d(w_up).T)


def te_mlp_down_residual(x, m, w):
    return _d(x) + _d(m) @ _d(w).T


def te_prompt_extract(hidden, attention_mask, drop):
    """Per prompt: rows with mask 1, minus the first ``drop``; zero right padding; mask 1/0."""
    kept = [_d(hidden[b][attention_mask[b].bool()])[drop:] for b in range(hidden.shape[0])]
    width = max(k.shape[0] for k in kept)
    emb = torch.zeros(len(kept), width, hidden.shape[-1], dtype=F64)
    mask = torch.zeros(len(kept), width, dtype=torch.int64)
    for b, k in enumerate(kept):
        emb[b, : k.shape[0]] = k
        mask[b, : k.shape[0]] = 1
    return emb, mask
