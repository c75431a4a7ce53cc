"""Operator variants: real-world mistakes, each with the signature of the operator it replaces.

    >>> from drifttool.runner import RunSpec, execute
    >>> v = RopeRotateHalf()
    >>> execute(RunSpec(variants={v.op: (v.name, v)}), "runs/rope_rotate_half")
    # trace: multi_axis_rope actual="variant:rope_rotate_half"

A variant is handed to ``RunSpec.variants`` (``Runtime.variants``) and replaces the operator's
implementation for one run. Each class here wraps the implementation the runtime would have
dispatched (``self.base``: resolved per call by the registry's own rule, so from the call's
tensors' device, ``dispatched``) and makes exactly one change, so the probe isolates one factor.
A variant whose own arithmetic is the CPU strict family's and has no device-correct form
(``Variant.cpu_only``) fails closed elsewhere with ``UnsupportedConfigError``; the catalog
declares its probe pending there (``Variant.refuses``). Variants that depend on where they are called (step, block, CFG branch,
batch rows) read ``rt.current_scope()``. The sampler's variants (sigma schedule, CFG, step
precision, noise) are ``drifttool.probes.sampler_variants``; those of the suspects users report
(LoRA merge dtype, RoPE table device, text mask, attention kernel) are
``drifttool.probes.suspect_variants``.

=========================  =====================  ====================================================
variant                    operator               the mistake (source)
=========================  =====================  ====================================================
latent_pack_channels_last  latent_proj_gemm       2×2 patches packed (dy, dx, c) instead of (c, dy, dx)
                                                  (numerics §3.2: channel = c·4 + dy·2 + dx)
timestep_scale_first       timestep_embed_mlp     sinusoid angle (1000·τ)·f instead of (τ·f)·1000 (§5.7)
rope_rotate_half           multi_axis_rope        rotate-half pairs (x_j, x_{j+D/2}) instead of
                                                  interleaved (x_2j, x_2j+1) (§2.2, §5.8)
rope_text_offset_zero      multi_axis_rope        text positions start at 0, not max(⌊h/2⌋, ⌊w/2⌋) (§2.2)
qk_norm_no_gain            qk_rmsnorm             parameter-free Q/K RMSNorm (learned gain dropped)
final_shift_scale_swapped  final_adaln_out        final AdaLN chunks read (shift, scale); the model
                                                  stores (scale, shift) (§5.5)
gelu_exact                 mlp_up_gemm_gelu       erf GELU instead of the tanh approximation (§2.3)
attn_mask_dropped          joint_attn_softmax     padded prompt tokens attended (0.35/0.36 ignored
                           joint_attention_fused  the mask, §5.1)
sequence_image_first       joint_attn_softmax,    joint sequence [image, text] instead of [text, image]
                           joint_attn_av_gemm,    (§2.4); mathematically the same attention, other
                           joint_attention_fused  reduction order
plant_ulp                  any                    sensitivity control: lowest mantissa bit of one
                                                  element flipped at one call site
=========================  =====================  ====================================================
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.model.rope import rope_table, text_positions
from drifttool.ops.registry import call_device, resolve
from drifttool.ops.strict_math import exp32, sincos64
from drifttool.runtime import Runtime


def dispatched(rt: Runtime, op: str) -> Callable[..., Any]:
    """``op`` as dispatch runs it under ``rt``, resolved per call (``registry.resolve``: the call's
    tensors' device, the family, the constraints, the fallback), without trace or capture. Raises
    (when called) ``UnsupportedConfigError`` as ``registry.resolve``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return resolve(rt, op, args, kwargs).impl.fn(*args, **kwargs)

    return run


class Variant:
    """Base class: an operator replacement that knows its runtime.

    Attributes:
        op: the operator replaced. name: the variant name (trace ``variant:<name>``).
        rt: the runtime (after ``bind_runtime``). base: the implementation the runtime would
            have dispatched for each call of ``op`` (``dispatched``: per call, from its device).
        cpu_only: why the variant's own arithmetic runs on the CPU only (empty: it runs wherever
            its base does); see ``refuses``.
    """

    op = ""
    name = ""
    cpu_only = ""

    def __init__(self) -> None:
        self.rt: Runtime | None = None
        self.base: Any = None

    def bind_runtime(self, rt: Runtime) -> None:
        self.rt = rt
        self.base = dispatched(rt, self.op)

    def impl(self, op: str) -> Callable[..., Any]:
        """Another operator as dispatch would run it for each call (``dispatched``)."""
        return dispatched(self.rt, op)

    def refuses(self, device: str) -> str:
        """Why the variant cannot run on device type ``device`` (empty: it can)."""
        if self.cpu_only and device != "cpu":
            return f"variant {self.name} runs on the CPU only: {self.cpu_only}"
        return ""

    def check_device(self, *args: Any) -> None:
        """Raise ``UnsupportedConfigError`` (``refuses``' reason) when the call's tensors
        ``args`` are on a device type the variant refuses."""
        why = self.refuses(call_device(self.op, args, {}))
        if why:
            raise UnsupportedConfigError(why)

    def scope(self) -> dict[str, Any]:
        return self.rt.current_scope()

    def entry(self) -> tuple[str, "Variant"]:
        """``(name, self)``, the value ``RunSpec.variants[op]`` expects."""
        return self.name, self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# latent layout


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """[..., 4C] in (c, dy, dx) order → (dy, dx, c) order."""
    return x.unflatten(-1, (-1, 4)).transpose(-1, -2).flatten(-2)


def _channels_first(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_channels_last``: [..., 4C] (dy, dx, c) → (c, dy, dx)."""
    return x.unflatten(-1, (4, -1)).transpose(-1, -2).flatten(-2)


class LatentPackChannelsLast(Variant):
    """The pipeline packs 2×2 latent patches as (dy, dx, c) and unpacks model outputs the same
    way: ``img_in`` sees the channels permuted, ``proj_out``'s output is read back permuted
    (block −1 vs the final block tells them apart)."""

    op = "latent_proj_gemm"
    name = "latent_pack_channels_last"

    def __call__(self, x, w, b):
        if self.scope()["block"] < 0:  # img_in: x [B, N, 4C]
            return self.base(_channels_last(x).contiguous(), w, b)
        return _channels_first(self.base(x, w, b)).contiguous()  # proj_out: [B, N, 4C]


# ---------------------------------------------------------------------------------------------
# timestep encoding


class TimestepScaleFirst(Variant):
    """Sinusoid angles a_k = (1000·τ)·f_k instead of diffusers' (τ·f_k)·1000 (numerics §5.7);
    everything else as strict (same sin/cos, same MLP: the two GEMMs of the strict backend)."""

    op = "timestep_embed_mlp"
    name = "timestep_scale_first"
    cpu_only = ("its two GEMMs are the CPU strict timestep_embed_mlp's (mlp_down_gemm, "
                "adaln_mod_projection); the strict CUDA timestep_embed_mlp runs GEMVs of another "
                "reduction order that no operator exposes, so on CUDA it would change more than the "
                "sinusoid's angle order")

    def __call__(self, tau, w1, b1, w2, b2):
        self.check_device(tau, w1, b1, w2, b2)
        half = w1.shape[1] // 2
        expo = (-math.log(10000.0) * torch.arange(half, dtype=torch.float32)) / half
        freqs = exp32(expo)  # [half]
        a = (tau.to(torch.float32)[:, None] * 1000.0) * freqs[None, :]  # [B, half] the mistake
        sin, cos = sincos64(a)
        phi = torch.cat([cos, sin], dim=-1).to(torch.float32)  # [B, 256]
        h = self.impl("mlp_down_gemm")(phi[:, None, :], w1, b1)[:, 0]  # [B, d] fp32 (x·w1ᵀ + b1)
        temb = self.impl("adaln_mod_projection")(h, w2, b2)  # SiLU(h)·w2ᵀ + b2, fp32
        return temb.to(w1.dtype)


# ---------------------------------------------------------------------------------------------
# RoPE


def _half_to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """[..., D] (x_0..x_{D/2−1} | x_{D/2}..) → interleaved pairs (x_j, x_{j+D/2})."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def _interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class RopeRotateHalf(Variant):
    """Rotate-half (GPT-NeoX) pairing: x_j rotates with x_{j+D/2}; Qwen-Image pairs adjacent
    values x_2j, x_2j+1 (numerics §2.2). Same rotation arithmetic on re-paired values."""

    op = "multi_axis_rope"
    name = "rope_rotate_half"

    def __call__(self, x, freqs):
        y = self.base(_half_to_interleaved(x).contiguous(), freqs)
        return _interleaved_to_half(y).contiguous()


class RopeTextOffsetZero(Variant):
    """Text tokens at positions 0..L−1 instead of max(⌊h/2⌋, ⌊w/2⌋) + k (numerics §2.2): the
    text table is recomputed without the offset; image calls are unchanged.

    A call is a text call when its table equals the text table of this grid and length. The axis
    split is read off the table itself: in a text row every axis starts with frequency 1, so the
    columns equal to column 0 of the last row (position p > 0) are the axis starts.
    """

    op = "multi_axis_rope"
    name = "rope_text_offset_zero"

    def __init__(self, theta: float = 10000) -> None:
        super().__init__()
        self.theta = theta

    def __call__(self, x, freqs):
        h, w = self.scope()["img_grid"]
        L, half = freqs.shape
        last = freqs[-1]
        starts = [j for j in range(half) if bool(last[j] == last[0])] + [half]
        axes = tuple(2 * (b - a) for a, b in zip(starts, starts[1:]))
        if len(axes) == 3:
            right = rope_table(text_positions(h, w, L), axes, self.theta).to(freqs.device)
            if torch.equal(freqs, right):
                pos = torch.arange(L, dtype=torch.int64)[:, None].expand(L, 3).clone()  # [L, 3]
                freqs = rope_table(pos, axes, self.theta).to(freqs.device)
        return self.base(x, freqs)


# ---------------------------------------------------------------------------------------------
# Q/K preprocessing, modulation, GELU


class QKNormNoGain(Variant):
    """Parameter-free Q/K RMSNorm: the learned gains ``norm_q``/``norm_k``/``norm_added_*`` are
    dropped (multiplied by ones, which is exact)."""

    op = "qk_rmsnorm"
    name = "qk_norm_no_gain"

    def __call__(self, x, gain, eps: float = 1e-6):
        return self.base(x, torch.ones_like(gain), eps=eps)


class FinalShiftScaleSwapped(Variant):
    """The final AdaLN reads its projection as (shift, scale) — the blocks' order — while
    ``norm_out`` stores (scale, shift) (numerics §5.5): the weight halves are swapped."""

    op = "final_adaln_out"
    name = "final_shift_scale_swapped"

    def __call__(self, x, temb, w, b, eps: float = 1e-6):
        d = w.shape[0] // 2
        ws = torch.cat([w[d:], w[:d]])  # [2d, d]
        bs = torch.cat([b[d:], b[:d]])  # [2d]
        return self.base(x, temb, ws, bs, eps=eps)


class GeluExact(Variant):
    """erf GELU instead of the tanh approximation (``gelu-approximate`` in diffusers'
    FeedForward, numerics §2.3); the GEMM is the strict one, the activation FP64 rounded once."""

    op = "mlp_up_gemm_gelu"
    name = "gelu_exact"
    cpu_only = ("its FP32 pre-activation comes from mlp_down_gemm on FP32 inputs; the strict CUDA "
                "GEMM runs FP32 inputs on its IEEE FP32 path, not the bf16 tensor-core path of "
                "mlp_up_gemm_gelu, so on CUDA it would change the GEMM as well as the GELU")

    def __call__(self, x, w, b):
        self.check_device(x, w, b)
        pre = self.impl("mlp_down_gemm")(x.to(torch.float32), w, b).double()  # [B, S, 4d]
        y = 0.5 * pre * (1.0 + torch.special.erf(pre / math.sqrt(2.0)))
        return y.to(torch.float32).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# prompt mask and sequence order (joint attention)


class AttnMaskDropped(Variant):
    """Padded prompt tokens are attended: the key mask is dropped (diffusers 0.35/0.36 ignored
    ``encoder_hidden_states_mask``, numerics §5.1). Register for ``joint_attn_softmax`` (strict)
    and ``joint_attention_fused`` (production)."""

    name = "attn_mask_dropped"

    def __init__(self, op: str = "joint_attn_softmax") -> None:
        super().__init__()
        self.op = op

    def __call__(self, *args, **kwargs):
        if self.op == "joint_attention_fused":  # (q, k, v, key_mask)
            return self.base(*args[:3], None)
        return self.base(args[0], None)  # (scores, key_mask)


class SequenceImageFirst(Variant):
    """Joint attention over [image, text] instead of [text, image] (numerics §2.4), every input
    and the key mask permuted consistently and the output put back in the model's order: the
    same attention mathematically, another reduction order over the keys. Register the same
    class for ``joint_attn_softmax`` and ``joint_attn_av_gemm`` (strict) and
    ``joint_attention_fused`` (production)."""

    name = "sequence_image_first"

    def __init__(self, op: str = "joint_attn_softmax") -> None:
        super().__init__()
        self.op = op

    def _perm(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = self.scope()["img_grid"]
        lp = s - h * w  # padded text rows come first in the model's order
        perm = torch.cat([torch.arange(lp, s), torch.arange(lp)]).to(device)  # image first
        return perm, torch.argsort(perm)

    def __call__(self, *args, **kwargs):
        if self.op == "joint_attn_softmax":
            scores, mask = args[0], (args[1] if len(args) > 1 else kwargs.get("key_mask"))
            p, inv = self._perm(scores.shape[-1], scores.device)
            out = self.base(scores[:, :, p][:, :, :, p], None if mask is None else mask[:, p])
            return out[:, :, inv][:, :, :, inv].contiguous()
        if self.op == "joint_attn_av_gemm":
            probs, v = args[0], args[1]
            mask = args[2] if len(args) > 2 else kwargs.get("key_mask")
            p, inv = self._perm(v.shape[1], v.device)
            out = self.base(probs[:, :, p][:, :, :, p].contiguous(), v[:, p].contiguous(),
                            None if mask is None else mask[:, p])
            return out[:, inv].contiguous()
        q, k, v = args[:3]  # joint_attention_fused
        mask = args[3] if len(args) > 3 else kwargs.get("key_mask")
        p, inv = self._perm(q.shape[1], q.device)
        out = self.base(q[:, p], k[:, p], v[:, p], None if mask is None else mask[:, p])
        return out[:, inv].contiguous()


# ---------------------------------------------------------------------------------------------
# sensitivity control


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_lowest_bit(t: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    """A copy of floating tensor ``t`` with the lowest mantissa bit of ``t[index]`` flipped:
    a change of exactly one ULP (or the smallest subnormal step)."""
    out = t.detach().clone().contiguous()
    bits = out.view(_INT_VIEW[out.element_size()])
    bits[index] = bits[index] ^ 1
    return out


class PlantUlp(Variant):
    """Sensitivity control: call the real operator, then flip the lowest mantissa bit of one
    element of one output at one call site.

    Args:
        op: operator to plant in.
        step, block: where (scope fields).
        call: 0-based occurrence of ``op`` within that step and block, counting every stream
            (the image-stream call of a per-stream operator comes before the text-stream call).
        sample, branch: the logical sample and CFG branch whose batch row is changed.
        row: sequence row of that batch row (must be a kept row: an image token, or a text
            position below the prompt length); ``rest``: index into the remaining axes.
        output: index of the output for tuple-returning operators.
    """

    name = "plant_ulp"

    def __init__(self, op: str, *, step: int, block: int, call: int, sample: int, branch: str,
                 row: int, rest: tuple[int, ...], output: int = 0) -> None:
        super().__init__()
        self.op = op
        self.where = dict(step=step, block=block, call=call, sample=sample, branch=branch)
        self.row, self.rest, self.output = row, tuple(rest), output
        self._calls: dict[tuple, int] = {}
        self.planted = 0

    def __call__(self, *args, **kwargs):
        out = self.base(*args, **kwargs)
        sc = self.scope()
        branches = sc["branch"]
        key = (sc["phase"], sc["step"], str(branches), sc["block"])
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        w = self.where
        if (sc["step"], sc["block"], n) != (w["step"], w["block"], w["call"]):
            return out
        samples = sc["samples"] or []
        for b, sid in enumerate(samples):
            branch = branches if isinstance(branches, str) else branches[b]
            if sid == w["sample"] and branch == w["branch"]:
                outs = list(out) if isinstance(out, tuple) else [out]
                outs[self.output] = flip_lowest_bit(outs[self.output], (b, self.row, *self.rest))
                self.planted += 1
                return tuple(outs) if isinstance(out, tuple) else outs[0]
        return out
