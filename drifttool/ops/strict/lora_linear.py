"""Strict block GEMMs with an unfused FP32 LoRA branch (LoRA mode ``unfused-fp32``).

    >>> y = mlp_down_gemm(h, w, b, lora=(A, B, s))    # pre = x·Wᵀ + b + fp32(s)·((x·Aᵀ)·Bᵀ)

What ``qkv_bias_gemm``, ``attn_out_bias_gemm``, ``mlp_up_gemm_gelu`` and ``mlp_down_gemm``
(``drifttool.ops.strict.linear``) run when they receive ``lora``: the base weight W stays in its
dtype (on the GPU a bf16 W runs on tensor cores) and the adapter branch is added, in FP32, to the
GEMM output before the epilogue (GELU, head split), as peft's ``Linear.forward`` adds it. The
arithmetic (docs/strict-arithmetic.md, "Unfused LoRA (strict)"), for one adapted projection with
A [r, K] FP32, B [N, r] FP32, s a python float::

    xf    = fp32(x)                                   # x [..., K], the activation dtype
    u     = tiled_linear(xf, A)                       # [..., r]   contract v2 over K
    t     = tiled_linear(u, B)                        # [..., N]   contract v2 over r
    delta = fp32(s) · t                               # one rounded FP32 product
    pre   = tiled_linear(xf, fp32(W), fp32(b)) + delta   # the base GEMM (bias inside), one FP32 add
    y     = cast(act(pre))                            # act: GELU_tanh (mlp_up) or none; one cast

Backward (``dpre`` = fp32(dy), times GELU'(pre) for ``mlp_up_gemm_gelu``; ``grad.linear_grads``)::

    dx_base, dW, db = linear_grads(dpre, xf, W)       # as without the adapter (W frozen: no dW)
    dt        = fp32(s) · dpre                        # one rounded product
    du, dB    = linear_grads(dt, u, B)                # du over N (contract v2); dB per sample
    dx_a, dA  = linear_grads(du, xf, A)               # dx_a over r; dA per sample
    dx        = cast(dx_base + dx_a)                  # one FP32 add, ONE cast to x's dtype

``qkv_bias_gemm``: per projection p, g_p = dx_base_p + dx_a_p in FP32 (a projection without an
adapter: g_p = dx_base_p), dx = cast((g_q + g_k) + g_v). dA and dB, like dW, are reduced over each
sample's live rows by contract v2 and then over the samples by the pairwise tree (or handed to a
gradient sink: ``grad.weight_grad_or_sink``, the ledger of ``training.ledger``), so they are
batch-, micro-batch- and checkpointing-invariant; the adapter never adds a bf16 rounding to dx.
u (``[..., r]`` FP32) is kept for the backward. With B = 0 (peft's init) y and dx are the bytes
of the operator without ``lora`` (a ±0 branch leaves every sum unchanged, except that it turns a
base output of exactly −0 into +0).
"""

from __future__ import annotations

import torch

from drifttool.ops.strict._checks import f32, out
from drifttool.ops.strict.grad import cast_like, g32, gelu_tanh_grad32, linear_grads
from drifttool.ops.strict_gemm import tiled_linear
from drifttool.ops.strict_math import gelu_tanh32


def _s32(s: float, like: torch.Tensor) -> torch.Tensor:
    """The scale rounded once to FP32 (a 0-dim tensor on ``like``'s device)."""
    return torch.tensor(float(s), dtype=torch.float32, device=like.device)


def branch(xf: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(u ``[..., r]``, delta ``[..., N]``) of the adapter for xf ``[..., K]`` FP32: u = xf·Aᵀ,
    delta = fp32(s)·(u·Bᵀ), both GEMMs ``tiled_linear`` (contract v2), FP32."""
    u = tiled_linear(xf, a)  # [..., r]
    return u, _s32(s, xf) * tiled_linear(u, b)  # [..., N]


def branch_grads(dpre: torch.Tensor, xf: torch.Tensor, u: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 s: float, needs: tuple[bool, bool, bool]):
    """(dx_a, dA, dB) in FP32 of the branch for the FP32 pre-activation gradient ``dpre``
    ``[..., N]``, each only where ``needs`` = (x, A, B) asks (else None)."""
    need_x, need_a, need_b = needs
    if not any(needs):
        return None, None, None
    dt = _s32(s, dpre) * dpre  # [..., N]
    du, db, _ = linear_grads(dt, u, b, (need_x or need_a, need_b, False))  # [..., r], [N, r]
    if not (need_x or need_a):
        return None, None, db
    dxa, da, _ = linear_grads(du, xf, a, (need_x, need_a, False))  # [..., K], [r, K]
    return dxa, da, db


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if b is None else b if a is None else a + b


class AdaptedLinear(torch.autograd.Function):
    """act(x·Wᵀ + b + fp32(s)·((x·Aᵀ)·Bᵀ)), one cast; act GELU_tanh when ``gelu`` (module
    docstring)."""

    @staticmethod
    def forward(ctx, x, w, b, a, bb, s, dt, gelu):
        xf = f32(x)
        u, delta = branch(xf, a, bb, s)
        pre = tiled_linear(xf, f32(w), f32(b)) + delta  # [..., N] fp32
        ctx.s, ctx.gelu = s, gelu
        if any(ctx.needs_input_grad[:5]):
            ctx.save_for_backward(x, w, b, a, bb, u, pre if gelu else None)
        return out(gelu_tanh32(pre) if gelu else pre, dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w, b, a, bb, u, pre = ctx.saved_tensors
        need = ctx.needs_input_grad
        dpre = g32(gy) * gelu_tanh_grad32(pre) if ctx.gelu else g32(gy)
        xf = f32(x)
        dx, dw, db = linear_grads(dpre, xf, f32(w), need[:3])
        dxa, da, dbb = branch_grads(dpre, xf, u, a, bb, ctx.s, (need[0], need[3], need[4]))
        return (cast_like(_sum(dx, dxa), x), cast_like(dw, w), cast_like(db, b), cast_like(da, a),
                cast_like(dbb, bb), None, None, None)


_NO_FACTORS = (None, None, 1.0)


class AdaptedQKV(torch.autograd.Function):
    """Q, K, V of one input, each projection with its own branch or none (module docstring)."""

    @staticmethod
    def forward(ctx, x, wq, bq, wk, bk, wv, bv, aq, bq_, ak, bk_, av, bv_, scales, heads, dt):
        xf = f32(x)
        outs, us = [], []
        for w, b, a, bb, s in zip((wq, wk, wv), (bq, bk, bv), (aq, ak, av), (bq_, bk_, bv_), scales):
            pre = tiled_linear(xf, f32(w), f32(b))  # [B,S,d] fp32
            u = None
            if a is not None:
                u, delta = branch(xf, a, bb, s)
                pre = pre + delta
            us.append(u)
            outs.append(out(pre, dt).unflatten(-1, (heads, -1)))  # [B,S,H,Dh]
        ctx.scales = scales
        ctx.has_u = [u is not None for u in us]
        if any(ctx.needs_input_grad[:13]):
            ctx.save_for_backward(x, wq, bq, wk, bk, wv, bv, aq, bq_, ak, bk_, av, bv_,
                                  *(u for u in us if u is not None))
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk, gv):
        x, wq, bq, wk, bk, wv, bv, aq, bq_, ak, bk_, av, bv_, *saved_u = ctx.saved_tensors
        need = ctx.needs_input_grad
        xf = f32(x)
        it = iter(saved_u)
        us = [next(it) if h else None for h in ctx.has_u]
        gx, base_grads, lora_grads = [], [], []
        for i, (g, w, b, a, bb) in enumerate(zip((gq, gk, gv), (wq, wk, wv), (bq, bk, bv), (aq, ak, av),
                                                 (bq_, bk_, bv_))):
            dpre = g32(g).flatten(-2)  # [B,S,d]
            dx, dw, db = linear_grads(dpre, xf, f32(w), (need[0], need[1 + 2 * i], need[2 + 2 * i]))
            base_grads += [cast_like(dw, w), cast_like(db, b)]
            if a is None:
                gx.append(dx)
                lora_grads += [None, None]
                continue
            dxa, da, dbb = branch_grads(dpre, xf, us[i], a, bb, ctx.scales[i],
                                        (need[0], need[7 + 2 * i], need[8 + 2 * i]))
            gx.append(_sum(dx, dxa))  # g_p, FP32
            lora_grads += [cast_like(da, a), cast_like(dbb, bb)]
        dx = cast_like((gx[0] + gx[1]) + gx[2], x) if need[0] else None
        return (dx, *base_grads, *lora_grads, None, None, None)


def adapted_qkv(x, wq, bq, wk, bk, wv, bv, lora, heads: int, dt):
    """``AdaptedQKV`` for ``lora`` = (q, k, v) entries, each (A, B, s) or None."""
    fq, fk, fv = (f or _NO_FACTORS for f in lora)
    return AdaptedQKV.apply(x, wq, bq, wk, bk, wv, bv, fq[0], fq[1], fk[0], fk[1], fv[0], fv[1],
                            (fq[2], fk[2], fv[2]), heads, dt)
