"""The Qwen-Image MMDiT written as a sequence of named RFC operator calls.

    >>> from drifttool.model.config import tiny
    >>> from drifttool.model.mmdit import MMDiT, random_init_
    >>> from drifttool.runtime import Runtime
    >>> model = random_init_(MMDiT(tiny()), seed=0)
    >>> v = model(x, txt, txt_mask, tau, (4, 6), Runtime(mode="auto"))   # [B, 24, 64]

The modules hold the parameters under the checkpoint's own names (``img_in``, ``txt_norm``,
``transformer_blocks.{i}.attn.to_q``, ``img_mlp.net.0.proj``, ``norm_out.linear`` ...), so a
diffusers ``QwenImageTransformer2DModel`` state dict loads by name (numerics §1), and their
forwards state the math in data-flow order (``Block.forward`` in ``drifttool.model.mmdit_block``:
two gated residual lines per stream). The arithmetic itself happens in the operators, called by
RFC name through ``drifttool.ops.registry.call``; the model never branches on the backend. The
runtime mode requests a backend family (strict/audit → ``strict``, auto/off → ``production``),
the registry picks that family's implementation for the tensors' device, and every output is captured with
its identity (block, stream, op, layout). ``references/mmdit.py`` (``drifttool.references.mmdit``)
is the same forward in plain FP64, the judge of this one.

Call sites (block −1 = inputs, 0..num_layers−1 = blocks, num_layers = final):

==========  ======================  ======  ========================
block       operator                stream  layout
==========  ======================  ======  ========================
−1          timestep_embed_mlp      none    ``B.``
−1          txt_in_rmsnorm_linear   txt     ``BS.``
−1          latent_proj_gemm        img     ``BS.``      (img_in)
i           adaln_mod_projection    img/txt ``B.``
i           adaln_modulation        img/txt ``BS.``      (norm1, then norm2)
i           qkv_bias_gemm           img/txt (``BS..``,)×3
i           qk_rmsnorm              img/txt ``BS..``     (q then k)
i           multi_axis_rope         img/txt ``BS..``     (q then k)
i           joint_attention_fused   joint   ``BS..``     (see below)
i           ↳ joint_attn_qk_gemm    joint   ``B.SK``     (decomposed: strict at capture L2)
i           ↳ joint_attn_softmax    joint   ``B.SK``     (decomposed: strict at capture L2)
i           ↳ joint_attn_av_gemm    joint   ``BS..``     (decomposed: strict at capture L2)
i           attn_out_bias_gemm      img/txt ``BS.``
i           adaln_gate_residual     img/txt ``BS.``      (attention, then MLP)
i           mlp_up_gemm_gelu        img/txt ``BS.``
i           mlp_down_gemm           img/txt ``BS.``
num_layers  final_adaln_out         img     ``BS.``
num_layers  latent_proj_gemm        img     ``BS.``      (proj_out)
==========  ======================  ======  ========================

Attention is always one call of ``joint_attention_fused``. The strict family declares its fused
implementation byte-equal to the three unfused operators (``OpSpec.decomposition``), so when the
capture level asks for the ``[B, H, S, S]`` scores and probabilities (L2) dispatch runs — and
traces and captures — ``joint_attn_qk_gemm``, ``joint_attn_softmax``, ``joint_attn_av_gemm``
instead of the fused call (the trace then holds the three, not ``joint_attention_fused``); at L0/L1
the S×S tensors are not materialised for capture (design.md, "Digests"). Production runs SDPA at
every level (its trace entry notes at L2 that the internals were not captured).

Within a block the image-stream call precedes the text-stream call of the same operator. With a
LoRA adapter attached (``drifttool.model.lora``; any Linear, in or out of the blocks),
``lora_merge`` / ``lora_fuse`` (the consumer's block and stream, traced, not captured) computes
each adapted weight right before the operator that consumes it; in an unfused mode
``lora_delta`` computes the adapter branch from the operator's input instead, and the operator
adds it to its GEMM output (``delta``/``deltas``), or, where that input exists only inside the
operator (the timestep MLP, ``txt_in``, the modulation projections, ``norm_out``), the operator
receives the factors (``lora``) and adds the same branch itself. Under the strict family
(``unfused-fp32`` only) the block GEMMs receive the factors (``lora``) and add the branch in FP32
(``model.lora_calls.gemm_lora``); an unfused adapter outside them is refused.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import drifttool.ops  # noqa: F401  (every operator and built-in family, registered explicitly)
from drifttool.errors import UnsupportedConfigError
from drifttool.model.conditions import join_conditions
from drifttool.model.config import MMDiTConfig
from drifttool.model.lora_calls import adapted_weight, lora_branches, lora_deltas
from drifttool.model.mmdit_block import AttentionContext, Block, Gain, Linear
from drifttool.model.rope import BACKEND_TABLES, rope_tables
from drifttool.ops.registry import call
from drifttool.runtime import Runtime

_MODEL_DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# inputs: parameter containers (``MMDiT.forward`` calls their operators)


class TimestepEmbedder(nn.Module):
    """``time_text_embed.timestep_embedder.linear_1 [d, 256]`` / ``linear_2 [d, d]``."""

    def __init__(self, d: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear_1 = Linear(256, d, dtype=dtype)
        self.linear_2 = Linear(d, d, dtype=dtype)


class TimeTextEmbed(nn.Module):
    def __init__(self, d: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(d, dtype=dtype)


class NormOut(nn.Module):
    """``norm_out.linear [2d, d]`` (diffusers ``AdaLayerNormContinuous``, (scale, shift) order)."""

    def __init__(self, d: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear = Linear(d, 2 * d, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# the model


class MMDiT(nn.Module):
    """Qwen-Image double-stream transformer built from the RFC's named operators.

    Construct on any device with the usual context (``with torch.device("meta"):`` allocates
    nothing). Parameters are created uninitialised: load a checkpoint
    (``drifttool.model.checkpoint.load_checkpoint``) or call ``random_init_``.

    Args:
        config: the shape (``drifttool.model.config``).
        dtype: parameter dtype = model dtype W (fp32 or bf16).
    """

    graphable = True
    """Its forward may be replayed from CUDA graphs (``model.graphs.graphable``)."""

    def __init__(self, config: MMDiTConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in _MODEL_DTYPES:
            raise UnsupportedConfigError(f"model dtype must be float32 or bfloat16, got {dtype}")
        self.config = config
        d = config.inner_dim
        self.time_text_embed = TimeTextEmbed(d, dtype=dtype)
        self.txt_norm = Gain(config.joint_attention_dim, dtype=dtype)
        self.img_in = Linear(config.in_channels, d, dtype=dtype)
        self.txt_in = Linear(config.joint_attention_dim, d, dtype=dtype)
        self.transformer_blocks = nn.ModuleList([Block(config, dtype=dtype) for _ in range(config.num_layers)])
        self.norm_out = NormOut(d, dtype=dtype)
        self.proj_out = Linear(d, config.out_dim, dtype=dtype)

    gradient_checkpointing: bool = False
    """When true and autograd is recording, each block runs under ``torch.utils.checkpoint``
    (non-reentrant): its activations are recomputed in the backward instead of kept. The
    recomputation goes through the same operators with a silent copy of the runtime (no capture,
    a throwaway trace), so records and trace are those of the plain forward; v, logp and the
    gradients are byte-equal with and without it (tests/training/test_train_grad.py)."""

    @property
    def dtype(self) -> torch.dtype:
        """Model dtype W (the parameters' dtype)."""
        return self.img_in.weight.dtype

    def forward(
        self,
        x: torch.Tensor,
        txt: torch.Tensor,
        txt_mask: torch.Tensor | None,
        tau: torch.Tensor,
        img_grid: tuple[int, int],
        rt: Runtime,
        *,
        cond: torch.Tensor | None = None,
        cond_grids: tuple[tuple[int, int], ...] = (),
    ) -> torch.Tensor:
        """Velocity prediction v for packed latents x (numerics §2).

        Args:
            x: packed latents ``[B, N, in_channels]`` in W, N = h·w, token n = i·w + j.
            txt: prompt embeddings ``[B, L, joint_attention_dim]`` in W, right-padded.
            txt_mask: ``[B, L]`` bool (True = valid token) or None (no masking; the pipeline
                passes None when every row is all ones, §5.11). Only used as an attention key
                mask: padded text queries still produce (unused) outputs, RoPE uses the padded L.
            tau: ``[B]`` timestep ≈ σ (fp32); rounded to W inside ``timestep_embed_mlp`` as
                diffusers does.
            img_grid: (h, w) patch grid, shared by the whole batch.
            rt: runtime (mode → backend family, capture, identity scope). Attention is one
                ``joint_attention_fused`` call; dispatch may expand it (module docstring).
            cond: packed condition-image latents ``[B, Nc, in_channels]`` in W, or None (edit
                pipelines, ``drifttool.model.conditions``): the image stream is
                ``[x | cond]`` (noisy rows first), every operator runs on all N + Nc rows, and
                v is the first N rows of the output, as ``QwenImageEditPipeline`` slices it.
            cond_grids: the (h_k, w_k) patch grid of each condition image (Σ h_k·w_k = Nc),
                frame positions 1, 2, ... in the RoPE table (``model.rope``).

        Returns:
            v ``[B, N, out_dim]`` in W (with ``cond``: a view of the ``[B, N + Nc, out_dim]``
            output).

        Raises:
            UnsupportedConfigError: shapes or dtypes that do not match the model, or a backend
                the runtime mode cannot honour.
        """
        cfg = self.config
        h, w = (int(v) for v in img_grid)
        self._check_inputs(x, txt, txt_mask, tau, h, w)
        B, N = x.shape[:2]
        x, cond_grids = join_conditions(x, cond, cond_grids, self.dtype)  # [B, N + Nc, C]
        L = txt.shape[1]
        if txt_mask is not None and txt_mask.dtype != torch.bool:
            txt_mask = txt_mask.to(torch.bool)
        key_mask = None
        if txt_mask is not None:
            key_mask = torch.cat([txt_mask, torch.ones(B, x.shape[1], dtype=torch.bool, device=x.device)],
                                 dim=1)  # [B, L + N + Nc]
        img_freqs, txt_freqs = rope_tables(
            (h, w), L, axes_dims=cfg.axes_dims_rope, theta=cfg.rope_theta,
            algorithm=BACKEND_TABLES[rt.mode.family], device=x.device, cond_grids=cond_grids,
        )  # [N + Nc, Dh/2], [L, Dh/2] complex64: portable (strict) or diffusers' polar (production)
        ctx = AttentionContext(key_mask, img_freqs, txt_freqs)

        with rt.scope(block=-1):
            # temb = linear_2(SiLU(linear_1(sinusoid(τ)))); T = RMSNorm(txt)·Wᵀ + b; I = x·Wᵀ + b
            # (each weight LoRA-merged when adapted, or its unfused branch passed: drifttool.model.lora_calls)
            te = self.time_text_embed.timestep_embedder
            l1, l2 = te.linear_1, te.linear_2
            temb = call(rt, "timestep_embed_mlp", tau, adapted_weight(l1, rt, "none"), l1.bias,
                        adapted_weight(l2, rt, "none"), l2.bias, stream="none", layout="B.",
                        **lora_branches(rt, l1, l2))  # [B, d]
            t = call(rt, "txt_in_rmsnorm_linear", txt, self.txt_norm.weight, adapted_weight(self.txt_in, rt, "txt"),
                     self.txt_in.bias, eps=cfg.eps, stream="txt", layout="BS.",
                     **lora_branches(rt, self.txt_in))  # [B, L, d]
            i = call(rt, "latent_proj_gemm", x, adapted_weight(self.img_in, rt, "img"), self.img_in.bias,
                     stream="img", layout="BS.", **lora_deltas(x, rt, "img", self.img_in))  # [B, N, d]

        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        for index, block in enumerate(self.transformer_blocks):
            with rt.scope(block=index):
                if checkpointing:
                    i, t = _checkpointed(block, i, t, temb, ctx, rt)
                else:
                    i, t = block(i, t, temb, ctx, rt)

        with rt.scope(block=cfg.num_layers):
            # (scale, shift) = SiLU(temb)·Wᵀ + b, scale first; LN(I)·(1 + scale) + shift; then ·Wᵀ + b
            norm = self.norm_out.linear
            y = call(rt, "final_adaln_out", i, temb, adapted_weight(norm, rt, "img"), norm.bias,
                     eps=cfg.eps, stream="img", layout="BS.", **lora_branches(rt, norm))  # [B, N + Nc, d]
            v = call(rt, "latent_proj_gemm", y, adapted_weight(self.proj_out, rt, "img"), self.proj_out.bias,
                     stream="img", layout="BS.", **lora_deltas(y, rt, "img", self.proj_out))  # [B, N + Nc, out_dim]
        return v if cond is None else v[:, :N]  # the noisy rows, as the edit pipelines slice

    def _check_inputs(
        self,
        x: torch.Tensor,
        txt: torch.Tensor,
        txt_mask: torch.Tensor | None,
        tau: torch.Tensor,
        h: int,
        w: int,
    ) -> None:
        cfg = self.config
        W = self.dtype
        bad = []
        if x.dim() != 3 or x.shape[-1] != cfg.in_channels:
            bad.append(f"x must be [B, N, {cfg.in_channels}], got {tuple(x.shape)}")
        elif x.shape[1] != h * w:
            bad.append(f"x has N={x.shape[1]} tokens but img_grid={(h, w)} gives {h * w}")
        if txt.dim() != 3 or txt.shape[-1] != cfg.joint_attention_dim or txt.shape[0] != x.shape[0]:
            bad.append(f"txt must be [{x.shape[0]}, L, {cfg.joint_attention_dim}], got {tuple(txt.shape)}")
        if x.dtype != W or txt.dtype != W:
            bad.append(f"x ({x.dtype}) and txt ({txt.dtype}) must be in the model dtype {W}")
        if txt_mask is not None and tuple(txt_mask.shape) != tuple(txt.shape[:2]):
            bad.append(f"txt_mask must be {tuple(txt.shape[:2])}, got {tuple(txt_mask.shape)}")
        if tau.dim() != 1 or tau.shape[0] != x.shape[0] or not tau.is_floating_point():
            bad.append(f"tau must be a float [{x.shape[0]}] tensor, got {tau.dtype} {tuple(tau.shape)}")
        if bad:
            raise UnsupportedConfigError("MMDiT.forward: " + "; ".join(bad))


def _checkpointed(block: Block, i, t, temb, ctx: AttentionContext, rt: Runtime):
    """``block(i, t, temb, ctx, rt)`` under non-reentrant activation checkpointing.

    The first call (the forward) uses ``rt``; a later call is the backward's recomputation and
    uses a copy of ``rt`` with the forward's identity scope, no recorder and its own trace, so
    it adds no records, trace calls or call-counter increments; it dispatches as the forward did
    (``Runtime.internals`` pinned: a fused operator expanded for capture is expanded again, so
    the recomputation saves the same tensors).
    """
    again = rt.recomputation()  # the forward's scope and dispatch decisions, kept for later
    calls = []

    def run(i_, t_, temb_):
        calls.append(None)
        r = rt if len(calls) == 1 else again.recomputation()  # fresh counters per re-run
        return block(i_, t_, temb_, ctx, r)

    # no RNG state kept: a block draws no random numbers, and reading the CUDA generator's state is
    # refused inside a CUDA graph capture (``model.graphs_train`` captures checkpointed steps)
    return checkpoint(run, i, t, temb, use_reentrant=False, preserve_rng_state=False)


@torch.no_grad()
def random_init_(
    model: MMDiT, *, seed: int = 0, randn: Callable[[torch.Size], torch.Tensor] | None = None
) -> MMDiT:
    """Fill every parameter deterministically (CPU fp32 generator, sorted key order, then cast).

    Weights ``~ N(0, 1/fan_in)``, biases ``~ N(0, 0.02²)``, gains ``1 + N(0, 0.1²)``. The same seed
    gives the same bytes on every device and for every model dtype (values drawn in fp32, then
    rounded) on one CPU dispatch level. ``randn(shape)`` (fp32 standard normals, called once per
    parameter in sorted name order) replaces the seeded ``torch.randn``, e.g. with portable
    normals (``fixtures/build_tiny.py``). Returns the model.
    """
    if randn is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def randn(shape: torch.Size) -> torch.Tensor:
            return torch.randn(shape, generator=gen)

    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        if name.endswith(".bias"):
            val = randn(p.shape) * 0.02
        elif p.dim() == 1:  # RMSNorm gains
            val = 1 + randn(p.shape) * 0.1
        else:
            val = randn(p.shape) / (p.shape[1] ** 0.5)
        p.copy_(val.to(p.dtype))
    return model
