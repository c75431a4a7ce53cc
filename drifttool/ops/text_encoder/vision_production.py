"""``production`` family of the vision tower's arithmetic operators: transformers 5.x's
``Qwen2_5_VisionTransformerPretrainedModel`` (``modeling_qwen2_5_vl.py``, attention ``sdpa``),
torch call for torch call and on the same packed buffers, so the vision embeddings equal
transformers' byte for byte on the CPU.

    >>> y = call(Runtime(mode="auto"), "te_vision_merger", x, gain, w1, b1, w2, b2, 4,
    ...          stream="img", layout="S.")

- patch embedding: ``pixel_values`` cast to the weight's dtype, ``F.conv3d`` with stride =
  kernel = (T, P, P), no bias;
- RoPE table: inverse frequencies ``1 / θ^(arange(0, Dh/2, 2) / (Dh/2))`` in FP32, ``pos.float()
  · f``, ``cos``/``sin`` in FP32 on the [N, 2, Dh/4] buffer of every patch in patch order, rows
  (h, w) concatenated and repeated to Dh;
- RMSNorm: ``te_rmsnorm``'s (``Qwen2_5_VLRMSNorm``);
- Q/K/V: one ``F.linear`` with bias, split into views [N, H, Dh];
- attention: per ``cu_seqlens`` segment ``F.scaled_dot_product_attention`` on [1, H, n, Dh]
  views, no mask, not causal, scale Dh^−½ (transformers' per-chunk SDPA path);
- projections, MLP (SiLU, biases) and residuals in the model dtype, as ``Qwen2_5_VLVisionBlock``;
- merger: RMSNorm, view [N/m², m²·D], ``F.linear``, ``F.gelu`` (erf), ``F.linear``.

Like the language model's production family this is not batch-invariant on the CPU: the BLAS
and SDPA pick kernels by shape, and ``cos``/``sin``/``silu``/``gelu`` take a SIMD path or a
scalar one by position in the buffer; the strict family is the invariant one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.ops.registry import implements
from drifttool.ops.text_encoder.production import te_rmsnorm

_DEVICES = ("cpu", "cuda")


def _production(op: str, kernel: str):
    return implements(op, "production", device=_DEVICES, kernel=kernel)


_production("te_vision_rmsnorm", kernel="torch.rmsnorm_fp32_stats")(te_rmsnorm)


@_production("te_vision_patch_embed", kernel="F.conv3d")
def te_vision_patch_embed(pixels, w):
    """``Qwen2_5_VisionPatchEmbed``: pixels [N, 3·T·P·P], w [E, 3, T, P, P] → [N, E] (w's dtype)."""
    e, c, t, p, _ = w.shape
    x = pixels.view(-1, c, t, p, p).to(w.dtype)
    return F.conv3d(x, w, None, (t, p, p)).view(-1, e)


@_production("te_vision_rope_table", kernel="torch.axial_rope_fp32")
def te_vision_rope_table(positions, head_dim: int, theta: float):
    """``Qwen2_5_VLVisionRotaryEmbedding.forward``: positions [N, 2] (row, col) int64 →
    (cos, sin) [N, Dh] FP32."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [N, 2, Dh/4]
    cos, sin = freqs.cos() * 1.0, freqs.sin() * 1.0  # attention_scaling of the axial rope

    def recompose(f: torch.Tensor) -> torch.Tensor:
        hw = torch.cat([f[:, 0], f[:, 1]], dim=-1)  # [N, Dh/2]
        return torch.cat([hw, hw], dim=-1)

    return recompose(cos), recompose(sin)


@_production("te_vision_qkv", kernel="F.linear")
def te_vision_qkv(x, w, b, heads: int):
    """``qkv(x).reshape(N, 3, H, Dh).permute(1, 0, 2, 3).unbind(0)``: x [N, D] → q, k, v [N, H, Dh]."""
    return F.linear(x, w, b).reshape(x.shape[0], 3, heads, -1).permute(1, 0, 2, 3).unbind(0)


@_production("te_vision_attention", kernel="sdpa.per_segment")
def te_vision_attention(q, k, v, cu_seqlens):
    """Attention within each segment [cu[i], cu[i+1]): q, k, v [N, H, Dh] → [N, H, Dh]."""
    n, heads, d = q.shape
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v))  # [1, H, n_i, Dh]
    outs = []
    for a, b, c in zip(qh, kh, vh):
        o = F.scaled_dot_product_attention(a, b, c, attn_mask=None, dropout_p=0.0, scale=d ** -0.5, is_causal=False)
        outs.append(o.reshape(o.shape[0], -1, a.shape[2], c.shape[-1]).transpose(1, 2).contiguous())
    return torch.cat(outs, dim=1).reshape(n, heads, d)


@_production("te_vision_attn_out_residual", kernel="F.linear")
def te_vision_attn_out_residual(x, a, w, b):
    """x + ``F.linear``(a [N, H·Dh], w, b): the block's attention residual."""
    return x + F.linear(a.reshape(a.shape[0], -1).contiguous(), w, b)


@_production("te_vision_mlp_gate_up_silu", kernel="F.linear+F.silu")
def te_vision_mlp_gate_up_silu(h, w_gate, b_gate, w_up, b_up):
    """``Qwen2_5_VLMLP``'s first half with biases: silu(gate_proj(h)) * up_proj(h)."""
    return F.silu(F.linear(h, w_gate, b_gate)) * F.linear(h, w_up, b_up)


@_production("te_vision_mlp_down_residual", kernel="F.linear")
def te_vision_mlp_down_residual(x, m, w, b):
    """x + ``F.linear``(m, w, b): the block's MLP residual."""
    return x + F.linear(m, w, b)


@_production("te_vision_merger", kernel="rmsnorm+F.linear+F.gelu+F.linear")
def te_vision_merger(x, gain, w1, b1, w2, b2, merge_unit: int, eps: float = 1e-6):
    """``Qwen2_5_VLPatchMerger``: x [N, D] → [N/m², D_out] (rows of m² consecutive patches joined)."""
    h = te_rmsnorm(x, gain, eps).view(-1, x.shape[-1] * merge_unit)
    return F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
