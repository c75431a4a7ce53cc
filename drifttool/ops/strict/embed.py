"""Strict input embeddings: txt_in_rmsnorm_linear, timestep_embed_mlp (numerics §2 steps 3, 5).

Backward (``torch.autograd.Function``; FP32, each gradient cast once to its input's dtype):
txt_in: the linear backward (``drifttool.ops.strict.linear``), then the RMSNorm backward
de = rstd·(gy − xhat·(Σ(gy·xhat)/D)) with gy = dyn·gain and dgain = Σ over logical rows of
dyn·xhat (per sample by the contract-v2 row-block order, then the pairwise tree over samples). timestep MLP: linear backward of linear_2, dh1 = dh·SiLU'(h1),
linear backward of linear_1 for its weight and bias; τ gets no gradient (the contract pins the
phases in FP32 from τ's value, as the reference does).
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.constraints import dtypes
from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict.grad import (
    cast_like, g32, linear_grads, rms_norm_grad, row_sum, sample_sum, silu_grad32,
)
from drifttool.ops.strict_gemm import LINEAR_KERNEL, tiled_linear
from drifttool.ops.strict_math import exp32, rsqrt64, silu32, sincos64, tree_mean


def rms_parts(xf: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(xhat, rstd) of x · rsqrt(mean(x²) + eps) over the last axis, FP32 in and out (xhat = x·rstd;
    rstd FP32 [...]): mean(x²) by the pairwise ``tree_mean``; ``+ eps``, sqrt and reciprocal in
    FP64, rounded once to FP32."""
    var = tree_mean(xf * xf)  # [...]
    rstd = rsqrt64(var.double() + eps).to(torch.float32)
    return xf * rstd.unsqueeze(-1), rstd


def rms_gain_grads(gy: torch.Tensor, x, gain, xhat, rstd, needs) -> tuple:
    """(dx, dgain) of xhat·gain, given gy = dL/d(xhat·gain) FP32 [B, ..., D]. dgain: per sample
    over its live rows (all middle axes, row-major) by the contract-v2 row-block order
    (``grad.row_sum``), then over samples by the pairwise tree."""
    dx = rms_norm_grad(gy * f32(gain), xhat, rstd) if needs[0] else None
    dgain = sample_sum(row_sum(gy * xhat)) if needs[1] else None
    return cast_like(dx, x), cast_like(dgain, gain)


class _TxtIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, gain, w, b, eps, dt):
        xhat, rstd = rms_parts(f32(e), eps)
        y = xhat * f32(gain)  # [B,L,Dj] fp32
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(e, gain, w, b, xhat, rstd, y)
        return out(tiled_linear(y, f32(w), f32(b)), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        e, gain, w, b, xhat, rstd, y = ctx.saved_tensors
        need = ctx.needs_input_grad
        norm_needed = need[0] or need[1]
        dy, dw, db = linear_grads(g32(go), y, f32(w), (norm_needed, need[2], need[3]))
        de = dgain = None
        if norm_needed:
            de, dgain = rms_gain_grads(dy, e, gain, xhat, rstd, need[:2])
        return de, dgain, cast_like(dw, w), cast_like(db, b), None, None


@strict_cpu("txt_in_rmsnorm_linear", "e", "gain", "w", "b", kernel="tree_rmsnorm+" + LINEAR_KERNEL)
def txt_in_rmsnorm_linear(e, gain, w, b, eps: float = 1e-6):
    """txt_in(RMSNorm_3584(e)): e [B,L,Dj] → [B,L,d]. FP32 seam between norm and linear, one cast.

    Device and dtypes are declared constraints (checked by dispatch).
    """
    dt = act_dtype(e, gain, w, b)
    return _TxtIn.apply(e, gain, w, b, eps, dt)


def sinusoid(tau: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Cos-first timestep sinusoid φ(τ) [B, dim] FP32 (numerics §2.1).

    f_k = exp(−ln(10000)·k/half) (exponent in FP32, exp from exact ops, rounded to FP32);
    a_k = (τ·f_k)·1000 in FP32 — product first, then ×1000; cos and sin from exact ops in FP64,
    rounded to FP32.
    """
    half = dim // 2
    expo = (-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=tau.device)) / half
    freqs = exp32(expo)  # [half]
    a = (tau.to(torch.float32)[:, None] * freqs[None, :]) * 1000.0  # [B, half]
    sin, cos = sincos64(a)
    return torch.cat([cos, sin], dim=-1).to(torch.float32)  # [B, dim]


class _TimestepMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tau, w1, b1, w2, b2, dt):
        phi = sinusoid(tau, w1.shape[1])  # [B,256]
        h1 = tiled_linear(phi, f32(w1), f32(b1))  # [B,d] fp32 pre-activation
        h = silu32(h1)  # [B,d]
        if any(ctx.needs_input_grad[1:5]):
            ctx.save_for_backward(w1, b1, w2, b2, phi, h1, h)
        return out(tiled_linear(h, f32(w2), f32(b2)), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        w1, b1, w2, b2, phi, h1, h = ctx.saved_tensors
        need = ctx.needs_input_grad
        first = need[1] or need[2]
        dh, dw2, db2 = linear_grads(g32(go), h, f32(w2), (first, need[3], need[4]))
        dw1 = db1 = None
        if first:
            # w1 (not None) so a LoRA-merged w1's gradient sink (training.ledger) is found
            _, dw1, db1 = linear_grads(dh * silu_grad32(h1), phi, w1, (False, need[1], need[2]))
        return (None, cast_like(dw1, w1), cast_like(db1, b1), cast_like(dw2, w2),
                cast_like(db2, b2), None)


@strict_cpu("timestep_embed_mlp", "w1", "b1", "w2", "b2", kernel="sincos_f64+" + LINEAR_KERNEL,
            constraints=(dtypes((torch.float32,), "tau"),))
def timestep_embed_mlp(tau, w1, b1, w2, b2):
    """temb = linear_2(SiLU(linear_1(φ(τ)))): tau [B] fp32 → [B,d] in the weights' dtype.

    Unlike diffusers (which rounds φ and τ to the model dtype), strict keeps FP32 throughout and
    casts once at the output (RFC cast policy).
    """
    return _TimestepMLP.apply(tau, w1, b1, w2, b2, act_dtype(b1, w1, b2, w2))  # b1: W (w1 may be LoRA-merged FP32)
