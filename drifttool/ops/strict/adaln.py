"""Strict AdaLN operators: adaln_mod_projection, adaln_modulation, adaln_gate_residual,
final_adaln_out (numerics §2.3, §2 step 8).

LayerNorm order: mean = tree_mean(x); xc = x − mean; var = tree_mean(xc²) (biased);
rstd = 1/sqrt(var + eps) in FP64 rounded to FP32; y = xc·rstd; then y·(1 + scale) + shift in FP32.

Backward (``torch.autograd.Function``; FP32, every gradient cast once to its input's dtype):
g = dy·(1 + scale); dx = rstd·((g − Σg/d) − xhat·(Σ(g·xhat)/d)) with pairwise-tree sums over d;
dshift, dscale, dgate per sample over that sample's live tokens (ascending) in the contract-v2
row-block order (``grad.row_sum``: 64-row blocks, 8 segments by halving, depth-3 tree);
SiLU + Linear as in ``drifttool.ops.strict.linear`` with dtemb = ds·SiLU'(temb).
"""

from __future__ import annotations

import torch

from drifttool.ops.strict._checks import act_dtype, f32, out, strict_cpu
from drifttool.ops.strict.grad import (
    cast_like, g32, layer_norm_grad, linear_grads, row_sum, silu_grad32,
)
from drifttool.ops.strict_gemm import LINEAR_KERNEL, tiled_linear
from drifttool.ops.strict_math import rsqrt64, silu32, tree_mean

LN_KERNEL = "tree_layernorm"


def layer_norm_parts(xf: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(xhat, rstd) of the parameter-free LayerNorm over the last axis, FP32 (order in module doc)."""
    mean = tree_mean(xf)
    xc = xf - mean.unsqueeze(-1)
    var = tree_mean(xc * xc)
    rstd = rsqrt64(var.double() + eps).to(torch.float32)
    return xc * rstd.unsqueeze(-1), rstd


def layer_norm(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free LayerNorm over the last axis, FP32 in and out (order in module doc)."""
    return layer_norm_parts(xf, eps)[0]


def _silu_linear(temb, w, b) -> torch.Tensor:
    s = silu32(f32(temb))
    return tiled_linear(s, f32(w), f32(b))


def _silu_linear_grads(gemb, temb, w, needs):
    """(dtemb, dw, db) of SiLU(temb)·wᵀ + b given gemb FP32 [B, N]."""
    tf = f32(temb)
    ds, dw, db = linear_grads(gemb, silu32(tf), f32(w), (needs[0], needs[1], needs[2]))
    dtemb = ds * silu_grad32(tf) if needs[0] else None
    return dtemb, dw, db


class _ModProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, temb, w, b, dt):
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(temb, w, b)
        return out(_silu_linear(temb, w, b), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        temb, w, b = ctx.saved_tensors
        dtemb, dw, db = _silu_linear_grads(g32(gy), temb, w, ctx.needs_input_grad[:3])
        return cast_like(dtemb, temb), cast_like(dw, w), cast_like(db, b), None


@strict_cpu("adaln_mod_projection", "temb", "w", "b", kernel="silu_f64+" + LINEAR_KERNEL)
def adaln_mod_projection(temb, w, b):
    """img_mod / txt_mod: SiLU(temb)·wᵀ + b, temb [B,d] → [B,6d], chunks
    [shift1, scale1, gate1, shift2, scale2, gate2]."""
    dt = act_dtype(temb, w, b)
    return _ModProjection.apply(temb, w, b, dt)


def _modulate_grads(gy, xhat, rstd, scale1, needs):
    """(dx, dshift, dscale) of y = xhat·scale1 + shift, scale1 = 1 + scale (FP32 [B, d])."""
    dx = layer_norm_grad(gy * scale1.unsqueeze(1), xhat, rstd) if needs[0] else None
    dshift = row_sum(gy) if needs[1] else None
    dscale = row_sum(gy * xhat) if needs[2] else None
    return dx, dshift, dscale


class _Modulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, scale, eps, dt):
        xhat, rstd = layer_norm_parts(f32(x), eps)
        scale1 = 1.0 + f32(scale)
        y = xhat * scale1.unsqueeze(1) + f32(shift).unsqueeze(1)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, shift, scale, xhat, rstd, scale1)
        return out(y, dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, shift, scale, xhat, rstd, scale1 = ctx.saved_tensors
        dx, dshift, dscale = _modulate_grads(g32(gy), xhat, rstd, scale1, ctx.needs_input_grad[:3])
        return cast_like(dx, x), cast_like(dshift, shift), cast_like(dscale, scale), None, None


@strict_cpu("adaln_modulation", "x", "shift", "scale", kernel=LN_KERNEL)
def adaln_modulation(x, shift, scale, eps: float = 1e-6):
    """LN(x)·(1 + scale) + shift; x [B,S,d], shift/scale [B,d] → [B,S,d]."""
    dt = act_dtype(x, shift, scale)
    return _Modulation.apply(x, shift, scale, eps, dt)


class _GateResidual(torch.autograd.Function):
    """x + gate·y; backward dx = dout, dy = dout·gate, dgate per sample = Σ_tokens dout·y."""

    @staticmethod
    def forward(ctx, x, gate, y, dt):
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, gate, y)
        return out(f32(x) + f32(gate).unsqueeze(1) * f32(y), dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, gate, y = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = g32(go)
        dx = cast_like(g, x) if need[0] else None
        dgate = cast_like(row_sum(g * f32(y)), gate) if need[1] else None
        dy = cast_like(g * f32(gate).unsqueeze(1), y) if need[2] else None
        return dx, dgate, dy, None


@strict_cpu("adaln_gate_residual", "x", "gate", "y", kernel="elementwise")
def adaln_gate_residual(x, gate, y):
    """x + gate·y in FP32, one cast; x, y [B,S,d], gate [B,d]."""
    dt = act_dtype(x, gate, y)
    return _GateResidual.apply(x, gate, y, dt)


class _FinalAdaLN(torch.autograd.Function):
    """Backward: demb = [dscale | dshift] per sample (``grad.row_sum``), then the SiLU + Linear
    backward of the projection; dx as adaln_modulation."""

    @staticmethod
    def forward(ctx, x, temb, w, b, eps, dt):
        emb = _silu_linear(temb, w, b)  # [B,2d]
        scale, shift = emb.chunk(2, dim=-1)
        xhat, rstd = layer_norm_parts(f32(x), eps)
        scale1 = 1.0 + scale
        y = xhat * scale1.unsqueeze(1) + shift.unsqueeze(1)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(x, temb, w, b, xhat, rstd, scale1)
        return out(y, dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, temb, w, b, xhat, rstd, scale1 = ctx.saved_tensors
        need = ctx.needs_input_grad
        want_emb = any(need[1:4])
        dx, dshift, dscale = _modulate_grads(g32(gy), xhat, rstd, scale1, (need[0], want_emb, want_emb))
        dtemb = dw = db = None
        if want_emb:
            gemb = torch.cat([dscale, dshift], dim=-1)  # [B,2d], (scale, shift) order
            dtemb, dw, db = _silu_linear_grads(gemb, temb, w, need[1:4])
        return cast_like(dx, x), cast_like(dtemb, temb), cast_like(dw, w), cast_like(db, b), None, None


@strict_cpu("final_adaln_out", "x", "temb", "w", "b", kernel=LN_KERNEL + "+" + LINEAR_KERNEL)
def final_adaln_out(x, temb, w, b, eps: float = 1e-6):
    """norm_out: (scale, shift) = split(SiLU(temb)·wᵀ + b) — scale first (numerics trap 5);
    LN(x)·(1 + scale) + shift; x [B,N,d], temb [B,d] → [B,N,d]."""
    dt = act_dtype(x, temb, w, b)
    return _FinalAdaLN.apply(x, temb, w, b, eps, dt)
