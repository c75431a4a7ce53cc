"""The RFC's operators, declared once: ``OPERATORS``, one row per operator (the transformer's WS1
rows, then Phase B's VAE rows).

    >>> OPERATORS["qk_rmsnorm"]
    Operator(name='qk_rmsnorm', version=2, summary='learned-gain per-head RMSNorm of q and k',
             streams=('img', 'txt'), sites=('block',), layout='BS..', ...)

Each row (``Operator``) holds what the rest of the code reads about the operator: its contract
version, summary, the streams and sites the rollout calls it at, the capture layout of its
outputs, differentiability, strict dtypes and decomposition. Importing this module declares an
``OpSpec`` per row (``registry.declare``); the operator docs (``tools/operator_docs.py``), the
reference accuracy cases, the parallel rule table (``drifttool.distributed.rules``) and the
capture adapters read the rows. Adding an operator: a row here, its implementations (strict,
production, its reference in ``references/ops.py``) and its page in ``docs/operators/``.

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
te_*                     the text encoder's rows (te_vision_*: its vision tower and the
                         vision tokens of edit prompts): see drifttool/ops/text_encoder/ and
                         docs/operators/text_encoder.md
vae_causal_conv3d        (x [B,Ci,T,H,W], w [Co,Ci,kt,kh,kw], b [Co], padding=0, residual=None)
                         → [B,Co,T,H,W]: zeros 2·p before the frames, p around H and W
vae_rms_norm             (x [B,C,...], gamma [C,1,..], silu=False) → x/‖x‖₂·√C·γ, then SiLU
vae_resample             (x [B,C,T,H,W], w [Co,C,3,3], b [Co], mode) → per frame: "upsample"
                         nearest ×2 + conv 3×3 pad 1, "downsample" pad (0,1,0,1) + conv stride 2
vae_mid_attention        (x [B,C,T,H,W], gamma, w_qkv [3C,C,1,1], b_qkv, w_proj [C,C,1,1], b_proj)
                         → x + proj(attention(qkv(rms_norm(x)))) per frame, one head over H·W
vae_latent_normalize     (z, mean [C], std [C], inverse=False) z [B,C,...] → same shape; forward
                         (z − mean)/std (edit pipelines), inverse z / (1/std) + mean (decode)
vae_image_resize         (image [1,H,W,3] uint8, height, width, resample=1) → [1,height,width,3]
                         uint8: Pillow's resize (the edit pipelines' condition images)
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

from dataclasses import dataclass

import torch

from drifttool.components import DEFAULT_COMPONENT
from drifttool.ops.declaration import Decomposition, OpSpec
from drifttool.ops.registry import declare

_FLOATS = (torch.float32, torch.bfloat16)

STREAMS = ("img", "txt", "joint", "none")
"""Identity streams of a call (``registry.call``'s ``stream``)."""

SITES = ("inputs", "block", "final", "sampler")
"""Where the rollout calls an operator: block −1 (the MMDiT's inputs), every block
0..num_layers−1, block num_layers (the MMDiT's output), block −2 (the sampler, once per step)."""

Layout = str | tuple[str, ...] | None


@dataclass(frozen=True, kw_only=True)
class Operator:
    """One RFC WS1 row.

    Attributes:
        name: the RFC row name.
        version: contract version: the contract id is ``qwenimage.<name>.v<version>``.
        summary: one line for the docs index.
        streams: the streams the rollout calls it in (``STREAMS``); ``()`` for the pipeline's
            latent operators, which the MMDiT forward does not call.
        sites: where the rollout calls it (``SITES``); ``()`` likewise.
        layout: capture layout of its output (one per output for tuple outputs;
            ``capture.layout`` tags), the same in every stream; ``None`` where it is not called.
        differentiable: whether it has a backward.
        dtypes: input dtypes the strict family accepts.
        decomposition: the finer operators it is byte-equal to (``registry.Decomposition``;
            their layouts are their own rows').
        component: the model it belongs to (``drifttool.components.COMPONENTS``): the
            ``mmdit`` (the WS1 rows, its sampler's included), the Qwen2.5-VL ``text_encoder``
            or the ``vae``.
    """

    name: str
    version: int
    summary: str
    streams: tuple[str, ...]
    sites: tuple[str, ...]
    layout: Layout
    differentiable: bool = True
    dtypes: tuple[torch.dtype, ...] = _FLOATS
    decomposition: tuple[str, ...] = ()
    component: str = DEFAULT_COMPONENT

    @property
    def contract(self) -> str:
        return f"qwenimage.{self.name}.v{self.version}"

    @property
    def sampler(self) -> bool:
        """A sampler row (``cfg_combine_renorm``, ``flow_sigma_table``, ``flow_sde_step_logp``);
        the others are the transformer's."""
        return "sampler" in self.sites


def _joint_attention_unfused(step, q, k, v, key_mask=None, *, text_len=None):
    """``joint_attention_fused`` as its three RFC rows: scores and probabilities ``[B,H,S,S]``
    fp32 (captured as ``B.SK``), then the output ``[B,S,H,Dh]`` (the fused call's layout)."""
    scores = step("joint_attn_qk_gemm", q, k, key_mask, text_len=text_len)
    probs = step("joint_attn_softmax", scores, key_mask, text_len=text_len)
    return step("joint_attn_av_gemm", probs, v, key_mask, text_len=text_len)


_RUNS = {"joint_attention_fused": _joint_attention_unfused}  # how each decomposition runs

_IMG_TXT = ("img", "txt")
_TE = dict(component="text_encoder", streams=("txt",), differentiable=False)
"""The text encoder's rows: stream ``txt``; site ``inputs`` (block −1: tokens and their
embedding), ``block`` (decoder layer 0..layers−1), ``final`` (block ``layers``: the final norm
and the prompt extraction); frozen weights, no backward."""
_TV = dict(component="text_encoder", streams=("img",), differentiable=False)
"""The vision tower's rows: stream ``img``, packed patches of every prompt image of the call
(layout ``S``: no batch axis, one record with sample −1), except the per-image input rows
(``B`` = the image's prompt); sites as ``_TE``'s over the tower's blocks (``final``: the
merger)."""
_BLOCK = ("block",)


def _rows(*rows: Operator) -> dict[str, Operator]:
    return {r.name: r for r in rows}


OPERATORS: dict[str, Operator] = _rows(
    Operator(name="latent_pack_unpack", version=1, summary="2x2 patchify / unpatchify of 16-channel latents",
             streams=(), sites=(), layout=None),
    Operator(name="latent_normalize", version=1, summary="per-channel (z - mean) * std_inv and its inverse",
             streams=(), sites=(), layout=None),
    Operator(name="latent_proj_gemm", version=2, summary="image input 64->d and output d->64 projections",
             streams=("img",), sites=("inputs", "final"), layout="BS."),
    Operator(name="txt_in_rmsnorm_linear", version=2, summary="text RMSNorm(3584) + Linear 3584->d",
             streams=("txt",), sites=("inputs",), layout="BS."),
    Operator(name="timestep_embed_mlp", version=2, summary="256-ch cos-first sinusoid + MLP 256->d->d",
             streams=("none",), sites=("inputs",), layout="B."),
    Operator(name="adaln_mod_projection", version=2, summary="per-stream SiLU + Linear d->6d",
             streams=_IMG_TXT, sites=_BLOCK, layout="B."),
    Operator(name="adaln_modulation", version=2, summary="parameter-free LayerNorm, then (1+scale), +shift",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS."),
    Operator(name="adaln_gate_residual", version=2, summary="x + gate * sublayer(h)",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS."),
    Operator(name="qkv_bias_gemm", version=2, summary="per-stream Q/K/V projections with bias",
             streams=_IMG_TXT, sites=_BLOCK, layout=("BS..",) * 3),
    Operator(name="qk_rmsnorm", version=2, summary="learned-gain per-head RMSNorm of q and k",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS.."),
    Operator(name="multi_axis_rope", version=1, summary="three-axis [16,56,56] interleaved-pair RoPE",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS.."),
    Operator(name="joint_attn_qk_gemm", version=2, summary="joint QK^T / sqrt(d) over [text, image]",
             streams=("joint",), sites=_BLOCK, layout="B.SK"),
    Operator(name="joint_attn_softmax", version=2, summary="key-masked softmax, fixed reduction order",
             streams=("joint",), sites=_BLOCK, layout="B.SK"),
    Operator(name="joint_attn_av_gemm", version=2, summary="attention-weighted value accumulation",
             streams=("joint",), sites=_BLOCK, layout="BS.."),
    Operator(name="joint_attention_fused", version=2, summary="fused attention, byte-equal to the unfused",
             streams=("joint",), sites=_BLOCK, layout="BS..",
             decomposition=("joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm")),
    Operator(name="attn_out_bias_gemm", version=2, summary="per-stream attention output projection",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS."),
    Operator(name="mlp_up_gemm_gelu", version=2, summary="MLP up projection d->4d + tanh GELU",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS."),
    Operator(name="mlp_down_gemm", version=2, summary="MLP down projection 4d->d",
             streams=_IMG_TXT, sites=_BLOCK, layout="BS."),
    Operator(name="final_adaln_out", version=2, summary="final image-stream (scale, shift) modulation",
             streams=("img",), sites=("final",), layout="BS."),
    Operator(name="cfg_combine_renorm", version=1,
             summary="u + s(c - u), rescaled per token to the norm of c over the channel axis",
             streams=("img",), sites=("sampler",), layout="BS."),
    Operator(name="flow_sigma_table", version=1,
             summary="linspace(1,1/N,N), exponential dynamic shift, terminal stretch to 0.02, append 0",
             streams=("none",), sites=("sampler",), layout=".", differentiable=False,
             dtypes=(torch.float32,)),
    Operator(name="flow_sde_step_logp", version=1,
             summary="Flow-GRPO 'sde' transition and Gaussian log-prob (mean over non-batch dims), FP32",
             streams=("img",), sites=("sampler",), layout=("BS.", "B", "BS.", "B")),
    # the Qwen2.5-VL text encoder (RFC Phase B, qwen25vl_text_contract; drifttool.text_encoder)
    Operator(name="te_tokenize", version=1, summary="chat template, BPE ids, right padding",
             sites=("inputs",), layout=None, dtypes=(), **_TE),
    Operator(name="te_embed_tokens", version=1, summary="token embedding lookup",
             sites=("inputs",), layout="BS.", **_TE),
    Operator(name="te_rmsnorm", version=1, summary="Qwen2 RMSNorm (FP32 statistics, gain after the cast)",
             sites=("block", "final"), layout="BS.", **_TE),
    Operator(name="te_qkv_bias_gemm", version=1, summary="Q/K/V projections with bias (GQA heads)",
             sites=("block",), layout=("BS..",) * 3, **_TE),
    Operator(name="te_mrope", version=1, summary="Qwen2.5-VL multimodal RoPE (rotate-half, 3 position axes)",
             sites=("block",), layout="BS..", **_TE),
    Operator(name="te_causal_attention", version=1, summary="causal GQA attention with key padding",
             sites=("block",), layout="BS..", **_TE),
    Operator(name="te_attn_out_residual", version=1, summary="x + o_proj(attention), no bias",
             sites=("block",), layout="BS.", **_TE),
    Operator(name="te_mlp_gate_up_silu", version=1, summary="SiLU(gate_proj(h)) * up_proj(h)",
             sites=("block",), layout="BS.", **_TE),
    Operator(name="te_mlp_down_residual", version=1, summary="x + down_proj(m)",
             sites=("block",), layout="BS.", **_TE),
    Operator(name="te_prompt_extract", version=1,
             summary="valid rows, drop the template prefix, right re-pad, mask",
             sites=("final",), layout=("BS.", "BS"), **_TE),
    # the vision tower and the vision tokens of edit prompts (RFC Phase B, edit_pipeline_contract;
    # drifttool.text_encoder.vision): one packed call over every prompt image of the encode call
    Operator(name="te_vision_resize", version=1, summary="prompt image smart resize (Pillow resampling)",
             sites=("inputs",), layout="B...", dtypes=(), **_TV),
    Operator(name="te_vision_patchify", version=1, summary="rescale, normalize, 3x2x14x14 patches, grid",
             sites=("inputs",), layout=("BS.", "B."), dtypes=(), **_TV),
    Operator(name="te_vision_patch_embed", version=1, summary="patch embedding (Conv3d, stride = kernel)",
             sites=("inputs",), layout="S.", **_TV),
    Operator(name="te_vision_rope_table", version=1, summary="axial (row, col) RoPE cos/sin table",
             sites=("inputs",), layout=("S.", "S."), **_TV),
    Operator(name="te_vision_rmsnorm", version=1, summary="vision block RMSNorm (norm1, norm2)",
             sites=("block",), layout="S.", **_TV),
    Operator(name="te_vision_qkv", version=1, summary="fused Q/K/V projection with bias",
             sites=("block",), layout=("S..",) * 3, **_TV),
    Operator(name="te_vision_rope", version=1, summary="rotate-half RoPE of q and k in FP32",
             sites=("block",), layout=("S..", "S.."), **_TV),
    Operator(name="te_vision_attention", version=1,
             summary="bidirectional attention within cu_seqlens segments (windows or images)",
             sites=("block",), layout="S..", **_TV),
    Operator(name="te_vision_attn_out_residual", version=1, summary="x + proj(attention) with bias",
             sites=("block",), layout="S.", **_TV),
    Operator(name="te_vision_mlp_gate_up_silu", version=1, summary="SiLU(gate_proj(h)) * up_proj(h), biases",
             sites=("block",), layout="S.", **_TV),
    Operator(name="te_vision_mlp_down_residual", version=1, summary="x + down_proj(m) with bias",
             sites=("block",), layout="S.", **_TV),
    Operator(name="te_vision_merger", version=1, summary="RMSNorm, 2x2 merge, Linear + GELU(erf) + Linear",
             sites=("final",), layout="S.", **_TV),
    Operator(name="te_vision_rope_index", version=1,
             summary="mRoPE (t, h, w) positions of prompts with vision tokens",
             sites=("inputs",), layout=".BS", dtypes=(), **_TE),
    Operator(name="te_vision_scatter", version=1, summary="vision embeddings into the <|image_pad|> rows",
             sites=("inputs",), layout="BS.", **_TE),
    # Phase B: the VAE (``vae_contract``): called by ``drifttool.model.vae``, not by the MMDiT
    # forward; forward only, run replicated under every parallel layout.
    Operator(name="vae_causal_conv3d", version=1, summary="causal 3-D convolution (time zeros in front)",
             streams=(), sites=(), layout="B....", differentiable=False, component="vae"),
    Operator(name="vae_rms_norm", version=1, summary="channel L2 normalisation * sqrt(C) * gamma, optional SiLU",
             streams=(), sites=(), layout="B....", differentiable=False, component="vae"),
    Operator(name="vae_resample", version=1, summary="per-frame nearest x2 upsample / stride-2 downsample + conv 3x3",
             streams=(), sites=(), layout="B....", differentiable=False, component="vae"),
    Operator(name="vae_mid_attention", version=1, summary="mid-block single-head spatial self-attention + residual",
             streams=(), sites=(), layout="B....", differentiable=False, component="vae"),
    Operator(name="vae_latent_normalize", version=1, summary="per-channel (z - mean) / std and z / (1/std) + mean",
             streams=(), sites=(), layout="B....", differentiable=False, component="vae"),
    # the VAE's image processor (the edit pipelines' condition images, before the encode)
    Operator(name="vae_image_resize", version=1, summary="condition image resize (Pillow resampling)",
             streams=(), sites=(), layout="B...", differentiable=False, dtypes=(), component="vae"),
)
"""The RFC's 22 WS1 rows in its table order, then the text encoder's rows in program order,
then the VAE's (Phase B). Other declared operators (``lora_merge``, ...) are not RFC rows."""

WS1_OPERATORS = tuple(n for n, r in OPERATORS.items() if r.component == DEFAULT_COMPONENT)
"""The RFC's WS1 rows' names (the MMDiT and its sampler), in its table order."""

TEXT_ENCODER_OPERATORS = tuple(n for n, r in OPERATORS.items() if r.component == "text_encoder")
"""The text encoder's rows' names, in program order."""

VISION_OPERATORS = tuple(n for n in TEXT_ENCODER_OPERATORS if n.startswith("te_vision_"))
"""The text encoder's rows that only prompts with images call (``te_vision_*``): the vision
tower, its inputs, and the vision tokens' positions and embeddings in the prompt."""

VAE_OPERATORS = tuple(n for n, r in OPERATORS.items() if r.component == "vae")
"""The VAE's rows (Phase B, ``vae_contract``): the model's, then its image processor's."""

VAE_MODEL_OPERATORS = tuple(n for n in VAE_OPERATORS if n != "vae_image_resize")
"""The rows the VAE model calls (``drifttool.model.vae``); ``vae_image_resize`` is the edit
pipelines' image processor's (``drifttool.edit_images``), called before the encode."""

TRANSFORMER_OPERATORS = tuple(n for n in WS1_OPERATORS if not OPERATORS[n].sampler)
"""The transformer's rows (every row but the sampler's three)."""


def _declare(row: Operator) -> OpSpec:
    dec = None
    if row.decomposition:
        dec = Decomposition(ops=row.decomposition,
                            layouts={op: OPERATORS[op].layout for op in row.decomposition},
                            run=_RUNS[row.name])
    return declare(OpSpec(name=row.name, contract=row.contract, differentiable=row.differentiable,
                          dtypes=row.dtypes, summary=row.summary, decomposition=dec,
                          component=row.component))


for _row in OPERATORS.values():
    _declare(_row)
