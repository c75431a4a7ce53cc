"""Independent FP64 reference math for the Qwen-Image MMDiT operators, written from the numerics spec.

    >>> import torch
    >>> from drifttool.references import ops as ref
    >>> y = ref.mlp_up_gemm_gelu(torch.randn(1, 7, 48), torch.randn(192, 48), torch.randn(192))
    >>> y.dtype, tuple(y.shape)
    (torch.float64, (1, 7, 192))

One plain function per transformer operator of ``drifttool/ops/specs.py``, with the same call
signature. Every floating input is upcast to float64 inside; every result is float64 (complex128
for RoPE tables). The math is the *ideal* math of the RFC's numerics specification (§2)
(exact LayerNorm/RMSNorm, exact GELU-tanh, unrounded GEMMs), evaluated on the CPU in binary64,
so a backend's error against it is its own rounding error. There are two deliberate exceptions,
where the contract pins FP32 arithmetic *before* a transcendental of a large argument and the
FP32 rounding of that argument is part of the contract, not an error to measure:

* ``timestep_embed_mlp`` (§2.1): the sinusoid phases a_k = fp32(fp32(τ·f_k)·1000), with
  f_k = fp32(exp(fp32(fp32(−ln 10⁴)·k)/128)). A phase up to 1000 rad carries up to 3e-5 rad of
  FP32 rounding; every conforming implementation has it. ``phases="fp64"`` gives the ideal phases.
* ``rope_tables`` (§2.2): angles fp32(p)·inv_a[i] in FP32 with inv_a[i] = fp32(1/fp32(10000^e)),
  e = fp32(2i)/D_a. ``angles="fp64"`` gives the ideal angles.
In both, cos/sin (and everything after) are FP64. The FP32 steps are single IEEE operations
(+, ×, ÷, each correctly rounded) or FP64 transcendentals rounded once.

The independence rule: this module imports torch, math and nothing else — never ``drifttool.ops``,
``drifttool.model`` or anything under ``drifttool`` (tests/ops/test_reference_accuracy.py checks
it). It is written from the spec, not from the code it judges; where a layout could be written as
the same view/permute, it is written as explicit index arithmetic instead (``latent_pack_unpack``).

Backward: ``vjp(fn, inputs, grad_out)`` differentiates any of these functions with
torch.autograd in FP64 — the reference for backward work.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

F64 = torch.float64


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    """Upcast a floating tensor to float64 (no-op, autograd-transparent, if it is already)."""
    if t is None:
        return None
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(F64) if t.is_floating_point() else t


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x·wᵀ + b in FP64; x [..., K], w [N, K], b [N] → [..., N]."""
    y = torch.matmul(_f64(x), _f64(w).transpose(0, 1))
    return y if b is None else y + _f64(b)


def _adapted_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lora: tuple | None) -> torch.Tensor:
    """x·wᵀ + b, plus with ``lora`` = (A [r, K], B [N, r], s) the unfused LoRA branch
    s·((x·Aᵀ)·Bᵀ), all in FP64 (peft's ``Linear.forward`` without dropout)."""
    y = _linear(x, w, b)
    if lora is None:
        return y
    a, bb, s = lora
    return y + float(s) * _linear(_linear(x, a, None), bb, None)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + e^{−x}) in FP64."""
    return x * torch.sigmoid(x)


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free LayerNorm over the last axis, biased variance (§2.3)."""
    mu = x.mean(dim=-1, keepdim=True)
    xc = x - mu
    var = (xc * xc).mean(dim=-1, keepdim=True)
    return xc / torch.sqrt(var + eps)


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · gain over the last axis (§2.5, without its cast points)."""
    ms = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(ms + eps) * gain


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """½x(1 + tanh(√(2/π)(x + 0.044715x³))) (§2.3)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


# ---------------------------------------------------------------------------------------------
# latent layout (§3.2, §3.5)


def _pack_index(c: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source (channel, row, column) of packed element [n, q] for an h×w token grid: token
    n = i·w + j, channel q = c·4 + dy·2 + dx ← latent (c, 2i + dy, 2j + dx). Each [h·w, 4C]."""
    n = torch.arange(h * w)[:, None]  # [N, 1]
    q = torch.arange(4 * c)[None, :]  # [1, 4C]
    i, j = n // w, n % w
    ch, dy, dx = q // 4, (q // 2) % 2, q % 2
    shape = (h * w, 4 * c)
    return ch.expand(shape), (2 * i + dy).expand(shape), (2 * j + dx).expand(shape)


def latent_pack_unpack(
    t: torch.Tensor, direction: str = "pack", grid: tuple[int, int] | None = None
) -> torch.Tensor:
    """2×2 patchify / unpatchify (§3.2), by explicit index arithmetic.

    ``pack``: z [B,C,H',W'] or [B,C,1,H',W'] → [B,(H'/2)(W'/2),4C]:
    out[b, i·(W'/2)+j, c·4+dy·2+dx] = z[b, c, 2i+dy, 2j+dx].
    ``unpack``: x [B,h·w,4C] with ``grid=(h, w)`` → [B,C,1,2h,2w], the inverse.

    Raises:
        ValueError: unknown direction, odd H'/W', frame axis ≠ 1, or N ≠ h·w.
    """
    t = _f64(t)
    if direction == "pack":
        if t.dim() == 5:
            if t.shape[2] != 1:
                raise ValueError(f"frame axis must be 1, got {tuple(t.shape)}")
            t = t[:, :, 0]
        b, c, hh, ww = t.shape
        if hh % 2 or ww % 2:
            raise ValueError(f"H', W' must be even, got {hh}x{ww}")
        ch, y, x = _pack_index(c, hh // 2, ww // 2)
        return t[:, ch, y, x]  # [B, N, 4C]
    if direction == "unpack":
        if grid is None:
            raise ValueError("unpack needs grid=(h, w)")
        h, w = grid
        b, n, c4 = t.shape
        if n != h * w or c4 % 4:
            raise ValueError(f"{tuple(t.shape)} does not fit grid {grid}")
        c = c4 // 4
        ch, y, x = _pack_index(c, h, w)
        z = t.new_zeros(b, c, 2 * h, 2 * w)
        bi = torch.arange(b)[:, None, None]  # [B, 1, 1]
        z = z.index_put((bi, ch[None], y[None], x[None]), t)  # z[b, c, y, x] = t[b, n, q]
        return z[:, :, None]  # [B, C, 1, 2h, 2w]
    raise ValueError(f"unknown direction {direction!r}")


def latent_normalize(
    z: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Per-channel (axis 1) normalisation (§3.5): forward (z − mean)/std, inverse z·std + mean.

    The ideal values of the spec's (z − mean)·(1/std) and z/(1/std) + mean; z [B,C,...], mean/std [C].
    """
    z = _f64(z)
    shape = (1, -1) + (1,) * (z.dim() - 2)
    m, s = _f64(mean).reshape(shape), _f64(std).reshape(shape)
    return z * s + m if inverse else (z - m) / s


# ---------------------------------------------------------------------------------------------
# inputs


def latent_proj_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """img_in / proj_out: x [B,S,K]·wᵀ [K,N] + b → [B,S,N]."""
    return _linear(x, w, b)


def txt_in_rmsnorm_linear(
    e: torch.Tensor, gain: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """txt_in(RMSNorm(e)): e [B,L,Dj] → [B,L,d] (§2 step 3, §2.5)."""
    return _linear(_rms_norm(_f64(e), _f64(gain), eps), w, b)


def timestep_sinusoid(tau: torch.Tensor, dim: int = 256, *, phases: str = "fp32") -> torch.Tensor:
    """Cos-first sinusoid φ(τ) [B, dim] (§2.1): [cos a_0 … cos a_{h−1}, sin a_0 … sin a_{h−1}].

    ``phases="fp32"`` (default): a_k = fp32(fp32(fp32(τ)·f_k)·1000), f_k = fp32(exp(x_k)),
    x_k = fp32(fp32(−ln 10⁴)·k)/h — the contract's FP32 phase (see module doc).
    ``phases="fp64"``: a_k = 1000·τ·exp(−ln(10⁴)·k/h), all FP64.
    cos/sin are FP64 either way.
    """
    half = dim // 2
    if phases == "fp32":
        k = torch.arange(half, dtype=torch.float32)
        x = (torch.tensor(-math.log(10000.0), dtype=torch.float32) * k) / half  # fp32 × and ÷
        f = torch.exp(x.to(F64)).to(torch.float32)  # one rounding of an FP64 exp
        a = (tau.detach().to(torch.float32)[:, None] * f[None, :]) * torch.tensor(1000.0)  # fp32
        a = a.to(F64)
    elif phases == "fp64":
        k = torch.arange(half, dtype=F64)
        a = 1000.0 * _f64(tau)[:, None] * torch.exp(-math.log(10000.0) * k / half)[None, :]
    else:
        raise ValueError(f"phases must be 'fp32' or 'fp64', got {phases!r}")
    return torch.cat([torch.cos(a), torch.sin(a)], dim=-1)  # [B, dim]


def timestep_embed_mlp(
    tau: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    *,
    phases: str = "fp32",
) -> torch.Tensor:
    """temb = linear_2(SiLU(linear_1(φ(τ)))): tau [B] → [B, d] (§2 step 5, §2.1).

    No rounding of τ or φ to the model dtype: callers that model diffusers' bf16 τ pass τ already
    bf16-representable. ``phases`` as in ``timestep_sinusoid``; τ gets no gradient.
    """
    phi = timestep_sinusoid(tau, w1.shape[1], phases=phases)
    return _linear(_silu(_linear(phi, w1, b1)), w2, b2)


# ---------------------------------------------------------------------------------------------
# block: modulation


def adaln_mod_projection(temb: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """img_mod / txt_mod: SiLU(temb)·wᵀ + b, [B,d] → [B,6d] (chunks shift1, scale1, gate1,
    shift2, scale2, gate2; §2.3)."""
    return _linear(_silu(_f64(temb)), w, b)


def adaln_modulation(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """LN(x)·(1 + scale) + shift; x [B,S,d], shift/scale [B,d] broadcast over tokens (§2.3)."""
    return _layer_norm(_f64(x), eps) * (1.0 + _f64(scale)[:, None, :]) + _f64(shift)[:, None, :]


def adaln_gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate·y; x, y [B,S,d], gate [B,d] broadcast over tokens (§2.3 steps 3–4)."""
    return _f64(x) + _f64(gate)[:, None, :] * _f64(y)


# ---------------------------------------------------------------------------------------------
# block: attention (§2.2, §2.4)


def qkv_bias_gemm(
    x: torch.Tensor,
    wq: torch.Tensor,
    bq: torch.Tensor,
    wk: torch.Tensor,
    bk: torch.Tensor,
    wv: torch.Tensor,
    bv: torch.Tensor,
    heads: int,
    lora: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-stream q, k, v: x [B,S,d] → three [B,S,H,Dh] (head h holds features h·Dh … h·Dh+Dh−1);
    ``lora``: per projection (A, B, s) or None, the unfused LoRA branch (``_adapted_linear``)."""
    outs = []
    for w, b, f in zip((wq, wk, wv), (bq, bk, bv), lora or (None, None, None)):
        y = _adapted_linear(x, w, b, f)  # [B, S, H·Dh]
        outs.append(y.reshape(*y.shape[:-1], heads, y.shape[-1] // heads))
    return tuple(outs)


def qk_rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the head dim with learned gain: x [B,S,H,Dh], gain [Dh] (§2.4, §2.5)."""
    return _rms_norm(_f64(x), _f64(gain), eps)


def rope_positions(h: int, w: int, txt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer (frame, row, column) positions (§2.2): image token n = i·w + j →
    (0, i − ⌈h/2⌉, j − ⌈w/2⌉); text token k → (p, p, p), p = max(⌊h/2⌋, ⌊w/2⌋) + k.
    Returns (img [h·w, 3], txt [L, 3]) int64."""
    img = []
    for i in range(h):
        for j in range(w):
            img.append((0, i - math.ceil(h / 2), j - math.ceil(w / 2)))
    p0 = max(h // 2, w // 2)
    txt = [(p0 + k,) * 3 for k in range(txt_len)]
    return (
        torch.tensor(img, dtype=torch.int64).reshape(h * w, 3),
        torch.tensor(txt, dtype=torch.int64).reshape(txt_len, 3),
    )


def _rope_angles(pos: torch.Tensor, axes_dims: Sequence[int], theta: float, angles: str) -> torch.Tensor:
    """Rotation angles [S, Σ D_a/2] FP64 for integer positions [S, len(axes_dims)]."""
    cols = []
    for a, dim in enumerate(axes_dims):
        if dim % 2:
            raise ValueError(f"RoPE axis size must be even, got {dim}")
        if angles == "fp32":
            e = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # fp32 ÷
            pw = torch.pow(torch.tensor(float(theta), dtype=F64), e.to(F64)).to(torch.float32)
            inv = 1.0 / pw  # fp32 ÷
            ang = pos[:, a].to(torch.float32)[:, None] * inv[None, :]  # fp32 ×
            cols.append(ang.to(F64))
        elif angles == "fp64":
            i = torch.arange(dim // 2, dtype=F64)
            inv = float(theta) ** (-2.0 * i / dim)
            cols.append(pos[:, a].to(F64)[:, None] * inv[None, :])
        else:
            raise ValueError(f"angles must be 'fp32' or 'fp64', got {angles!r}")
    return torch.cat(cols, dim=1)


def rope_tables(
    h: int,
    w: int,
    txt_len: int,
    axes_dims: Sequence[int] = (16, 56, 56),
    theta: float = 10000.0,
    *,
    angles: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Three-axis RoPE tables (§2.2): (img [h·w, Dh/2], txt [L, Dh/2]) complex128, e^{iθ}.

    Columns are [axis0 (D_0/2) | axis1 (D_1/2) | axis2 (D_2/2)]; positions from
    ``rope_positions``; θ = p·theta^(−2i/D_a), with the contract's FP32 angle (default) or FP64.
    """
    pi, pt = rope_positions(h, w, txt_len)
    out = []
    for pos in (pi, pt):
        ang = _rope_angles(pos, axes_dims, theta, angles)
        out.append(torch.complex(torch.cos(ang), torch.sin(ang)))
    return out[0], out[1]


def multi_axis_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation (§2.2): for pair j of each head vector,
    y[2j] = x[2j]·cos θ_j − x[2j+1]·sin θ_j, y[2j+1] = x[2j]·sin θ_j + x[2j+1]·cos θ_j.
    x [B,S,H,Dh], freqs [S,Dh/2] complex (e^{iθ}; its real/imag parts are used as given)."""
    x = _f64(x)
    c = freqs.real.to(F64)[None, :, None, :]  # [1, S, 1, Dh/2]
    s = freqs.imag.to(F64)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]  # [B, S, H, Dh/2]
    y = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)  # [B, S, H, Dh/2, 2]
    return y.reshape(x.shape)


def joint_attn_qk_gemm(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """scores[b,h,i,j] = Σ_d q[b,i,h,d]·k[b,j,h,d] / √Dh: q, k [B,S,H,Dh] → [B,H,S,S]."""
    q, k = _f64(q), _f64(k)
    return torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])


def joint_attn_softmax(scores: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over keys (last axis); keys with key_mask[b, j] false get probability exactly 0.
    scores [B,H,S,S], key_mask [B,S] bool (joint [text, image]) or None."""
    s = _f64(scores)
    if key_mask is not None:
        s = s.masked_fill(~key_mask.bool()[:, None, None, :], -math.inf)
    return torch.softmax(s, dim=-1)


def joint_attn_av_gemm(
    probs: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """out[b,i,h,:] = Σ_{j valid} probs[b,h,i,j]·v[b,j,h,:]: probs [B,H,S,S], v [B,S,H,Dh] →
    [B,S,H,Dh]. Masked keys contribute nothing whatever their probability."""
    v = _f64(v)
    if key_mask is not None:  # Σ_j p_ij·(m_j·v_j): zeroing the [B,S,H,Dh] values is the cheap side
        v = v * key_mask.to(F64)[:, :, None, None]
    return torch.einsum("bhij,bjhd->bihd", _f64(probs), v)


def joint_attention_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh, masked keys excluded)·v: q, k, v [B,S,H,Dh] → [B,S,H,Dh] (§2.4)."""
    p = joint_attn_softmax(joint_attn_qk_gemm(q, k), key_mask)
    return joint_attn_av_gemm(p, v, key_mask)


def attn_out_bias_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lora: tuple | None = None) -> torch.Tensor:
    """to_out.0 / to_add_out: [B,S,d] → [B,S,d]; ``lora`` (A, B, s): ``_adapted_linear``."""
    return _adapted_linear(x, w, b, lora)


# ---------------------------------------------------------------------------------------------
# block: MLP, final layer


def mlp_up_gemm_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lora: tuple | None = None) -> torch.Tensor:
    """GELU_tanh(x·wᵀ + b): [B,S,d] → [B,S,4d] (§2.3 step 4); ``lora`` (A, B, s): the branch is
    added before the GELU (``_adapted_linear``)."""
    return _gelu_tanh(_adapted_linear(x, w, b, lora))


def mlp_down_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lora: tuple | None = None) -> torch.Tensor:
    """net.2: [B,S,4d] → [B,S,d]; ``lora`` (A, B, s): ``_adapted_linear``."""
    return _adapted_linear(x, w, b, lora)


def final_adaln_out(
    x: torch.Tensor, temb: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """norm_out (§2 step 8): (scale, shift) = split(SiLU(temb)·wᵀ + b) — scale first;
    LN(x)·(1 + scale) + shift; x [B,N,d], temb [B,d] → [B,N,d]."""
    emb = adaln_mod_projection(temb, w, b)  # [B, 2d]
    d = emb.shape[-1] // 2
    scale, shift = emb[:, :d], emb[:, d:]
    return _layer_norm(_f64(x), eps) * (1.0 + scale[:, None, :]) + shift[:, None, :]


# ---------------------------------------------------------------------------------------------
# sampler operators, differentiable (§3.4, §4): the torch/FP64 twins of references/sampler.py
# (numpy), for backward; same algebraically simplified forms, independent of drifttool.ops.


def cfg_combine_renorm(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """comb = u + s(c − u); v = comb·‖c‖/‖comb‖ with 2-norms per token over the last axis (§3.4).
    v_cond, v_uncond [B,N,C] → [B,N,C]."""
    c, u = _f64(v_cond), _f64(v_uncond)
    comb = u + float(scale) * (c - u)
    norm_c = torch.sqrt((c * c).sum(dim=-1, keepdim=True))
    norm_comb = torch.sqrt((comb * comb).sum(dim=-1, keepdim=True))
    return comb * (norm_c / norm_comb)


def flow_sde_step_logp(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-GRPO 'sde' step (§4): (x_next, logp [B], mu, std_t [B]), FP64.

    std = η·sqrt(σ/(1 − σ̃)), σ̃ = σ_max if σ == 1 else σ; μ = x + Δv + Δ·(std²/(2σ))·(x + (1−σ)v),
    Δ = σ' − σ; s = std·sqrt(−Δ); x_next = μ + s·noise (or prev_sample), detached;
    logp = mean over the non-batch dims of −(x_next − μ)²/(2s²) − ln s − ln√(2π).
    η = 0: μ = x + Δv, x_next = μ (or prev_sample), std = 0, logp = NaN. Schedule values are
    scalars or [B] (per sample).
    """
    v, x = _f64(v), _f64(x)
    b = x.shape[0]

    def per_sample(t):
        t = torch.as_tensor(t, dtype=F64).detach().reshape(-1)
        return (t.expand(b) if t.numel() == 1 else t).reshape(b, *([1] * (x.dim() - 1)))

    s, sn, sm = per_sample(sigma), per_sample(sigma_next), per_sample(sigma_max)
    dt = sn - s
    if float(eta) == 0.0:
        mu = x + dt * v
        x_next = (mu if prev_sample is None else _f64(prev_sample)).detach()
        return x_next, torch.full((b,), math.nan, dtype=F64), mu, torch.zeros(b, dtype=F64)
    std = float(eta) * torch.sqrt(s / (1.0 - torch.where(s == 1.0, sm, s)))
    mu = x + dt * v + dt * (std * std / (2.0 * s)) * (x + (1.0 - s) * v)
    scale = std * torch.sqrt(-dt)
    x_next = (mu + scale * _f64(noise) if prev_sample is None else _f64(prev_sample)).detach()
    dens = -((x_next - mu) ** 2) / (2.0 * scale * scale) - torch.log(scale) - 0.5 * math.log(2.0 * math.pi)
    return x_next, dens.reshape(b, -1).mean(dim=1), mu, std.reshape(b)


SAMPLER_OPS: dict[str, Callable[..., Any]] = {
    "cfg_combine_renorm": cfg_combine_renorm,
    "flow_sde_step_logp": flow_sde_step_logp,
}
"""The differentiable sampler rows → reference function (``flow_sigma_table`` is forward only;
see references/sampler.py)."""


# ---------------------------------------------------------------------------------------------
# LoRA (not an RFC row)


def lora_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The adapted weight W + scale·(B·A) in FP64: w [out, in], a [r, in], b [out, r] → [out, in]."""
    return _f64(w) + float(scale) * torch.matmul(_f64(b), _f64(a))


# ---------------------------------------------------------------------------------------------
# index and backward


OPS: dict[str, Callable[..., Any]] = {
    "latent_pack_unpack": latent_pack_unpack,
    "latent_normalize": latent_normalize,
    "latent_proj_gemm": latent_proj_gemm,
    "txt_in_rmsnorm_linear": txt_in_rmsnorm_linear,
    "timestep_embed_mlp": timestep_embed_mlp,
    "adaln_mod_projection": adaln_mod_projection,
    "adaln_modulation": adaln_modulation,
    "adaln_gate_residual": adaln_gate_residual,
    "qkv_bias_gemm": qkv_bias_gemm,
    "qk_rmsnorm": qk_rmsnorm,
    "multi_axis_rope": multi_axis_rope,
    "joint_attn_qk_gemm": joint_attn_qk_gemm,
    "joint_attn_softmax": joint_attn_softmax,
    "joint_attn_av_gemm": joint_attn_av_gemm,
    "joint_attention_fused": joint_attention_fused,
    "attn_out_bias_gemm": attn_out_bias_gemm,
    "mlp_up_gemm_gelu": mlp_up_gemm_gelu,
    "mlp_down_gemm": mlp_down_gemm,
    "final_adaln_out": final_adaln_out,
}
"""Operator name (RFC row, as in drifttool/ops/specs.py) → reference function."""


def vjp(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    grad_out: torch.Tensor | Sequence[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor | None, ...]:
    """Vector–Jacobian product of a reference function in FP64.

    Every real floating tensor in ``inputs`` becomes a float64 leaf; other arguments (bool masks,
    complex RoPE tables, ints, strings, None) pass through unchanged. ``fn(*inputs, **kwargs)`` is
    differentiated against ``grad_out`` (one tensor, or one per output for tuple outputs).

    Returns:
        One entry per input: the FP64 gradient (zeros where the output does not depend on the
        input), or None for inputs that are not differentiated.
    """
    args, leaves = [], []
    for a in inputs:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().to(F64).requires_grad_(True)
            leaves.append(a)
        args.append(a)
    with torch.enable_grad():
        out = fn(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        gos = grad_out if isinstance(grad_out, (tuple, list)) else (grad_out,)
        if len(gos) != len(outs):
            raise ValueError(f"{len(outs)} outputs but {len(gos)} output gradients")
        grads = torch.autograd.grad(
            outs, leaves, [g.to(F64) for g in gos], allow_unused=True, materialize_grads=True
        )
    it = iter(grads)
    return tuple(
        next(it).detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else None
        for a in inputs
    )
