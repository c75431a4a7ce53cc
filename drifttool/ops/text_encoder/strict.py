"""``strict`` family of the text encoder's arithmetic operators on the CPU: a prompt's bytes do
not depend on the batch it is encoded in, its position there, or the padding length.

    >>> y = call(Runtime(mode="strict"), "te_rmsnorm", x, gain, 1e-6, stream="txt", layout="BS.")

Every operator upcasts to FP32, computes with the strict primitives (``drifttool.ops.
strict_math``) and casts its output once to the activation dtype (the first tensor's):

- ``te_rmsnorm``: mean of squares by the pairwise ``tree_mean``, ``rsqrt`` in FP64 rounded once;
  ``x̂`` is cast to the activation dtype before the gain, as transformers does;
- GEMMs (``te_qkv_bias_gemm``, ``te_attn_out_residual``, ``te_mlp_gate_up_silu``,
  ``te_mlp_down_residual``): ``tiled_linear`` (contract v2: row-invariant); SiLU from exact
  operations (``silu32``); residual added in FP32, once;
- ``te_mrope``: inverse frequencies θ^(−2i/Dh) and angles in FP64, ``sincos64`` (exact
  operations only), rounded once to FP32; rotate-half in FP32;
- ``te_causal_attention``: per (query, key) the dot product by the pairwise tree over Dh
  (correctly rounded FP32 products), scaled by fp32(1/√Dh); keys after the query or masked
  contribute exact zeros; max, ``exp32``, and the two key sums (the pairwise tree over the key
  axis, whose trailing zeros change nothing) — so padding keys and the batch change no byte.
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict.embed import rms_parts
from drifttool.ops.strict_gemm import LINEAR_KERNEL, tiled_linear
from drifttool.ops.strict_math import exp32, silu32, sincos64, tree_sum

ATTN_ELEMS = 1 << 24  # products materialised at once by the attention (bytes do not depend on it)


@strict_cpu("te_rmsnorm", "x", "gain", kernel="tree_rmsnorm")
def te_rmsnorm(x, gain, eps: float = 1e-6):
    """gain · cast(x · rsqrt(mean(x²) + eps)): x [B, L, D], gain [D] → [B, L, D]."""
    dt = act_dtype(x, gain)
    xhat, _ = rms_parts(f32(x), eps)
    return out(f32(gain) * f32(xhat.to(x.dtype)), dt)


def _heads(y: torch.Tensor, heads: int) -> torch.Tensor:
    return y.unflatten(-1, (heads, -1))  # [B, L, H·Dh] → [B, L, H, Dh]


@strict_cpu("te_qkv_bias_gemm", "x", "wq", "bq", "wk", "bk", "wv", "bv", kernel=LINEAR_KERNEL)
def te_qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads: int, kv_heads: int):
    """(q [B,L,H,Dh], k [B,L,Hkv,Dh], v [B,L,Hkv,Dh]) = x·Wᵀ + b for each projection."""
    dt, xf = act_dtype(x, wq), f32(x)
    q = tiled_linear(xf, f32(wq), f32(bq))
    k = tiled_linear(xf, f32(wk), f32(bk))
    v = tiled_linear(xf, f32(wv), f32(bv))
    return out(_heads(q, heads), dt), out(_heads(k, kv_heads), dt), out(_heads(v, kv_heads), dt)


def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                  section: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) FP32 [B, L, Dh] of the multimodal RoPE: frequency i < Dh/2 takes its angle
    from position axis (the index of i's ``section`` chunk) mod 3; the second half repeats the
    first. Inverse frequencies θ^(−2i/Dh) in FP64 (Python floats), angles pos·f in FP64."""
    half = head_dim // 2
    inv = torch.tensor([theta ** (-(2 * i) / head_dim) for i in range(half)], dtype=torch.float64)
    axis = torch.tensor([j % 3 for j, n in enumerate(section) for _ in range(n)])  # [Dh/2]
    pos = positions.to(torch.float64)  # [3, B, L]
    angles = pos[axis].permute(1, 2, 0) * inv  # [B, L, Dh/2]: pos[axis[i], b, l] · f_i
    s, c = sincos64(angles)
    cos, sin = c.to(torch.float32), s.to(torch.float32)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


@strict_cpu("te_mrope", "x", kernel="mrope.sincos64")
def te_mrope(x, positions, theta: float, section: tuple[int, ...]):
    """x·cos + rotate_half(x)·sin: x [B, L, H, Dh], positions [3, B, L] int64 → [B, L, H, Dh].

    Raises:
        UnsupportedConfigError (via the primitives): none beyond the declared dtypes; a
            ``section`` that does not sum to Dh/2 raises ValueError.
    """
    if sum(section) != x.shape[-1] // 2:
        raise ValueError(f"te_mrope: mrope_section {tuple(section)} must sum to head_dim/2 = {x.shape[-1] // 2}")
    cos, sin = mrope_cos_sin(positions, x.shape[-1], theta, tuple(section))
    xf = f32(x)
    return out(xf * cos[:, :, None] + rotate_half(xf) * sin[:, :, None], x.dtype)


def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, valid: torch.Tensor,
            scale: torch.Tensor) -> torch.Tensor:
    """One (sample, head): qh [Lq, Dh], kh/vh [L, Dh] FP32, valid [Lq, L] bool → [Lq, Dh] FP32."""
    s = tree_sum(qh[:, None, :] * kh[None, :, :]) * scale  # [Lq, L]
    s = torch.where(valid, s, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.where(valid, exp32(s - m), 0.0)
    num = tree_sum(p[:, :, None] * vh[None, :, :], dim=1)  # [Lq, Dh]
    return num / tree_sum(p)[:, None]


@strict_cpu("te_causal_attention", "q", "k", "v", kernel="causal_attention.exact_tree")
def te_causal_attention(q, k, v, key_mask=None):
    """Causal attention with grouped K/V heads: q [B,L,H,Dh], k/v [B,L,Hkv,Dh], key_mask [B,L]
    (bool or 0/1; None = every key valid) → [B,L,H,Dh]. Query i attends the valid keys j ≤ i;
    query head h reads K/V head h // (H/Hkv). A query without a valid key gives NaN rows (the
    padding rows of a left-padded batch; right padding never has one).
    """
    b, n, h, d = q.shape
    groups = h // k.shape[2]
    scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keys = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask.bool()
    qf, kf, vf = f32(q), f32(k), f32(v)
    res = torch.empty(b, n, h, d, dtype=torch.float32)
    rows = max(1, ATTN_ELEMS // max(1, n * d))
    for i in range(b):
        valid = causal & keys[i][None, :]
        for j in range(h):
            kh, vh = kf[i, :, j // groups], vf[i, :, j // groups]
            for r in range(0, n, rows):
                res[i, r : r + rows, j] = attend(qf[i, r : r + rows, j], kh, vh, valid[r : r + rows], scale)
    return out(res, act_dtype(q))


@strict_cpu("te_attn_out_residual", "x", "a", "w", kernel=LINEAR_KERNEL)
def te_attn_out_residual(x, a, w):
    """x + a·wᵀ: x [B, L, D], a [B, L, H·Dh], w [D, H·Dh] → [B, L, D]."""
    return out(f32(x) + tiled_linear(f32(a), f32(w)), act_dtype(x, a))


@strict_cpu("te_mlp_gate_up_silu", "h", "w_gate", "w_up", kernel="silu_exact*" + LINEAR_KERNEL)
def te_mlp_gate_up_silu(h, w_gate, w_up):
    """SiLU(h·w_gateᵀ) · (h·w_upᵀ): h [B, L, D], w_gate/w_up [I, D] → [B, L, I]."""
    hf = f32(h)
    return out(silu32(tiled_linear(hf, f32(w_gate))) * tiled_linear(hf, f32(w_up)), act_dtype(h))


@strict_cpu("te_mlp_down_residual", "x", "m", "w", kernel=LINEAR_KERNEL)
def te_mlp_down_residual(x, m, w):
    """x + m·wᵀ: x [B, L, D], m [B, L, I], w [D, I] → [B, L, D]."""
    return out(f32(x) + tiled_linear(f32(m), f32(w)), act_dtype(x, m))
