"""One double-stream block of the Qwen-Image MMDiT (``transformer_blocks.{i}``) and its parts.

    >>> from drifttool.model.config import tiny
    >>> from drifttool.model.mmdit_block import Block
    >>> block = Block(tiny())                      # parameters uninitialised (MMDiT holds them)
    >>> i, t = block(i, t, temb, ctx, rt)          # [B, N, d], [B, L, d] → same shapes

In data-flow order: the parameter containers (``Linear``, ``Gain``) under the checkpoint's own
names, the per-stream modulation (numerics §2.3), joint attention (numerics §2.2, §2.4), the MLP,
then ``Block``, whose ``forward`` states the block's math (two gated residual lines per stream).
Every arithmetic step is an RFC operator called through ``drifttool.ops.registry.call``; the
call sites and their identities are listed in ``drifttool.model.mmdit``, which stacks the blocks
between the model's inputs and output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

import drifttool.ops  # noqa: F401  (every operator and built-in family, registered explicitly)
from drifttool.model.config import MMDiTConfig
from drifttool.model.lanes import SERIAL
from drifttool.model.lora_calls import adapted_weight, gemm_lora, lora_branches
from drifttool.ops.registry import call
from drifttool.runtime import Runtime


# ---------------------------------------------------------------------------------------------
# parameter containers


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
    lin = mod["1"]
    m = call(rt, "adaln_mod_projection", temb, adapted_weight(lin, rt, stream), lin.bias,
             stream=stream, layout="B.", **lora_branches(rt, lin))  # [B, 6d]
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
    weight LoRA-merged (``lora_merge`` / ``lora_fuse``) when adapted, and an unfused adapter as
    the operator's keywords (``gemm_lora``: production the ``lora_delta`` branches as
    ``delta``/``deltas``, strict the FP32 factors as ``lora``; ``{}`` without one)."""
    args = []
    for m in linears:
        args += [adapted_weight(m, rt, stream), m.bias]
    return args, gemm_lora(x, rt, stream, *linears)


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
        keys excluded); per-stream output projections. The text stream's operators run on
        ``rt.lanes``' text lane (``drifttool.model.lanes``), which the joint attention joins."""
        eps = self.eps
        lanes = rt.lanes or SERIAL
        qi, ki, vi = self._qkv(ih, "img", rt, self.to_q, self.to_k, self.to_v)  # 3 × [B, N, H, Dh]
        with lanes.txt():  # 3 × [B, L, H, Dh]
            qt, kt, vt = self._qkv(th, "txt", rt, self.add_q_proj, self.add_k_proj, self.add_v_proj)
        # x / sqrt(mean(x²) + eps) · gain, over Dh
        qi = call(rt, "qk_rmsnorm", qi, self.norm_q.weight, eps=eps, stream="img", layout="BS..")
        ki = call(rt, "qk_rmsnorm", ki, self.norm_k.weight, eps=eps, stream="img", layout="BS..")
        with lanes.txt():
            qt = call(rt, "qk_rmsnorm", qt, self.norm_added_q.weight, eps=eps, stream="txt", layout="BS..")
            kt = call(rt, "qk_rmsnorm", kt, self.norm_added_k.weight, eps=eps, stream="txt", layout="BS..")
        # each pair (x[2j], x[2j+1]) rotated by e^{iθ_j} of the token's position
        qi = call(rt, "multi_axis_rope", qi, ctx.img_freqs, stream="img", layout="BS..")
        ki = call(rt, "multi_axis_rope", ki, ctx.img_freqs, stream="img", layout="BS..")
        with lanes.txt():
            qt = call(rt, "multi_axis_rope", qt, ctx.txt_freqs, stream="txt", layout="BS..")
            kt = call(rt, "multi_axis_rope", kt, ctx.txt_freqs, stream="txt", layout="BS..")
        lanes.join(qt, kt, vt)
        # softmax(q·kᵀ/√Dh over the valid keys)·v over [text, image]
        L = th.shape[1]
        q = torch.cat([qt, qi], dim=1)  # [B, L+N, H, Dh]
        k = torch.cat([kt, ki], dim=1)  # [B, L+N, H, Dh]
        v = torch.cat([vt, vi], dim=1)  # [B, L+N, H, Dh]
        o = call(rt, "joint_attention_fused", q, k, v, ctx.key_mask, text_len=L, stream="joint", layout="BS..")
        o = o.flatten(2, 3)  # [B, L+N, d]
        lanes.fork(o)
        ai = self._out(o[:, L:].contiguous(), "img", rt, self.to_out["0"])  # [B, N, d]
        with lanes.txt():
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

        With ``rt.lanes`` the text stream's operators run on a second CUDA stream
        (``drifttool.model.lanes``: the block forks it at its start and ends it at its end).
        """
        lanes = rt.lanes or SERIAL
        lanes.fork()
        img = _modulation(self.img_mod, temb, "img", rt)
        with lanes.txt():
            txt = _modulation(self.txt_mod, temb, "txt", rt)
        ai, at = self._attention_half(i, t, img, txt, ctx, rt)  # [B, N, d], [B, L, d]
        i = _gated_residual(i, img.gate1, ai, "img", rt)
        with lanes.txt():
            t = _gated_residual(t, txt.gate1, at, "txt", rt)
        i = _gated_residual(i, img.gate2, self._mlp_half(self.img_mlp, i, img, "img", rt), "img", rt)
        with lanes.txt():
            t = _gated_residual(t, txt.gate2, self._mlp_half(self.txt_mlp, t, txt, "txt", rt), "txt", rt)
        lanes.end()
        return i, t

    def _attention_half(self, i: torch.Tensor, t: torch.Tensor, img: Modulation, txt: Modulation,
                        ctx: AttentionContext, rt: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_img, A_txt) = JointAttention(mod_1(I), mod_1(T)): both streams at once."""
        ih = _modulate(i, img.shift1, img.scale1, self.eps, "img", rt)  # [B, N, d]
        with (rt.lanes or SERIAL).txt():
            th = _modulate(t, txt.shift1, txt.scale1, self.eps, "txt", rt)  # [B, L, d]
        return self.attn(ih, th, ctx, rt)

    def _mlp_half(self, mlp: FeedForward, x: torch.Tensor, mod: Modulation, stream: str,
                  rt: Runtime) -> torch.Tensor:
        """MLP(mod_2(X)) of one stream: x ``[B, S, d]`` → ``[B, S, d]``."""
        return mlp(_modulate(x, mod.shift2, mod.scale2, self.eps, stream, rt), stream, rt)
