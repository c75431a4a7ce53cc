"""The Qwen-Image MMDiT written as a sequence of named RFC operator calls.

    >>> from drifttool.model.config import tiny
    >>> from drifttool.model.mmdit import MMDiT, random_init_
    >>> from drifttool.runtime import Runtime
    >>> model = random_init_(MMDiT(tiny()), seed=0)
    >>> v = model(x, txt, txt_mask, tau, (4, 6), Runtime(mode="auto"))   # [B, 24, 64]

The modules hold the parameters under the checkpoint's own names (``img_in``, ``txt_norm``,
``transformer_blocks.{i}.attn.to_q``, ``img_mlp.net.0.proj``, ``norm_out.linear`` ...), so a
diffusers ``QwenImageTransformer2DModel`` state dict loads by name (numerics §1), and their
forwards state the math in data-flow order (``Block.forward``: two gated residual lines per
stream). The arithmetic itself happens in the operators, called by RFC name through
``drifttool.ops.registry.call``; the model never branches on the backend. The runtime mode
requests a backend family (strict/audit → ``strict``, auto/off → ``production``), the registry
picks that family's implementation for the tensors' device, and every output is captured with
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
LoRA adapter attached (``drifttool.model.lora``), ``lora_merge`` / ``lora_fuse`` (stream img/txt,
traced, not captured) computes each adapted weight right before the operator that consumes it;
in an unfused mode ``lora_delta`` computes the adapter branch from the operator's input instead,
and the operator adds it to its GEMM output (``delta``/``deltas``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import drifttool.ops  # noqa: F401  (every operator and built-in family, registered explicitly)
from drifttool.errors import UnsupportedConfigError
from drifttool.model.config import MMDiTConfig
from drifttool.model.lora import adapted_weight, lora_deltas
from drifttool.model.rope import BACKEND_TABLES, rope_tables
from drifttool.ops.registry import call
from drifttool.runtime import Runtime

_MODEL_DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# inputs: parameter containers (``MMDiT.forward`` calls their operators)


class Linear(nn.Module):
    """``weight [out, in]`` and ``bias [out]``, as ``nn.Linear`` stores them."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))


class Gain(nn.Module):
    """A learned RMSNorm gain ``weight [dim]`` (diffusers ``RMSNorm``, no bias)."""

    def __init__(self, dim: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))


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


# ---------------------------------------------------------------------------------------------
# modulation (numerics §2.3)


class Modulation(NamedTuple):
    """One stream's modulation vectors, each ``[B, d]``, in the checkpoint's chunk order of
    ``img_mod`` / ``txt_mod`` = ``Linear(SiLU(temb))`` ``[B, 6d]``."""

    shift1: torch.Tensor
    scale1: torch.Tensor
    gate1: torch.Tensor
    shift2: torch.Tensor
    scale2: torch.Tensor
    gate2: torch.Tensor


def _modulation(mod: nn.ModuleDict, temb: torch.Tensor, stream: str, rt: Runtime) -> Modulation:
    """``SiLU(temb)·Wᵀ + b`` split into six: temb ``[B, d]`` → 6 × ``[B, d]``."""
    m = call(rt, "adaln_mod_projection", temb, mod["1"].weight, mod["1"].bias, stream=stream, layout="B.")  # [B, 6d]
    return Modulation(*m.chunk(6, dim=-1))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, stream: str,
              rt: Runtime) -> torch.Tensor:
    """adaLN: ``LN(x)·(1 + scale) + shift``, LN without affine (biased variance, ``eps``);
    x ``[B, S, d]``, shift/scale ``[B, d]`` broadcast over tokens → ``[B, S, d]``."""
    return call(rt, "adaln_modulation", x, shift, scale, eps=eps, stream=stream, layout="BS.")


def _gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, stream: str, rt: Runtime) -> torch.Tensor:
    """``x + gate·y``: x, y ``[B, S, d]``, gate ``[B, d]`` broadcast over tokens."""
    return call(rt, "adaln_gate_residual", x, gate, y, stream=stream, layout="BS.")


# ---------------------------------------------------------------------------------------------
# joint attention (numerics §2.2, §2.4) and MLP


def _projections(x: torch.Tensor, rt: Runtime, stream: str, *linears: Linear) -> tuple[list[torch.Tensor], dict]:
    """A GEMM operator's arguments for ``linears`` fed ``x``: ``[weight, bias, …]`` in order, each
    weight LoRA-merged (``lora_merge`` / ``lora_fuse``) when adapted, and the unfused adapter
    branches as the operator's ``delta``/``deltas`` keywords (``{}`` without them)."""
    args = []
    for m in linears:
        args += [adapted_weight(m, rt, stream), m.bias]
    return args, lora_deltas(x, rt, stream, *linears)


class AttentionContext(NamedTuple):
    """What every block's attention shares within one forward."""

    key_mask: torch.Tensor | None
    """``[B, L+N]`` bool over the joint [text, image] keys (False = padded text), or None."""
    img_freqs: torch.Tensor
    """RoPE table of the image tokens ``[N, Dh/2]`` complex64."""
    txt_freqs: torch.Tensor
    """RoPE table of the (padded) text tokens ``[L, Dh/2]`` complex64."""


class JointAttention(nn.Module):
    """Both streams' projections and Q/K gains of diffusers' ``Attention`` (double-stream)."""

    def __init__(self, d: int, head_dim: int, *, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.heads = d // head_dim
        self.eps = eps
        # image stream
        self.to_q = Linear(d, d, dtype=dtype)
        self.to_k = Linear(d, d, dtype=dtype)
        self.to_v = Linear(d, d, dtype=dtype)
        self.norm_q = Gain(head_dim, dtype=dtype)
        self.norm_k = Gain(head_dim, dtype=dtype)
        self.to_out = nn.ModuleDict({"0": Linear(d, d, dtype=dtype)})
        # text stream
        self.add_q_proj = Linear(d, d, dtype=dtype)
        self.add_k_proj = Linear(d, d, dtype=dtype)
        self.add_v_proj = Linear(d, d, dtype=dtype)
        self.norm_added_q = Gain(head_dim, dtype=dtype)
        self.norm_added_k = Gain(head_dim, dtype=dtype)
        self.to_add_out = Linear(d, d, dtype=dtype)

    def forward(self, ih: torch.Tensor, th: torch.Tensor, ctx: AttentionContext,
                rt: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_img ``[B, N, d]``, A_txt ``[B, L, d]``) from the modulated streams ih ``[B, N, d]``,
        th ``[B, L, d]``: per-stream q, k, v; RMSNorm of q and k over the head dim with learned
        gains; RoPE on q and k; one attention over the joint sequence [text, image] (padded text
        keys excluded); per-stream output projections."""
        eps = self.eps
        qi, ki, vi = self._qkv(ih, "img", rt, self.to_q, self.to_k, self.to_v)  # 3 × [B, N, H, Dh]
        qt, kt, vt = self._qkv(th, "txt", rt, self.add_q_proj, self.add_k_proj, self.add_v_proj)  # 3 × [B, L, H, Dh]
        # x / sqrt(mean(x²) + eps) · gain, over Dh
        qi = call(rt, "qk_rmsnorm", qi, self.norm_q.weight, eps=eps, stream="img", layout="BS..")
        ki = call(rt, "qk_rmsnorm", ki, self.norm_k.weight, eps=eps, stream="img", layout="BS..")
        qt = call(rt, "qk_rmsnorm", qt, self.norm_added_q.weight, eps=eps, stream="txt", layout="BS..")
        kt = call(rt, "qk_rmsnorm", kt, self.norm_added_k.weight, eps=eps, stream="txt", layout="BS..")
        # each pair (x[2j], x[2j+1]) rotated by e^{iθ_j} of the token's position
        qi = call(rt, "multi_axis_rope", qi, ctx.img_freqs, stream="img", layout="BS..")
        ki = call(rt, "multi_axis_rope", ki, ctx.img_freqs, stream="img", layout="BS..")
        qt = call(rt, "multi_axis_rope", qt, ctx.txt_freqs, stream="txt", layout="BS..")
        kt = call(rt, "multi_axis_rope", kt, ctx.txt_freqs, stream="txt", layout="BS..")
        # softmax(q·kᵀ/√Dh over the valid keys)·v over [text, image]
        L = th.shape[1]
        q = torch.cat([qt, qi], dim=1)  # [B, L+N, H, Dh]
        k = torch.cat([kt, ki], dim=1)  # [B, L+N, H, Dh]
        v = torch.cat([vt, vi], dim=1)  # [B, L+N, H, Dh]
        o = call(rt, "joint_attention_fused", q, k, v, ctx.key_mask, text_len=L, stream="joint", layout="BS..")
        o = o.flatten(2, 3)  # [B, L+N, d]
        ai = self._out(o[:, L:].contiguous(), "img", rt, self.to_out["0"])  # [B, N, d]
        at = self._out(o[:, :L].contiguous(), "txt", rt, self.to_add_out)  # [B, L, d]
        return ai, at

    def _qkv(self, x: torch.Tensor, stream: str, rt: Runtime, *qkv: Linear) -> tuple[torch.Tensor, ...]:
        """``x·Wᵀ + b`` for q, k, v, split into heads: x ``[B, S, d]`` → 3 × ``[B, S, H, Dh]``."""
        w, lora = _projections(x, rt, stream, *qkv)
        return call(rt, "qkv_bias_gemm", x, *w, self.heads, stream=stream, layout=("BS..",) * 3, **lora)

    def _out(self, x: torch.Tensor, stream: str, rt: Runtime, out: Linear) -> torch.Tensor:
        """``x·Wᵀ + b`` (``to_out.0`` / ``to_add_out``): ``[B, S, d]`` → ``[B, S, d]``."""
        w, lora = _projections(x, rt, stream, out)
        return call(rt, "attn_out_bias_gemm", x, *w, stream=stream, layout="BS.", **lora)


class GeluProj(nn.Module):
    """``net.0`` of diffusers' ``FeedForward``: the GELU module holding ``proj``."""

    def __init__(self, d: int, hidden: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.proj = Linear(d, hidden, dtype=dtype)


class FeedForward(nn.Module):
    """``net.0.proj [4d, d]`` and ``net.2 [d, 4d]`` (``net.1`` is a parameter-free dropout)."""

    def __init__(self, d: int, hidden: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.net = nn.ModuleDict({"0": GeluProj(d, hidden, dtype=dtype), "2": Linear(hidden, d, dtype=dtype)})

    def forward(self, x: torch.Tensor, stream: str, rt: Runtime) -> torch.Tensor:
        """``GELU_tanh(x·W₀ᵀ + b₀)·W₂ᵀ + b₂``: x ``[B, S, d]`` → ``[B, S, d]`` (either stream)."""
        up, down = self.net["0"].proj, self.net["2"]
        w, lora = _projections(x, rt, stream, up)
        h = call(rt, "mlp_up_gemm_gelu", x, *w, stream=stream, layout="BS.", **lora)  # [B, S, 4d]
        w, lora = _projections(h, rt, stream, down)
        return call(rt, "mlp_down_gemm", h, *w, stream=stream, layout="BS.", **lora)  # [B, S, d]


# ---------------------------------------------------------------------------------------------
# block


class Block(nn.Module):
    """``transformer_blocks.{i}``: per-stream modulation (``img_mod.1``/``txt_mod.1``, d→6d),
    joint attention, per-stream MLP (32 tensors)."""

    def __init__(self, cfg: MMDiTConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = cfg.inner_dim
        self.eps = cfg.eps
        self.img_mod = nn.ModuleDict({"1": Linear(d, 6 * d, dtype=dtype)})  # "0" is SiLU
        self.attn = JointAttention(d, cfg.attention_head_dim, eps=cfg.eps, dtype=dtype)
        self.img_mlp = FeedForward(d, cfg.mlp_dim, dtype=dtype)
        self.txt_mod = nn.ModuleDict({"1": Linear(d, 6 * d, dtype=dtype)})
        self.txt_mlp = FeedForward(d, cfg.mlp_dim, dtype=dtype)

    def forward(self, i: torch.Tensor, t: torch.Tensor, temb: torch.Tensor, ctx: AttentionContext,
                rt: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
        """One double-stream block (numerics §2.3): image i ``[B, N, d]``, text t ``[B, L, d]``,
        temb ``[B, d]`` → (i, t), same shapes. With ``mod_k(X) = LN(X)·(1 + scale_k) + shift_k``:

            I ← I + gate1·A_img,    T ← T + gate1·A_txt    (A = JointAttention(mod_1(I), mod_1(T)))
            I ← I + gate2·MLP_img(mod_2(I)),    T ← T + gate2·MLP_txt(mod_2(T))
        """
        img = _modulation(self.img_mod, temb, "img", rt)
        txt = _modulation(self.txt_mod, temb, "txt", rt)
        ai, at = self._attention_half(i, t, img, txt, ctx, rt)  # [B, N, d], [B, L, d]
        i = _gated_residual(i, img.gate1, ai, "img", rt)
        t = _gated_residual(t, txt.gate1, at, "txt", rt)
        i = _gated_residual(i, img.gate2, self._mlp_half(self.img_mlp, i, img, "img", rt), "img", rt)
        t = _gated_residual(t, txt.gate2, self._mlp_half(self.txt_mlp, t, txt, "txt", rt), "txt", rt)
        return i, t

    def _attention_half(self, i: torch.Tensor, t: torch.Tensor, img: Modulation, txt: Modulation,
                        ctx: AttentionContext, rt: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_img, A_txt) = JointAttention(mod_1(I), mod_1(T)): both streams at once."""
        ih = _modulate(i, img.shift1, img.scale1, self.eps, "img", rt)  # [B, N, d]
        th = _modulate(t, txt.shift1, txt.scale1, self.eps, "txt", rt)  # [B, L, d]
        return self.attn(ih, th, ctx, rt)

    def _mlp_half(self, mlp: FeedForward, x: torch.Tensor, mod: Modulation, stream: str,
                  rt: Runtime) -> torch.Tensor:
        """MLP(mod_2(X)) of one stream: x ``[B, S, d]`` → ``[B, S, d]``."""
        return mlp(_modulate(x, mod.shift2, mod.scale2, self.eps, stream, rt), stream, rt)


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

        Returns:
            v ``[B, N, out_dim]`` in W.

        Raises:
            UnsupportedConfigError: shapes or dtypes that do not match the model, or a backend
                the runtime mode cannot honour.
        """
        cfg = self.config
        h, w = (int(v) for v in img_grid)
        self._check_inputs(x, txt, txt_mask, tau, h, w)
        B, N = x.shape[:2]
        L = txt.shape[1]
        if txt_mask is not None and txt_mask.dtype != torch.bool:
            txt_mask = txt_mask.to(torch.bool)
        key_mask = None
        if txt_mask is not None:
            key_mask = torch.cat([txt_mask, torch.ones(B, N, dtype=torch.bool, device=x.device)], dim=1)  # [B, L+N]
        img_freqs, txt_freqs = rope_tables(
            (h, w), L, axes_dims=cfg.axes_dims_rope, theta=cfg.rope_theta,
            algorithm=BACKEND_TABLES[rt.mode.family], device=x.device,
        )  # [N, Dh/2], [L, Dh/2] complex64: portable (strict) or diffusers' polar (production)
        ctx = AttentionContext(key_mask, img_freqs, txt_freqs)

        with rt.scope(block=-1):
            # temb = linear_2(SiLU(linear_1(sinusoid(τ)))); T = RMSNorm(txt)·Wᵀ + b; I = x·Wᵀ + b
            te = self.time_text_embed.timestep_embedder
            temb = call(rt, "timestep_embed_mlp", tau, te.linear_1.weight, te.linear_1.bias,
                        te.linear_2.weight, te.linear_2.bias, stream="none", layout="B.")  # [B, d]
            t = call(rt, "txt_in_rmsnorm_linear", txt, self.txt_norm.weight, self.txt_in.weight,
                     self.txt_in.bias, eps=cfg.eps, stream="txt", layout="BS.")  # [B, L, d]
            i = call(rt, "latent_proj_gemm", x, self.img_in.weight, self.img_in.bias,
                     stream="img", layout="BS.")  # [B, N, d]

        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        for index, block in enumerate(self.transformer_blocks):
            with rt.scope(block=index):
                if checkpointing:
                    i, t = _checkpointed(block, i, t, temb, ctx, rt)
                else:
                    i, t = block(i, t, temb, ctx, rt)

        with rt.scope(block=cfg.num_layers):
            # (scale, shift) = SiLU(temb)·Wᵀ + b, scale first; LN(I)·(1 + scale) + shift; then ·Wᵀ + b
            y = call(rt, "final_adaln_out", i, temb, self.norm_out.linear.weight, self.norm_out.linear.bias,
                     eps=cfg.eps, stream="img", layout="BS.")  # [B, N, d]
            v = call(rt, "latent_proj_gemm", y, self.proj_out.weight, self.proj_out.bias,
                     stream="img", layout="BS.")  # [B, N, out_dim]
        return v

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

    return checkpoint(run, i, t, temb, use_reentrant=False)


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
