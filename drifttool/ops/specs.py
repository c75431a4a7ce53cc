"""Declarations of the RFC's WS1 operators: name, contract id, differentiability, dtypes.

Call signatures (every backend implements exactly these; all tensors on one device):

=======================  ==================================================================
operator                 signature → result
=======================  ==================================================================
latent_pack_unpack       (z, direction="pack") z [B,C,H',W'] or [B,C,1,H',W'] → [B,N,4C];
                         (x, direction="unpack", grid=(h, w)) x [B,N,4C] → [B,C,1,2h,2w]
latent_normalize         (z, mean [C], std [C], inverse=False) z [B,C,...] → same shape;
                         forward (z − mean)·(1/std), inverse z / (1/std) + mean (numerics §3.5)
latent_proj_gemm         (x [B,S,K], w [N,K], b [N]) → [B,S,N]   (img_in 64→d, proj_out d→64)
txt_in_rmsnorm_linear    (e [B,L,Dj], gain [Dj], w [d,Dj], b [d], eps=1e-6) → [B,L,d]
timestep_embed_mlp       (tau [B] fp32, w1 [d,256], b1, w2 [d,d], b2) → temb [B,d]
adaln_mod_projection     (temb [B,d], w [6d,d], b [6d]) → SiLU(temb)·wᵀ + b  [B,6d]
adaln_modulation         (x [B,S,d], shift [B,d], scale [B,d], eps=1e-6) → LN(x)(1+scale)+shift
adaln_gate_residual      (x [B,S,d], gate [B,d], y [B,S,d]) → x + gate·y
qkv_bias_gemm            (x [B,S,d], wq, bq, wk, bk, wv, bv, heads) → (q, k, v) [B,S,H,Dh]
qk_rmsnorm               (x [B,S,H,Dh], gain [Dh], eps=1e-6) → [B,S,H,Dh]
multi_axis_rope          (x [B,S,H,Dh], freqs [S,Dh/2] complex64) → [B,S,H,Dh] (interleaved pairs)
joint_attn_qk_gemm       (q [B,S,H,Dh], k [B,S,H,Dh], key_mask=None, *, text_len=None) → scores
                         [B,H,S,S] fp32, scaled 1/√Dh (key_mask, text_len: strict backward only)
joint_attn_softmax       (scores [B,H,S,S], key_mask [B,S] bool or None, *, text_len=None)
                         → probs [B,H,S,S] fp32
joint_attn_av_gemm       (probs [B,H,S,S], v [B,S,H,Dh], key_mask, *, text_len=None) → [B,S,H,Dh]
                         (dtype of v; probs cast to v's dtype before the value product)
joint_attention_fused    (q, k, v, key_mask, *, text_len=None) → [B,S,H,Dh]; declares the three
                         above as its decomposition (strict: byte-equal to it; dispatch expands
                         it at L2)
attn_out_bias_gemm       (x [B,S,d], w [d,d], b [d]) → [B,S,d]
mlp_up_gemm_gelu         (x [B,S,d], w [4d,d], b [4d]) → GELU_tanh(x·wᵀ + b) [B,S,4d]
mlp_down_gemm            (x [B,S,4d], w [d,4d], b [d]) → [B,S,d]
final_adaln_out          (x [B,N,d], temb [B,d], w [2d,d], b [2d], eps=1e-6)
                         → LN(x)(1+scale)+shift with (scale, shift) = split(SiLU(temb)·wᵀ+b)
cfg_combine_renorm       see drifttool/ops/scheduler.py
flow_sigma_table         see drifttool/ops/scheduler.py
flow_sde_step_logp       see drifttool/ops/scheduler.py
=======================  ==================================================================

Joint sequence order is [text, image] (numerics §2.4). ``key_mask`` is the joint key mask:
[txt_mask, ones(N)]. ``text_len`` is the padded text length L (where image keys start): the
strict contract v2 blocks text and image keys separately (None = 0); production checks it only.

Contract versions: ``.v2`` marks the operators whose bytes follow strict contract v2 (segmented
GEMM K reductions and per-sample row reductions of gradients; attention over fixed 64-key blocks
in global key order with a fixed merge of partial states; docs/strict-arithmetic.md); their
``.v1`` bytes are no longer produced.
"""

from __future__ import annotations

import torch

from drifttool.ops.registry import Decomposition, OpSpec, declare

_FLOATS = (torch.float32, torch.bfloat16)

WS1_OPERATORS = (
    "latent_pack_unpack", "latent_normalize", "latent_proj_gemm", "txt_in_rmsnorm_linear",
    "timestep_embed_mlp", "adaln_mod_projection", "adaln_modulation", "adaln_gate_residual",
    "qkv_bias_gemm", "qk_rmsnorm", "multi_axis_rope", "joint_attn_qk_gemm", "joint_attn_softmax",
    "joint_attn_av_gemm", "joint_attention_fused", "attn_out_bias_gemm", "mlp_up_gemm_gelu",
    "mlp_down_gemm", "final_adaln_out", "cfg_combine_renorm", "flow_sigma_table", "flow_sde_step_logp",
)
"""The RFC's 22 WS1 rows in its table order (the last three are declared in ``scheduler.py``).
Other declared operators (e.g. ``lora_merge``) are not RFC rows."""


def _d(name: str, summary: str, *, version: int = 1, differentiable: bool = True,
       dtypes=_FLOATS, decomposition: Decomposition | None = None) -> OpSpec:
    return declare(
        OpSpec(
            name=name,
            contract=f"qwenimage.{name}.v{version}",
            differentiable=differentiable,
            dtypes=dtypes,
            summary=summary,
            decomposition=decomposition,
        )
    )


def _joint_attention_unfused(step, q, k, v, key_mask=None, *, text_len=None):
    """``joint_attention_fused`` as its three RFC rows: scores and probabilities ``[B,H,S,S]``
    fp32 (captured as ``B.SK``), then the output ``[B,S,H,Dh]`` (the fused call's layout)."""
    scores = step("joint_attn_qk_gemm", q, k, key_mask, text_len=text_len)
    probs = step("joint_attn_softmax", scores, key_mask, text_len=text_len)
    return step("joint_attn_av_gemm", probs, v, key_mask, text_len=text_len)


LATENT_PACK_UNPACK = _d("latent_pack_unpack", "2x2 patchify / unpatchify of 16-channel latents")
LATENT_NORMALIZE = _d("latent_normalize", "per-channel (z - mean) * std_inv and its inverse")
LATENT_PROJ_GEMM = _d("latent_proj_gemm", "image input 64->d and output d->64 projections", version=2)
TXT_IN_RMSNORM_LINEAR = _d("txt_in_rmsnorm_linear", "text RMSNorm(3584) + Linear 3584->d", version=2)
TIMESTEP_EMBED_MLP = _d("timestep_embed_mlp", "256-ch cos-first sinusoid + MLP 256->d->d", version=2)
ADALN_MOD_PROJECTION = _d("adaln_mod_projection", "per-stream SiLU + Linear d->6d", version=2)
ADALN_MODULATION = _d("adaln_modulation", "parameter-free LayerNorm, then (1+scale), +shift", version=2)
ADALN_GATE_RESIDUAL = _d("adaln_gate_residual", "x + gate * sublayer(h)", version=2)
QKV_BIAS_GEMM = _d("qkv_bias_gemm", "per-stream Q/K/V projections with bias", version=2)
QK_RMSNORM = _d("qk_rmsnorm", "learned-gain per-head RMSNorm of q and k", version=2)
MULTI_AXIS_ROPE = _d("multi_axis_rope", "three-axis [16,56,56] interleaved-pair RoPE")
JOINT_ATTN_QK_GEMM = _d("joint_attn_qk_gemm", "joint QK^T / sqrt(d) over [text, image]", version=2)
JOINT_ATTN_SOFTMAX = _d("joint_attn_softmax", "key-masked softmax, fixed reduction order", version=2)
JOINT_ATTN_AV_GEMM = _d("joint_attn_av_gemm", "attention-weighted value accumulation", version=2)
JOINT_ATTENTION_FUSED = _d(
    "joint_attention_fused", "fused attention, byte-equal to the unfused", version=2,
    decomposition=Decomposition(
        ops=("joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm"),
        layouts={"joint_attn_qk_gemm": "B.SK", "joint_attn_softmax": "B.SK"},
        run=_joint_attention_unfused,
    ),
)
ATTN_OUT_BIAS_GEMM = _d("attn_out_bias_gemm", "per-stream attention output projection", version=2)
MLP_UP_GEMM_GELU = _d("mlp_up_gemm_gelu", "MLP up projection d->4d + tanh GELU", version=2)
MLP_DOWN_GEMM = _d("mlp_down_gemm", "MLP down projection 4d->d", version=2)
FINAL_ADALN_OUT = _d("final_adaln_out", "final image-stream (scale, shift) modulation", version=2)
