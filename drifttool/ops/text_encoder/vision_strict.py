"""``strict`` family of the vision tower's arithmetic operators on the CPU: an image's bytes do not
depend on the other images packed with it, their order or their number.

    >>> y = call(Runtime(mode="strict"), "te_vision_merger", x, gain, w1, b1, w2, b2, 4,
    ...          stream="img", layout="S.")

The language model's strict primitives, with the same cast points (FP32 inside, one cast to the
activation dtype at the output):

- ``te_vision_patch_embed``: the Conv3d with stride = kernel is a GEMM over the 3·T·P·P pixels
  of a patch in (c, t, y, x) order: ``tiled_linear`` on the pixels cast to the weight's dtype
  (as production casts them), output in the weight's dtype;
- ``te_vision_rope_table``: inverse frequencies θ^(−2i/(Dh/2)) and angles in FP64, ``sincos64``,
  rounded once to FP32;
- ``te_vision_rmsnorm``: ``te_rmsnorm``'s;
- GEMMs (Q/K/V, attention output, MLP): ``tiled_linear`` (contract v2, row-invariant), biases
  added once, SiLU by ``silu32``, residuals in FP32;
- ``te_vision_attention``: each segment, each head, as the language model's strict attention
  without the causal mask (pairwise-tree dots, ``exp32``, pairwise trees over the segment's keys):
  a segment's bytes depend on its own rows only;
- ``te_vision_merger``: ``te_rmsnorm``'s norm (rounded to the activation dtype, as production),
  ``tiled_linear``, exact GELU by ``gelu_erf32``, ``tiled_linear``, one cast.
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict_gemm import LINEAR_KERNEL, tiled_linear
from drifttool.ops.strict_math import gelu_erf32, silu32, sincos64
from drifttool.ops.text_encoder.strict import ATTN_ELEMS, attend, te_rmsnorm

strict_cpu("te_vision_rmsnorm", "x", "gain", kernel="tree_rmsnorm")(te_rmsnorm)


@strict_cpu("te_vision_patch_embed", "w", kernel=LINEAR_KERNEL)
def te_vision_patch_embed(pixels, w):
    """pixels [N, 3·T·P·P] (any float), w [E, 3, T, P, P] → [N, E] in w's dtype."""
    x = pixels.reshape(pixels.shape[0], -1).to(w.dtype)
    return out(tiled_linear(f32(x), f32(w.reshape(w.shape[0], -1))), w.dtype)


@strict_cpu("te_vision_rope_table", kernel="axial_rope.sincos64")
def te_vision_rope_table(positions, head_dim: int, theta: float):
    """(cos, sin) FP32 [N, Dh] of the axial RoPE: positions [N, 2] (row, col); frequency i < Dh/4
    of the row half uses the row, of the column half the column; the second Dh/2 repeats them."""
    spatial = head_dim // 2
    inv = torch.tensor([theta ** (-(2 * i) / spatial) for i in range(spatial // 2)], dtype=torch.float64)
    pos = positions.to(torch.float64)  # [N, 2]
    angles = torch.cat([pos[:, :1] * inv, pos[:, 1:] * inv], dim=-1)  # [N, Dh/2]
    s, c = sincos64(angles)
    cos, sin = c.to(torch.float32), s.to(torch.float32)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


@strict_cpu("te_vision_qkv", "x", "w", "b", kernel=LINEAR_KERNEL)
def te_vision_qkv(x, w, b, heads: int):
    """x [N, D], w [3·H·Dh, D], b [3·H·Dh] → q, k, v [N, H, Dh]."""
    y = out(tiled_linear(f32(x), f32(w), f32(b)), act_dtype(x, w))
    return tuple(y.reshape(x.shape[0], 3, heads, -1).unbind(1))


@strict_cpu("te_vision_attention", "q", "k", "v", kernel="segment_attention.exact_tree")
def te_vision_attention(q, k, v, cu_seqlens):
    """Bidirectional attention within each segment [cu[i], cu[i+1]): q, k, v [N, H, Dh] →
    [N, H, Dh]; a query attends every key of its segment."""
    n, heads, d = q.shape
    scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    qf, kf, vf = f32(q), f32(k), f32(v)
    res = torch.empty(n, heads, d, dtype=torch.float32)
    bounds = [int(c) for c in cu_seqlens.tolist()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        length = b - a
        rows = max(1, ATTN_ELEMS // max(1, length * d))
        for j in range(heads):
            kh, vh = kf[a:b, j], vf[a:b, j]
            for r in range(a, b, rows):
                stop = min(r + rows, b)
                valid = torch.ones(stop - r, length, dtype=torch.bool)
                res[r:stop, j] = attend(qf[r:stop, j], kh, vh, valid, scale)
    return out(res, act_dtype(q))


@strict_cpu("te_vision_attn_out_residual", "x", "a", "w", "b", kernel=LINEAR_KERNEL)
def te_vision_attn_out_residual(x, a, w, b):
    """x + a·wᵀ + b: x [N, D], a [N, H, Dh], w [D, H·Dh] → [N, D]."""
    return out(f32(x) + tiled_linear(f32(a.reshape(a.shape[0], -1)), f32(w), f32(b)), act_dtype(x, a))


@strict_cpu("te_vision_mlp_gate_up_silu", "h", "w_gate", "w_up", kernel="silu_exact*" + LINEAR_KERNEL)
def te_vision_mlp_gate_up_silu(h, w_gate, b_gate, w_up, b_up):
    """SiLU(h·w_gateᵀ + b_gate) · (h·w_upᵀ + b_up): h [N, D] → [N, I]."""
    hf = f32(h)
    return out(silu32(tiled_linear(hf, f32(w_gate), f32(b_gate))) * tiled_linear(hf, f32(w_up), f32(b_up)),
               act_dtype(h))


@strict_cpu("te_vision_mlp_down_residual", "x", "m", "w", kernel=LINEAR_KERNEL)
def te_vision_mlp_down_residual(x, m, w, b):
    """x + m·wᵀ + b: x [N, D], m [N, I] → [N, D]."""
    return out(f32(x) + tiled_linear(f32(m), f32(w), f32(b)), act_dtype(x, m))


@strict_cpu("te_vision_merger", "x", "gain", "w1", "w2", kernel="gelu_erf_exact*" + LINEAR_KERNEL)
def te_vision_merger(x, gain, w1, b1, w2, b2, merge_unit: int, eps: float = 1e-6):
    """RMSNorm, m² consecutive rows joined, Linear, exact GELU, Linear: x [N, D] → [N/m², D_out]."""
    h = f32(te_rmsnorm(x, gain, eps)).reshape(-1, x.shape[-1] * merge_unit)
    return out(tiled_linear(gelu_erf32(tiled_linear(h, f32(w1), f32(b1))), f32(w2), f32(b2)), act_dtype(x))
