"""Strict GEMM operators: latent_proj_gemm, qkv_bias_gemm, attn_out_bias_gemm, mlp_up_gemm_gelu,
mlp_down_gemm.

Reduction order (all five): ``strict_math.tiled_linear`` — exact products summed by the pairwise
tree over K for small weights (N·K ≤ 65536, portable bytes), otherwise rows in tiles of 16, K in
chunks of 128, one fixed-shape batched matmul per chunk, chunk partials summed in the pairwise
tree; bias added once, FP32 throughout; output cast once to the activation dtype.
"""

from __future__ import annotations

import torch

from drifttool.ops.registry import implements
from drifttool.ops.strict._checks import check, f32, out
from drifttool.ops.strict_math import LINEAR_KERNEL, gelu_tanh32, tiled_linear



def _gemm(op: str, x, w, b):
    dt = check(op, x, w, b)
    return out(tiled_linear(f32(x), f32(w), f32(b)), dt)


@implements("latent_proj_gemm", "strict", kernel=LINEAR_KERNEL)
def latent_proj_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """img_in ([B,N,64]→[B,N,d]) or proj_out ([B,N,d]→[B,N,64]); RFC row latent_proj_gemm."""
    return _gemm("latent_proj_gemm", x, w, b)


@implements("qkv_bias_gemm", "strict", kernel=LINEAR_KERNEL)
def qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads: int):
    """Per-stream Q/K/V: x [B,S,d] → three [B,S,H,Dh] (numerics §2.4)."""
    dt = check("qkv_bias_gemm", x, wq, bq, wk, bk, wv, bv)
    xf = f32(x)
    outs = []
    for w, b in ((wq, bq), (wk, bk), (wv, bv)):
        y = out(tiled_linear(xf, f32(w), f32(b)), dt)  # [B,S,d]
        outs.append(y.unflatten(-1, (heads, -1)))  # [B,S,H,Dh]
    return tuple(outs)


@implements("attn_out_bias_gemm", "strict", kernel=LINEAR_KERNEL)
def attn_out_bias_gemm(x, w, b):
    """to_out.0 / to_add_out: [B,S,d] → [B,S,d]."""
    return _gemm("attn_out_bias_gemm", x, w, b)


@implements("mlp_up_gemm_gelu", "strict", kernel=LINEAR_KERNEL + "+gelu_tanh.f64")
def mlp_up_gemm_gelu(x, w, b):
    """GELU_tanh(x·wᵀ + b): GEMM in FP32, GELU in FP64 from exact ops, one cast (numerics §2.3)."""
    dt = check("mlp_up_gemm_gelu", x, w, b)
    pre = tiled_linear(f32(x), f32(w), f32(b))  # [B,S,4d] fp32
    return out(gelu_tanh32(pre), dt)


@implements("mlp_down_gemm", "strict", kernel=LINEAR_KERNEL)
def mlp_down_gemm(x, w, b):
    """img_mlp.net.2 / txt_mlp.net.2: [B,S,4d] → [B,S,d]."""
    return _gemm("mlp_down_gemm", x, w, b)
