"""``production`` family of the text encoder's arithmetic operators: transformers 5.x's
``Qwen2_5_VLTextModel`` (``modeling_qwen2_5_vl.py``, attention ``sdpa``), torch call for torch
call, so the last hidden state equals transformers' byte for byte on the CPU.

    >>> y = call(Runtime(mode="auto"), "te_rmsnorm", x, gain, 1e-6, stream="txt", layout="BS.")

- every Linear is ``F.linear`` in the model dtype (bias fused for Q/K/V; none elsewhere);
- RMSNorm: FP32 ``pow(2).mean``, ``x · rsqrt(var + eps)``, cast to the input dtype, then
  ``gain ·``;
- RoPE: inverse frequencies ``1 / θ^(arange(0, Dh, 2) / Dh)`` in FP32, ``pos.float() · f``,
  ``cos``/``sin`` in FP32, the mRoPE sections recomposed, cast to the activation dtype, then
  ``x·cos + rotate_half(x)·sin`` in it;
- attention: ``F.scaled_dot_product_attention`` as transformers' ``sdpa_attention_forward``:
  without padding (no key mask, or every key valid) ``is_causal=True`` with ``enable_gqa``;
  with padding a bool mask ``causal & key_valid`` [B, 1, L, L] and K/V heads repeated;
- SwiGLU: ``silu(gate(h)) * up(h)``, the residual added in the model dtype.

On the CPU this path is not batch- or padding-invariant (SDPA and the BLAS pick kernels by
shape): that is what the strict family is for (tests/text_encoder/test_invariance.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.ops.registry import implements

_DEVICES = ("cpu", "cuda")


def _production(op: str, kernel: str):
    return implements(op, "production", device=_DEVICES, kernel=kernel)


@_production("te_rmsnorm", kernel="torch.rmsnorm_fp32_stats")
def te_rmsnorm(x, gain, eps: float = 1e-6):
    """transformers' ``Qwen2_5_VLRMSNorm.forward``: x [B, L, D], gain [D] → [B, L, D]."""
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return gain * (xf * torch.rsqrt(var + eps)).to(x.dtype)


@_production("te_qkv_bias_gemm", kernel="F.linear")
def te_qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads: int, kv_heads: int):
    """(q, k, v) = ``F.linear`` with bias, split into heads [B, L, H(kv), Dh] (views)."""
    q, k, v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    return q.unflatten(-1, (heads, -1)), k.unflatten(-1, (kv_heads, -1)), v.unflatten(-1, (kv_heads, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, ...],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``Qwen2_5_VLRotaryEmbedding.forward`` (rope type ``default``): (cos, sin)
    [B, L, Dh] in ``dtype`` from positions [3, B, L]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float).to(positions.device) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [3, B, L, Dh/2]
    cos, sin = freqs.cos() * 1.0, freqs.sin() * 1.0  # attention_scaling of rope type "default"

    def recompose(f: torch.Tensor) -> torch.Tensor:
        f = torch.cat([m[i % 3] for i, m in enumerate(f.split(list(section), dim=-1))], dim=-1)
        return torch.cat((f, f), dim=-1)

    return recompose(cos).to(dtype), recompose(sin).to(dtype)


@_production("te_mrope", kernel="torch.mrope_rotate_half")
def te_mrope(x, positions, theta: float, section: tuple[int, ...]):
    """``apply_rotary_pos_emb``: x [B, L, H, Dh], positions [3, B, L] → [B, L, H, Dh]."""
    cos, sin = mrope_cos_sin(positions, x.shape[-1], theta, tuple(section), x.dtype)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos) + (_rotate_half(x) * sin)


def _repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, L, Dh] → [B, Hkv·n_rep, L, Dh] (transformers' ``repeat_kv``)."""
    if n_rep == 1:
        return t
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


@_production("te_causal_attention", kernel="sdpa")
def te_causal_attention(q, k, v, key_mask=None):
    """transformers' ``sdpa_attention_forward`` for a prefill without cache: q [B,L,H,Dh],
    k/v [B,L,Hkv,Dh], key_mask [B, L] (None or all ones: no mask) → [B,L,H,Dh]."""
    n, heads, d = q.shape[1], q.shape[2], q.shape[3]
    groups = heads // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = None if key_mask is None or bool(key_mask.bool().all()) else key_mask.bool()
    kwargs = {}
    if mask is None:
        if groups > 1:
            kwargs["enable_gqa"] = True
    else:
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = causal[None, None] & mask[:, None, None, :]  # [B, 1, L, L]
        kh, vh = _repeat_kv(kh, groups), _repeat_kv(vh, groups)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=0.0, scale=d ** -0.5,
                                       is_causal=mask is None and n > 1, **kwargs)
    return o.reshape(o.shape[0], -1, n, d).transpose(1, 2).contiguous()


@_production("te_attn_out_residual", kernel="F.linear")
def te_attn_out_residual(x, a, w):
    """x + ``F.linear``(a, w): the decoder layer's attention residual."""
    return x + F.linear(a, w)


@_production("te_mlp_gate_up_silu", kernel="F.linear+F.silu")
def te_mlp_gate_up_silu(h, w_gate, w_up):
    """``Qwen2MLP``'s first half: silu(gate_proj(h)) * up_proj(h)."""
    return F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)


@_production("te_mlp_down_residual", kernel="F.linear")
def te_mlp_down_residual(x, m, w):
    """x + ``F.linear``(m, w): the decoder layer's MLP residual."""
    return x + F.linear(m, w)
