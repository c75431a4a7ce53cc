"""``production`` backend of every WS1 model operator: diffusers 0.42.1's own arithmetic.

    >>> from drifttool.ops.registry import call
    >>> y = call(Runtime(mode="auto"), "mlp_down_gemm", h, w, b, stream="img", layout="BS.")

Each function reproduces the torch calls and cast points of diffusers' Qwen-Image transformer
(numerics spec §2, §2.5, §2.6) so that an MMDiT built from these operators equals diffusers'
output byte for byte in bf16 on the CPU (and to ~1e-6 in fp32):

- every Linear is ``F.linear`` in the model dtype W with the bias fused;
- SiLU, LayerNorm (no affine), tanh-GELU, modulation and gated residuals run in W;
- the timestep is rounded to W inside the model, the sinusoid is fp32, then cast to W (§2.1);
- RMSNorm: fp32 variance, ``x · rsqrt`` promotes to fp32, cast to the gain's dtype when the gain
  is bf16/fp16, then ``· gain`` (§2.5);
- RoPE: fp32 complex multiply by the complex64 table, cast back to W (§2.2);
- attention: ``F.scaled_dot_product_attention`` on ``[B, H, S, Dh]`` permuted views, with a bool
  key mask ``[B, 1, 1, S]`` only when one is given (§2.4, §5.11).

Every implementation here is device-generic torch and is registered for device types ``cpu``
and ``cuda`` (``DEVICES``); the trace records the device of each call next to the kernel.
Geometry checks of the key mask are declared constraints (``constraints.key_mask_fits``).

The three unfused attention operators get plain-torch versions here (fp32 scores and
probabilities); they are *not* byte-equal to ``joint_attention_fused`` (SDPA) — only the strict
backend promises that.
The scheduler operators (``cfg_combine_renorm``, ``flow_sigma_table``, ``flow_sde_step_logp``)
live in ``drifttool/ops/scheduler.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import Constraint, key_mask_fits, text_len_fits
from drifttool.ops.lora import add_branch, add_delta
from drifttool.ops.registry import implements

_HALF = (torch.float16, torch.bfloat16)

DEVICES = ("cpu", "cuda")
"""Every production implementation is device-generic torch: registered for both device types."""


def _production(op: str, *, kernel: str, constraints: tuple[Constraint, ...] = ()):
    return implements(op, "production", device=DEVICES, kernel=kernel, constraints=constraints)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise UnsupportedConfigError(msg)


# ---------------------------------------------------------------------------------------------
# latent layout (pipeline side, numerics §3.2, §3.5)


@_production("latent_pack_unpack", kernel="torch.view_permute_reshape")
def latent_pack_unpack(z: torch.Tensor, direction: str = "pack", grid: tuple[int, int] | None = None) -> torch.Tensor:
    """2×2 patchify / unpatchify (diffusers ``_pack_latents`` / ``_unpack_latents``).

    ``pack``: z ``[B, C, H', W']`` or ``[B, C, 1, H', W']`` → ``[B, N, 4C]``, N = (H'/2)(W'/2),
    token n = i·(W'/2) + j, channel c·4 + dy·2 + dx.
    ``unpack``: x ``[B, N, 4C]`` with ``grid=(h, w)`` → ``[B, C, 1, 2h, 2w]``.

    Raises:
        UnsupportedConfigError: unknown direction, odd H'/W', or N != h·w.
    """
    if direction == "pack":
        if z.dim() == 5:
            _check(z.shape[2] == 1, f"latent_pack_unpack: frame axis must be 1, got {tuple(z.shape)}")
            z = z[:, :, 0]  # [B, C, H', W']
        _check(z.dim() == 4, f"latent_pack_unpack: expected [B,C,H',W'], got {tuple(z.shape)}")
        b, c, hh, ww = z.shape
        _check(hh % 2 == 0 and ww % 2 == 0, f"latent_pack_unpack: H', W' must be even, got {hh}x{ww}")
        x = z.view(b, c, hh // 2, 2, ww // 2, 2)  # [B, C, h, 2, w, 2]
        x = x.permute(0, 2, 4, 1, 3, 5)  # [B, h, w, C, 2, 2]
        return x.reshape(b, (hh // 2) * (ww // 2), c * 4)  # [B, N, 4C]
    if direction == "unpack":
        _check(grid is not None, "latent_pack_unpack: unpack needs grid=(h, w)")
        h, w = grid
        b, n, c4 = z.shape
        _check(n == h * w and c4 % 4 == 0, f"latent_pack_unpack: {tuple(z.shape)} does not fit grid {grid}")
        x = z.view(b, h, w, c4 // 4, 2, 2)  # [B, h, w, C, 2, 2]
        x = x.permute(0, 3, 1, 4, 2, 5)  # [B, C, h, 2, w, 2]
        return x.reshape(b, c4 // 4, 1, 2 * h, 2 * w)  # [B, C, 1, H', W']
    raise UnsupportedConfigError(f"latent_pack_unpack: unknown direction {direction!r}")


@_production("latent_normalize", kernel="torch.elementwise")
def latent_normalize(z: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Per-channel latent normalisation, as the diffusers Qwen-Image pipelines write it.

    ``mean``/``std`` ``[C]`` are cast to z's dtype first; ``std_inv = 1 / std`` is then taken in
    z's dtype. Forward: ``(z − mean) · std_inv``; inverse: ``z / std_inv + mean`` (numerics §3.5).
    z is ``[B, C, ...]``; the result has z's shape and dtype.
    """
    c = z.shape[1]
    _check(mean.shape == (c,) and std.shape == (c,), f"latent_normalize: mean/std must be [{c}]")
    view = (1, c) + (1,) * (z.dim() - 2)
    mean = mean.view(view).to(z.device, z.dtype)
    std_inv = 1.0 / std.view(view).to(z.device, z.dtype)
    if inverse:
        return z / std_inv + mean
    return (z - mean) * std_inv


# ---------------------------------------------------------------------------------------------
# inputs: image / text projections and timestep embedding


@_production("latent_proj_gemm", kernel="torch.nn.functional.linear")
def latent_proj_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                     delta: torch.Tensor | None = None) -> torch.Tensor:
    """``img_in`` (64→d) / ``proj_out`` (d→64): ``F.linear`` in W with fused bias (+ an unfused
    LoRA ``delta``, ``add_delta``). ``[B,S,K]→[B,S,N]``."""
    return add_delta(F.linear(x, w, b), delta)


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers ``RMSNorm`` (numerics §2.5): fp32 mean of squares; ``x · rsqrt`` (promotes to
    fp32); cast to the gain's dtype when that is bf16/fp16; then ``· gain``."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)  # fp32
    if gain.dtype in _HALF:
        y = y.to(gain.dtype)
    return y * gain


@_production("txt_in_rmsnorm_linear", kernel="torch.rmsnorm+torch.nn.functional.linear")
def txt_in_rmsnorm_linear(
    e: torch.Tensor, gain: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6,
    lora: tuple | None = None,
) -> torch.Tensor:
    """``txt_in(txt_norm(e))``: RMSNorm over Dj (§2.5) then ``F.linear`` (+ the unfused LoRA
    branch of ``txt_in`` on the normed input, ``lora`` = (A, B, scale), ``add_branch``).
    ``[B,L,Dj] → [B,L,d]``."""
    h = _rms_norm(e, gain, eps)
    return add_branch(F.linear(h, w, b), h, lora)


def _timestep_sinusoid(tau: torch.Tensor, channels: int = 256) -> torch.Tensor:
    """Cos-first sinusoid of diffusers ``Timesteps(256, flip_sin_to_cos=True,
    downscale_freq_shift=0, scale=1000)`` (§2.1): ``a_k = 1000 · (fp32(τ) · f_k)``. fp32 ``[B, 256]``."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=tau.device)
    freqs = torch.exp(exponent / half)  # [128]
    angles = tau[:, None].float() * freqs[None, :]  # [B, 128]
    angles = 1000 * angles
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)  # [B, 256]


@_production("timestep_embed_mlp", kernel="torch.sinusoid_fp32+torch.nn.functional.linear")
def timestep_embed_mlp(
    tau: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
    lora: tuple | None = None,
) -> torch.Tensor:
    """``temb = linear_2(SiLU(linear_1(W(φ(W(τ))))))`` (numerics §2 step 2 and 5, §2.1).

    τ ``[B]`` (≈ σ) is first rounded to the model dtype W = ``w1.dtype`` (diffusers'
    ``timestep.to(hidden_states.dtype)``), the sinusoid is fp32, cast to W, then the MLP runs in
    W. ``lora`` = (branch of ``linear_1``, branch of ``linear_2``), each None or (A, B, scale):
    the unfused LoRA branches on each Linear's input (``add_branch``). Returns ``[B, d]`` in W.
    """
    _check(tau.dim() == 1, f"timestep_embed_mlp: tau must be [B], got {tuple(tau.shape)}")
    lora1, lora2 = lora or (None, None)
    dtype = w1.dtype
    phi = _timestep_sinusoid(tau.to(dtype), w1.shape[1]).to(dtype)  # [B, 256]
    h = F.silu(add_branch(F.linear(phi, w1, b1), phi, lora1))  # [B, d]
    return add_branch(F.linear(h, w2, b2), h, lora2)  # [B, d]


# ---------------------------------------------------------------------------------------------
# block: modulation, attention, MLP


@_production("adaln_mod_projection", kernel="torch.silu+torch.nn.functional.linear")
def adaln_mod_projection(temb: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                         lora: tuple | None = None) -> torch.Tensor:
    """``img_mod`` / ``txt_mod``: ``F.linear(SiLU(temb))`` in W (+ the unfused LoRA branch on
    SiLU(temb), ``lora`` = (A, B, scale), ``add_branch``). ``[B,d] → [B,6d]``, chunks
    (shift1, scale1, gate1, shift2, scale2, gate2) (§2.3)."""
    h = F.silu(temb)
    return add_branch(F.linear(h, w, b), h, lora)


@_production("adaln_modulation", kernel="torch.layer_norm+elementwise")
def adaln_modulation(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """``LN(x) · (1 + scale) + shift`` in W; LN without affine, biased variance (§2.3).
    x ``[B,S,d]``, shift/scale ``[B,d]`` (broadcast over tokens) → ``[B,S,d]``."""
    normed = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


@_production("adaln_gate_residual", kernel="torch.elementwise")
def adaln_gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate · y`` in W (separate rounded multiply and add). x, y ``[B,S,d]``, gate ``[B,d]``."""
    return x + gate.unsqueeze(1) * y


@_production("qkv_bias_gemm", kernel="torch.nn.functional.linear")
def qkv_bias_gemm(
    x: torch.Tensor,
    wq: torch.Tensor,
    bq: torch.Tensor,
    wk: torch.Tensor,
    bk: torch.Tensor,
    wv: torch.Tensor,
    bv: torch.Tensor,
    heads: int,
    deltas: tuple[torch.Tensor | None, ...] | None = None,
    lora: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three ``F.linear`` projections, each unflattened to heads: ``[B,S,d] → 3 × [B,S,H,Dh]``.
    ``deltas``: unfused LoRA branches (``lora_delta``, ``[B,S,d]`` or None each) added as peft
    adds them (``ops.lora.add_delta``) before the unflatten. ``lora``: the strict family's form of
    the same adapter (per projection (A, B, scale) or None; an audit run's fallback), run as
    peft runs it (``add_branch``)."""
    _check(wq.shape[0] % heads == 0, f"qkv_bias_gemm: {wq.shape[0]} outputs do not split into {heads} heads")
    dh = wq.shape[0] // heads
    dq, dk, dv = deltas or (None, None, None)
    lq, lk, lv = lora or (None, None, None)
    q = add_branch(add_delta(F.linear(x, wq, bq), dq), x, lq).unflatten(-1, (heads, dh))  # [B, S, H, Dh]
    k = add_branch(add_delta(F.linear(x, wk, bk), dk), x, lk).unflatten(-1, (heads, dh))
    v = add_branch(add_delta(F.linear(x, wv, bv), dv), x, lv).unflatten(-1, (heads, dh))
    return q, k, v


@_production("qk_rmsnorm", kernel="torch.rmsnorm")
def qk_rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm over Dh with learned gain, diffusers' cast order (§2.5). ``[B,S,H,Dh]``."""
    return _rms_norm(x, gain, eps)


@_production("multi_axis_rope", kernel="torch.complex64_mul")
def multi_axis_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE (§2.2): view ``fp32(x)`` as Dh/2 complex pairs (x[2j] real,
    x[2j+1] imaginary), multiply by ``freqs [S, Dh/2]`` complex64, flatten, cast back to x's dtype.
    ``[B,S,H,Dh] → [B,S,H,Dh]``."""
    _check(freqs.dtype == torch.complex64, f"multi_axis_rope: freqs must be complex64, got {freqs.dtype}")
    _check(
        freqs.shape == (x.shape[1], x.shape[-1] // 2),
        f"multi_axis_rope: freqs {tuple(freqs.shape)} do not fit x {tuple(x.shape)}",
    )
    xc = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))  # [B, S, H, Dh/2]
    out = torch.view_as_real(xc * freqs.unsqueeze(1)).flatten(3)  # [B, S, H, Dh] fp32
    return out.type_as(x)


@_production("joint_attn_qk_gemm", kernel="torch.matmul_fp32",
             constraints=(key_mask_fits("k"), text_len_fits("k")))
def joint_attn_qk_gemm(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None, *,
                       text_len: int | None = None) -> torch.Tensor:
    """Scores ``(q·kᵀ) / √Dh`` in fp32: q, k ``[B,S,H,Dh]`` → ``[B,H,S,S]`` fp32 (plain torch).

    ``key_mask`` and ``text_len`` are only validated, by the declared constraints (they order
    the strict arithmetic; the scores do not use them)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh = q.float().permute(0, 2, 1, 3)  # [B, H, S, Dh]
    kh = k.float().permute(0, 2, 3, 1)  # [B, H, Dh, S]
    return torch.matmul(qh, kh) * scale  # [B, H, S, S]


@_production("joint_attn_softmax", kernel="torch.softmax_fp32",
             constraints=(key_mask_fits("scores", seq_axis=-1), text_len_fits("scores", seq_axis=-1)))
def joint_attn_softmax(scores: torch.Tensor, key_mask: torch.Tensor | None = None, *,
                       text_len: int | None = None) -> torch.Tensor:
    """Softmax over keys in fp32; keys with ``key_mask == False`` get probability 0.
    ``[B,H,S,S] → [B,H,S,S]`` fp32."""
    s = scores.float()
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1)


@_production("joint_attn_av_gemm", kernel="torch.matmul_fp32",
             constraints=(key_mask_fits("v"), text_len_fits("v")))
def joint_attn_av_gemm(
    probs: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, *, text_len: int | None = None
) -> torch.Tensor:
    """``probs · v`` in fp32, cast to v's dtype: ``[B,H,S,S], [B,S,H,Dh] → [B,S,H,Dh]``.

    ``key_mask`` is only validated (declared constraint): masked keys already carry probability
    exactly 0.
    """
    out = torch.matmul(probs.float(), v.float().permute(0, 2, 1, 3))  # [B, H, S, Dh]
    return out.permute(0, 2, 1, 3).contiguous().to(v.dtype)  # [B, S, H, Dh]


@_production("joint_attention_fused", kernel="torch.nn.functional.scaled_dot_product_attention",
             constraints=(key_mask_fits("k"), text_len_fits("k")))
def joint_attention_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, *,
    text_len: int | None = None,
) -> torch.Tensor:
    """diffusers' native attention backend (§2.4): SDPA on ``[B,H,S,Dh]`` permuted views, scale
    1/√Dh, no dropout, non-causal, bool key mask ``[B,1,1,S]`` only when given.
    q, k, v ``[B,S,H,Dh]`` (joint sequence [text, image]) → ``[B,S,H,Dh]`` in W."""
    mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, S]
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, S, Dh]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3).contiguous()  # [B, S, H, Dh]


@_production("attn_out_bias_gemm", kernel="torch.nn.functional.linear")
def attn_out_bias_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                       delta: torch.Tensor | None = None, lora: tuple | None = None) -> torch.Tensor:
    """``to_out.0`` / ``to_add_out``: ``F.linear`` in W (+ an unfused LoRA ``delta``,
    ``add_delta``, or its factors ``lora``, ``add_branch``). ``[B,S,d] → [B,S,d]``."""
    return add_branch(add_delta(F.linear(x, w, b), delta), x, lora)


@_production("mlp_up_gemm_gelu", kernel="torch.nn.functional.linear+gelu_tanh")
def mlp_up_gemm_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                     delta: torch.Tensor | None = None, lora: tuple | None = None) -> torch.Tensor:
    """``net.0.proj`` (+ an unfused LoRA ``delta``, ``add_delta``, or its factors ``lora``,
    ``add_branch``, as peft's Linear returns it) then tanh-approximate GELU, both in W.
    ``[B,S,d] → [B,S,4d]``."""
    return F.gelu(add_branch(add_delta(F.linear(x, w, b), delta), x, lora), approximate="tanh")


@_production("mlp_down_gemm", kernel="torch.nn.functional.linear")
def mlp_down_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                  delta: torch.Tensor | None = None, lora: tuple | None = None) -> torch.Tensor:
    """``net.2``: ``F.linear`` in W (+ an unfused LoRA ``delta``, ``add_delta``, or its factors
    ``lora``, ``add_branch``). ``[B,S,4d] → [B,S,d]``."""
    return add_branch(add_delta(F.linear(x, w, b), delta), x, lora)


@_production("final_adaln_out", kernel="torch.silu+linear+layer_norm")
def final_adaln_out(
    x: torch.Tensor, temb: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6,
    lora: tuple | None = None,
) -> torch.Tensor:
    """diffusers ``AdaLayerNormContinuous`` (§2 step 8): ``(scale, shift) = split(F.linear(SiLU(temb)))``
    — order (scale, shift) — then ``LN(x) · (1 + scale) + shift`` in W; ``lora`` = (A, B, scale):
    the unfused LoRA branch of ``norm_out.linear`` on SiLU(temb) (``add_branch``).
    x ``[B,N,d]``, temb ``[B,d]`` → ``[B,N,d]``."""
    h = F.silu(temb).to(x.dtype)
    emb = add_branch(F.linear(h, w, b), h, lora)  # [B, 2d]
    scale, shift = torch.chunk(emb, 2, dim=1)  # [B, d] each
    normed = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return normed * (1 + scale)[:, None, :] + shift[:, None, :]
