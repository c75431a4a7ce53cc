"""The whole Qwen-Image MMDiT forward in plain FP64, the judge of drifttool's model.

    >>> import json, torch
    >>> from safetensors.torch import load_file
    >>> from drifttool.references import mmdit as ref_mmdit
    >>> weights = load_file("fixtures/tiny-t2i/transformer/diffusion_pytorch_model.safetensors")
    >>> config = json.load(open("fixtures/tiny-t2i/transformer/config.json"))
    >>> v = ref_mmdit.forward(weights, config, x, txt, txt_mask, tau, (4, 6))   # [B, 24, 64] float64

What drifttool's ``MMDiT`` computes (numerics §2), written from the spec as one function per
stage, in data-flow order, each stage one function of ``references/ops.py`` (ideal FP64
arithmetic; the two FP32-pinned steps, the timestep phases and the RoPE angles, as there):

1. temb = linear_2(SiLU(linear_1(φ(τ)))), φ the cos-first 256-channel sinusoid (§2.1);
   T = txt_in(RMSNorm(txt)); I = img_in(x).
2. RoPE tables: image token n = i·w + j at (0, i − ⌈h/2⌉, j − ⌈w/2⌉), text token k at
   (p, p, p), p = max(⌊h/2⌋, ⌊w/2⌋) + k over the padded length (§2.2).
3. Per block (§2.3, §2.4), per stream: (shift1, scale1, gate1, shift2, scale2, gate2) =
   Linear_mod(SiLU(temb)); X̂ = LN(X)·(1 + scale1) + shift1; q, k, v = X̂·Wᵀ + b in heads;
   RMSNorm of q and k over the head dim; RoPE on q and k; one attention over [text, image] with
   padded text keys excluded; per-stream output projection A; X ← X + gate1·A;
   X ← X + gate2·MLP(LN(X)·(1 + scale2) + shift2), MLP = Linear(GELU_tanh(Linear(·))).
4. (scale, shift) = Linear_norm_out(SiLU(temb)), scale first; v = proj_out(LN(I)·(1 + scale)
   + shift). The text stream is discarded.

Weights are a state dict under the checkpoint's own names (``transformer_blocks.{i}.attn.to_q
.weight`` …, numerics §1), read by the caller from the safetensors file; the config is the
diffusers ``config.json`` (``num_attention_heads``, ``axes_dims_rope``; eps 1e-6 and RoPE base
10000 are fixed in diffusers). Every result is float64.

The independence rule of ``ops.py`` holds here too: this module imports ``torch``, ``typing``
and ``drifttool.references.ops`` only — never ``drifttool.model`` or ``drifttool.ops``
(tests/model/test_model_reference.py checks it).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from drifttool.references import ops as ref

EPS = 1e-6
"""Every LayerNorm and RMSNorm of the model (numerics §2.3)."""
ROPE_THETA = 10000.0
"""RoPE base (``QwenEmbedRope``, numerics §2.2)."""


def _linear(weights: Mapping[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(``name.weight`` [out, in], ``name.bias`` [out]) of one Linear."""
    return weights[f"{name}.weight"], weights[f"{name}.bias"]


def embed_inputs(
    weights: Mapping[str, torch.Tensor], x: torch.Tensor, txt: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1: (temb [B, d], T [B, L, d], I [B, N, d]) from x [B, N, C], txt [B, L, Dj], tau [B]."""
    w1, b1 = _linear(weights, "time_text_embed.timestep_embedder.linear_1")
    w2, b2 = _linear(weights, "time_text_embed.timestep_embedder.linear_2")
    temb = ref.timestep_embed_mlp(tau, w1, b1, w2, b2)  # [B, d]
    t = ref.txt_in_rmsnorm_linear(txt, weights["txt_norm.weight"], *_linear(weights, "txt_in"), eps=EPS)  # [B, L, d]
    i = ref.latent_proj_gemm(x, *_linear(weights, "img_in"))  # [B, N, d]
    return temb, t, i


def modulation(weights: Mapping[str, torch.Tensor], name: str, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(shift1, scale1, gate1, shift2, scale2, gate2), each [B, d] = chunks of Linear(SiLU(temb))."""
    return tuple(ref.adaln_mod_projection(temb, *_linear(weights, name)).chunk(6, dim=-1))


def stream_qkv(
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    x: torch.Tensor,
    projections: tuple[str, str, str],
    gains: tuple[str, str],
    heads: int,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, S, H, Dh] of one stream x [B, S, d]: x·Wᵀ + b per projection, split into
    heads; q and k RMS-normalised over Dh with their gains, then rotated by the stream's RoPE
    table [S, Dh/2]."""
    q, k, v = ref.qkv_bias_gemm(x, *(t for name in projections for t in _linear(weights, prefix + name)), heads)
    q = ref.multi_axis_rope(ref.qk_rmsnorm(q, weights[f"{prefix}{gains[0]}.weight"], eps=EPS), table)
    k = ref.multi_axis_rope(ref.qk_rmsnorm(k, weights[f"{prefix}{gains[1]}.weight"], eps=EPS), table)
    return q, k, v


def joint_attention(
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    ih: torch.Tensor,
    th: torch.Tensor,
    heads: int,
    freqs: tuple[torch.Tensor, torch.Tensor],
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_img [B, N, d], A_txt [B, L, d]) of one block's attention (``prefix`` = ``….attn.``) on
    the modulated streams ih [B, N, d], th [B, L, d]; freqs = (image [N, Dh/2], text [L, Dh/2])
    RoPE tables, key_mask [B, L+N] bool over [text, image] or None."""
    qi, ki, vi = stream_qkv(weights, prefix, ih, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), heads, freqs[0])
    qt, kt, vt = stream_qkv(weights, prefix, th, ("add_q_proj", "add_k_proj", "add_v_proj"),
                            ("norm_added_q", "norm_added_k"), heads, freqs[1])
    q = torch.cat([qt, qi], dim=1)  # [B, L+N, H, Dh]: text first
    k = torch.cat([kt, ki], dim=1)
    v = torch.cat([vt, vi], dim=1)
    o = ref.joint_attention_fused(q, k, v, key_mask).flatten(2, 3)  # [B, L+N, d]
    L = th.shape[1]
    a_img = ref.attn_out_bias_gemm(o[:, L:], *_linear(weights, prefix + "to_out.0"))  # [B, N, d]
    a_txt = ref.attn_out_bias_gemm(o[:, :L], *_linear(weights, prefix + "to_add_out"))  # [B, L, d]
    return a_img, a_txt


def mlp(weights: Mapping[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """``name.net.2(GELU_tanh(name.net.0.proj(x)))``: [B, S, d] → [B, S, d]."""
    h = ref.mlp_up_gemm_gelu(x, *_linear(weights, f"{name}.net.0.proj"))  # [B, S, 4d]
    return ref.mlp_down_gemm(h, *_linear(weights, f"{name}.net.2"))


def block(
    weights: Mapping[str, torch.Tensor],
    index: int,
    i: torch.Tensor,
    t: torch.Tensor,
    temb: torch.Tensor,
    heads: int,
    freqs: tuple[torch.Tensor, torch.Tensor],
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 3, block ``index``: (I, T) [B, N, d], [B, L, d] → the same, numerics §2.3."""
    p = f"transformer_blocks.{index}."
    i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = modulation(weights, p + "img_mod.1", temb)
    t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = modulation(weights, p + "txt_mod.1", temb)
    ih = ref.adaln_modulation(i, i_shift1, i_scale1, eps=EPS)  # LN(I)·(1 + scale1) + shift1
    th = ref.adaln_modulation(t, t_shift1, t_scale1, eps=EPS)
    a_img, a_txt = joint_attention(weights, p + "attn.", ih, th, heads, freqs, key_mask)
    i = ref.adaln_gate_residual(i, i_gate1, a_img)  # I + gate1·A_img
    t = ref.adaln_gate_residual(t, t_gate1, a_txt)
    ih = ref.adaln_modulation(i, i_shift2, i_scale2, eps=EPS)  # LN(I)·(1 + scale2) + shift2
    th = ref.adaln_modulation(t, t_shift2, t_scale2, eps=EPS)
    i = ref.adaln_gate_residual(i, i_gate2, mlp(weights, p + "img_mlp", ih))  # I + gate2·MLP
    t = ref.adaln_gate_residual(t, t_gate2, mlp(weights, p + "txt_mlp", th))
    return i, t


def forward(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    x: torch.Tensor,
    txt: torch.Tensor,
    txt_mask: torch.Tensor | None,
    tau: torch.Tensor,
    img_grid: tuple[int, int],
) -> torch.Tensor:
    """Velocity v [B, N, 4·out_channels] float64 (numerics §2).

    Args:
        weights: tensor name → tensor, the checkpoint's names (any float dtype; upcast inside).
        config: diffusers ``config.json`` of the transformer.
        x: packed latents [B, N, in_channels], N = h·w, token n = i·w + j.
        txt: prompt embeddings [B, L, joint_attention_dim], right-padded.
        txt_mask: [B, L] (nonzero = valid token) or None: only a key mask of the attention.
        tau: [B] timestep ≈ σ, as the model receives it.
        img_grid: (h, w) patch grid of the whole batch.

    Raises:
        KeyError: a weight the model needs is missing.
    """
    h, w = img_grid
    B, N = x.shape[:2]
    L = txt.shape[1]
    heads = int(config["num_attention_heads"])
    temb, t, i = embed_inputs(weights, x, txt, tau)
    freqs = ref.rope_tables(h, w, L, tuple(config["axes_dims_rope"]), ROPE_THETA)  # [N, Dh/2], [L, Dh/2]
    key_mask = None
    if txt_mask is not None:
        key_mask = torch.cat([txt_mask.bool(), torch.ones(B, N, dtype=torch.bool)], dim=1)  # [B, L+N]
    for index in range(int(config["num_layers"])):
        i, t = block(weights, index, i, t, temb, heads, freqs, key_mask)
    y = ref.final_adaln_out(i, temb, *_linear(weights, "norm_out.linear"), eps=EPS)  # [B, N, d]
    return ref.latent_proj_gemm(y, *_linear(weights, "proj_out"))  # [B, N, 4·out_channels]
