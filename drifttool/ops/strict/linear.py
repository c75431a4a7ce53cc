"""Strict GEMM operators: latent_proj_gemm, qkv_bias_gemm, attn_out_bias_gemm, mlp_up_gemm_gelu,
mlp_down_gemm.

Reduction order (all five): ``strict_gemm.tiled_linear``, strict contract v2 — K split into 8
segments by recursive halving, each segment cut into 64-element chunks added sequentially, the
segments combined by the depth-3 tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); in-chunk exact products
(pairwise tree) for small weights (N·K ≤ 65536, portable bytes), otherwise fixed-shape matmul
members [16, c] @ [c, 128]; bias added once, FP32 throughout; output cast once to the activation
dtype. TP shards of K (row-parallel) or of N in multiples of 128 (column-parallel) reproduce the
bytes (docs/strict-arithmetic.md, "Contract v2").

Backward (``torch.autograd.Function``; orders in ``drifttool.ops.strict.grad``): dX =
``tiled_linear`` of dY with the transposed weight (per row, contract v2 over N); dW and db per
sample over its live rows by contract v2 (64-row blocks, 8 segments), then over the samples in
batch order by the pairwise tree; each gradient cast once to its input's dtype.

LoRA (mode ``unfused-fp32``): the four block GEMMs (``qkv_bias_gemm``, ``attn_out_bias_gemm``,
``mlp_up_gemm_gelu``, ``mlp_down_gemm``) take the keyword ``lora`` — ``None``, ``(A, B, s)``, or
for ``qkv_bias_gemm`` one entry (or ``None``) per q, k, v — and add the adapter branch in FP32
before the epilogue (``drifttool.ops.strict.lora_linear``; constraint ``ops.lora.lora_factors``:
FP32 factors that fit the weight). Without ``lora`` (or with only ``None`` entries) they run the
code below unchanged. The trace's kernel id is the implementation's, with or without the adapter
(the registry records one kernel id per implementation); a run's manifest names the mode
(``lora.mode``), and its trace has no ``lora_merge`` calls.
"""

from __future__ import annotations

import torch

from drifttool.ops.lora import adapter_given, lora_factors
from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict.grad import cast_like, g32, gelu_tanh_grad32, linear_grads, linear_input_grad
from drifttool.ops.strict.lora_linear import AdaptedLinear, adapted_qkv
from drifttool.ops.strict_gemm import LINEAR_KERNEL, tiled_linear
from drifttool.ops.strict_math import gelu_tanh32


class _Linear(torch.autograd.Function):
    """y = x·wᵀ + b (FP32 tiled_linear, one cast); backward by ``grad.linear_grads``."""

    @staticmethod
    def forward(ctx, x, w, b, dt):
        xf, wf = f32(x), f32(w)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, w, b)
        return out(tiled_linear(xf, wf, f32(b)), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w, b = ctx.saved_tensors
        dx, dw, db = linear_grads(g32(gy), f32(x), f32(w), ctx.needs_input_grad[:3])
        return cast_like(dx, x), cast_like(dw, w), cast_like(db, b), None


def _gemm(x, w, b):
    return _Linear.apply(x, w, b, act_dtype(x, w, b))


@strict_cpu("latent_proj_gemm", "x", "w", "b", kernel=LINEAR_KERNEL)
def latent_proj_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """img_in ([B,N,64]→[B,N,d]) or proj_out ([B,N,d]→[B,N,64]); RFC row latent_proj_gemm."""
    return _gemm(x, w, b)


class _QKV(torch.autograd.Function):
    """Three projections of one input; backward: dX = (dq·wq + dk·wk) + dv·wv, each product a
    contract-v2 reduction over d (so TP head shards, which hold a slice of each of q, k and v,
    own subtrees of all three), dW/db per projection."""

    @staticmethod
    def forward(ctx, x, wq, bq, wk, bk, wv, bv, heads, dt):
        if any(ctx.needs_input_grad[:7]):
            ctx.save_for_backward(x, wq, bq, wk, bk, wv, bv)
        xf = f32(x)
        outs = []
        for w, b in ((wq, bq), (wk, bk), (wv, bv)):
            y = out(tiled_linear(xf, f32(w), f32(b)), dt)  # [B,S,d]
            outs.append(y.unflatten(-1, (heads, -1)))  # [B,S,H,Dh]
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk, gv):
        x, wq, bq, wk, bk, wv, bv = ctx.saved_tensors
        need = ctx.needs_input_grad
        xf = f32(x)
        gs = [g32(g).flatten(-2) for g in (gq, gk, gv)]  # 3 × [B,S,d]
        dx = None
        if need[0]:  # (dq·Wq + dk·Wk) + dv·Wv, each reduced over d by contract v2
            dq, dk, dv = (linear_input_grad(g, f32(w)) for g, w in zip(gs, (wq, wk, wv)))
            dx = cast_like((dq + dk) + dv, x)
        grads = []
        for i, (w, b) in enumerate(((wq, bq), (wk, bk), (wv, bv))):
            _, dw, db = linear_grads(gs[i], xf, w, (False, need[1 + 2 * i], need[2 + 2 * i]))
            grads += [cast_like(dw, w), cast_like(db, b)]
        return (dx, *grads, None, None)


@strict_cpu("qkv_bias_gemm", "x", "wq", "bq", "wk", "bk", "wv", "bv", kernel=LINEAR_KERNEL,
            constraints=(lora_factors("x", "wq", "wk", "wv"),))
def qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads: int, lora: tuple | None = None):
    """Per-stream Q/K/V: x [B,S,d] → three [B,S,H,Dh] (numerics §2.4); ``lora`` = (q, k, v)
    entries, each (A [r,d] fp32, B [d,r] fp32, s) or None (module docstring)."""
    dt = act_dtype(x, wq, bq, wk, bk, wv, bv)
    if not adapter_given(lora):
        return _QKV.apply(x, wq, bq, wk, bk, wv, bv, heads, dt)
    return adapted_qkv(x, wq, bq, wk, bk, wv, bv, lora, heads, dt)


def _adapted(x, w, b, lora, gelu=False):
    """The one-projection GEMM, with its LoRA branch when ``lora`` = (A, B, s)."""
    if lora is None:
        return _LinearGelu.apply(x, w, b, act_dtype(x, w, b)) if gelu else _gemm(x, w, b)
    a, bb, s = lora
    return AdaptedLinear.apply(x, w, b, a, bb, s, act_dtype(x, w, b), gelu)


@strict_cpu("attn_out_bias_gemm", "x", "w", "b", kernel=LINEAR_KERNEL, constraints=(lora_factors("x", "w"),))
def attn_out_bias_gemm(x, w, b, lora: tuple | None = None):
    """to_out.0 / to_add_out: [B,S,d] → [B,S,d]; ``lora`` = (A [r,d] fp32, B [d,r] fp32, s) or None."""
    return _adapted(x, w, b, lora)


class _LinearGelu(torch.autograd.Function):
    """GELU_tanh(x·wᵀ + b); the FP32 pre-activation is kept for the backward:
    dpre = dy·gelu'(pre) (gelu' in FP64 from exact ops, rounded once; one FP32 product), then
    the linear backward of dpre."""

    @staticmethod
    def forward(ctx, x, w, b, dt):
        pre = tiled_linear(f32(x), f32(w), f32(b))  # [B,S,4d] fp32
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, w, b, pre)
        return out(gelu_tanh32(pre), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w, b, pre = ctx.saved_tensors
        dpre = g32(gy) * gelu_tanh_grad32(pre)
        dx, dw, db = linear_grads(dpre, f32(x), f32(w), ctx.needs_input_grad[:3])
        return cast_like(dx, x), cast_like(dw, w), cast_like(db, b), None


@strict_cpu("mlp_up_gemm_gelu", "x", "w", "b", kernel=LINEAR_KERNEL + "+gelu_tanh.f64",
            constraints=(lora_factors("x", "w"),))
def mlp_up_gemm_gelu(x, w, b, lora: tuple | None = None):
    """GELU_tanh(x·wᵀ + b): GEMM in FP32, GELU in FP64 from exact ops, one cast (numerics §2.3);
    ``lora`` = (A [r,d] fp32, B [4d,r] fp32, s) adds its branch before the GELU, or None."""
    return _adapted(x, w, b, lora, gelu=True)


@strict_cpu("mlp_down_gemm", "x", "w", "b", kernel=LINEAR_KERNEL, constraints=(lora_factors("x", "w"),))
def mlp_down_gemm(x, w, b, lora: tuple | None = None):
    """img_mlp.net.2 / txt_mlp.net.2: [B,S,4d] → [B,S,d]; ``lora`` = (A [r,4d] fp32, B [d,r] fp32, s) or None."""
    return _adapted(x, w, b, lora)
