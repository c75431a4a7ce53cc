"""Strict CUDA backward of the GEMM-bearing operators (contract ``cuda1``): dX, dW, db, the
tanh-GELU epilogue and the LoRA factors, as ``torch.autograd.Function``s the operators of
``strict_cuda.linear`` run through (as the strict CPU operators do: ``drifttool.ops.strict.linear``).

    >>> dx = input_grad(dy, w, x.dtype)            # dY·W, row-invariant
    >>> dw = weight_grad(dy, x, w.dtype)           # per sample, then the pairwise tree over samples
    >>> db = bias_grad(dy, b.dtype)
    >>> da, db_ = lora_grads(d, a, b, scale)       # the backward of lora_merge

Orders (docs/strict-arithmetic.md, "Strict CUDA backward"; contract ids ``GRAD_CONTRACT``):

* dX = dY·W by the forward's GEMM (``kernels.gemm.linear(dy, wᵀ)``): N walked once in 64-chunks
  ascending per output tile, MMA-accumulated in FP32, one cast to x's dtype. A row's bytes depend
  on its own output gradient and W only.
* dW: per sample (``sample_rows``: the leading axis of dY; a sample's rows are its middle axes),
  over the sample's live rows (``live_rows``: trailing all-±0 gradient rows, prompt padding, are
  dropped) by ``kernels.gemm_backward.weight_grad_parts`` (64-row chunks ascending, MMA; the
  few-tile dW of a LoRA factor in 512-row segments whose partials are added in order); then
  the per-sample partials summed in batch order by the canonical pairwise tree
  (``TreeAccumulator``, = ``tree_sum_stack``). Invariance, as strict CPU's contract v2 gives: a
  sample's partial does not depend on its companions, its position, B, or trailing zero rows; so
  the batch's dW equals ``tree_sum_stack`` of the samples' batch-1 dW, and any split of the batch
  into aligned power-of-two micro-batches whose dW are combined by ``tree_sum_stack``. Other
  reorderings (or autograd adding micro-batches sequentially) change the bytes.
* db: per sample the sequential FP32 column sum over the live rows
  (``kernels.gemm_backward.bias_grad_parts``), then the pairwise tree over samples.
* ``mlp_up_gemm_gelu``: the FP32 pre-activation is recomputed by the forward's own GEMM (same
  kernel, same order: the forward's bytes); dpre = dy·GELU'(pre) (``gelu_tanh_f32_grad``), cast
  once to the activation dtype (the declared gradient boundary; bf16 in the model, so the two
  GEMMs that follow run on the tensor cores); then the GEMM backward of dpre.
* ``qkv_bias_gemm``: dX = (dq·Wq + dk·Wk) + dv·Wv (three FP32 GEMM outputs, two FP32 additions,
  one cast), as the CPU; dW, db per projection.
* unfused LoRA (``lora=`` of the four block GEMMs, forward act(pre + fp32(s)·(u·Bᵀ)), u = x·Aᵀ
  FP32, saved by the forward): dpre as above (dY, or for mlp_up dY·GELU'(pre) of the adapted
  FP32 pre-activation, recomputed by the forward's GEMMs and merge, cast to the activation dtype);
  dX_base = dpre·W (FP32 out, not cast), dW, db as above; then ``adapter_grads``: dt = fp32(s)·
  fp32(dpre) (one rounded product), du = dt·B (``linear(dt, Bᵀ)``, N walked once, FP32), dB =
  ``weight_grad(dt, u)``, dX_a = du·A (r walked once, FP32), dA = ``weight_grad(du, x)`` (each per
  sample over its live rows, then the tree: batch- and micro-batch-invariant as dW); dX =
  (dX_base + dX_a) in FP32, ONE cast to x's dtype; ``qkv_bias_gemm``: g_p = dX_base,p + dX_a,p
  per projection, dX = ((g_q + g_k) + g_v), one cast. The adapter adds no rounding to the
  activation dtype in dX; with B = 0, dX_a = +0 and dX is the plain operator's bytes.
* ``lora_merge`` (W' = fp32(W) + s·(B·A)): D = dL/dW' (FP32); D_s = fp32(s)·D (one rounded
  product, as the CPU's autograd of ``s * delta``); dB = D_s·Aᵀ (``linear(D_s, A)``, the in axis
  walked once); dA = Bᵀ·D_s (``linear(Bᵀ, D_sᵀ)``, the out axis walked once); FP32 operands in
  IEEE FP32; dW = D cast to W's dtype. Cast once to each factor's dtype.

The gradient ledger (``training.ledger``): a weight carrying its per-sample sink
(``ops.strict.grad.attach_grad_sink``) hands ``(dy, x)`` and ``sample_weight_grads`` to the sink
and returns no dW to autograd; the ledger's atoms are then these per-sample partials (grad.cuda1).
Not supported (fail closed, one line): double backward. Layouts: no reduction axis of the backward is split across ranks, so TP/SP
training is not reproducible under ``cuda1`` (dX of a column-parallel GEMM and dW of an SP row
shard would sum across ranks).
"""

from __future__ import annotations

import torch

from drifttool.ops.strict.grad import grad_sink, sample_rows
from drifttool.ops.strict_math import TreeAccumulator

GRAD_CONTRACT_VERSION = "grad.cuda1"
"""Version of the strict CUDA backward's orders; bump when any gradient byte changes."""

TRAINABLE = ("latent_proj_gemm", "qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu",
             "mlp_down_gemm", "lora_merge", "qk_rmsnorm", "txt_in_rmsnorm_linear", "adaln_modulation",
             "adaln_gate_residual", "multi_axis_rope", "final_adaln_out", "joint_attention_fused",
             "cfg_combine_renorm", "flow_sde_step_logp")
"""The strict CUDA operators with a backward (the rest are forward only): the GEMMs here, the row
operators in ``strict_cuda.row_backward``, the fused attention in ``strict_cuda.attention_backward``,
the sampler's in ``strict_cuda.sampler``."""


def grad_contract_id(op: str) -> str:
    """``qwenimage.<op>.grad.cuda1`` (``drifttool.lora_merge.grad.cuda1``): the backward's contract."""
    return f"{'drifttool' if op == 'lora_merge' else 'qwenimage'}.{op}.{GRAD_CONTRACT_VERSION}"


def _gemm():
    from drifttool.ops.strict_cuda.kernels import gemm  # lazy: Triton only when a call runs

    return gemm


def _narrow():
    from drifttool.ops.strict_cuda.kernels import narrow  # lazy: Triton only when a call runs

    return narrow


def _bwd():
    from drifttool.ops.strict_cuda.kernels import gemm_backward  # lazy: Triton only when a call runs

    return gemm_backward


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


# ----------------------------------------------------------------------------- gradients


def live_counts(dy3: torch.Tensor) -> torch.Tensor:
    """[B] int64 on dy3's device: per sample of ``dy3 [B, R, N]`` the rows up to and including the
    last with an element that is not ±0 (NaN counts), as ``ops.strict.grad.live_rows`` (no sync)."""
    nz = (dy3 != 0).any(dim=2)  # [B, R]
    idx = torch.arange(1, dy3.shape[1] + 1, device=dy3.device, dtype=torch.int64)
    return (nz.to(torch.int64) * idx).amax(dim=1) if dy3.shape[1] else nz.new_zeros(dy3.shape[0], dtype=torch.int64)


def sample_weight_grads(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The per-sample partials of ``weight_grad``: ``[B, N, K]`` FP32, sample b's over its live
    rows only (the atoms whose bytes do not depend on batch composition)."""
    dy3, x3 = sample_rows(dy), sample_rows(x)
    return _bwd().weight_grad_parts(dy3, x3, live_counts(dy3))


PARTIALS_BYTES = 1 << 31
"""At most this many bytes of per-sample FP32 partials are held at once by ``weight_grad``: the
samples are reduced in groups (a partial's bytes do not depend on its group; the tree adds them
one by one in batch order), so a 2-D input of many one-row samples does not need B·N·K floats."""


def _tree(parts: torch.Tensor) -> torch.Tensor:
    acc = TreeAccumulator()
    for p in parts:
        acc.add(p)
    return acc.result()


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = Σ_samples Σ_live rows dy ⊗ x for ``y = x·Wᵀ``: dy [B, ..., N], x [B, ..., K] →
    [N, K] FP32 (module docstring: per sample, then the pairwise tree in batch order)."""
    dy3, x3 = sample_rows(dy), sample_rows(x)
    live = live_counts(dy3)
    group = max(1, PARTIALS_BYTES // max(1, 4 * dy3.shape[2] * x3.shape[2]))
    acc = TreeAccumulator()
    for lo in range(0, dy3.shape[0], group):
        for p in _bwd().weight_grad_parts(dy3[lo:lo + group], x3[lo:lo + group], live[lo:lo + group]):
            acc.add(p)
    return acc.result()


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """db: dy [B, ..., N] → [N] FP32 (per sample sequential over live rows, then the tree)."""
    dy3 = sample_rows(dy)
    return _tree(_bwd().bias_grad_parts(dy3, live_counts(dy3)))


def input_grad(dy: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dX = dY·W: dy [..., N], w [N, K] → [..., K] in ``out_dtype`` (the forward GEMM over N)."""
    return _gemm().linear(dy, w.t(), None, out_dtype=out_dtype)


def _param_grad(dy, x, w):
    """dw = ``weight_grad(dy, x)`` cast to w's dtype; or, for a weight carrying the gradient
    ledger's sink (``ops.strict.grad.attach_grad_sink``), None, ``(dy, x)`` going to the sink with
    this family's ``sample_weight_grads`` as its partials."""
    sink = grad_sink(w)
    if sink is None:
        return _cast(weight_grad(dy, x), w)
    sink(dy, x, partials=sample_weight_grads)
    return None


def linear_grads(dy, x, w, b, needs, dx_dtype=None):
    """(dx, dw, db) of ``y = x·wᵀ + b``, each cast once to its input's dtype (dx to ``dx_dtype``
    when given), None where not needed; dw by ``_param_grad`` (the ledger's sink)."""
    dx = input_grad(dy, w, dx_dtype or x.dtype) if needs[0] else None
    dw = _param_grad(dy, x, w) if needs[1] else None
    db = _cast(bias_grad(dy), b) if needs[2] and b is not None else None
    return dx, dw, db


def adapter_grads(dpre, x, u, a, bl, scale, needs):
    """(dx_a, dA, dB) of the unfused adapter branch fp32(s)·(u·Bᵀ), u = x·Aᵀ, for the gradient
    dpre of the pre-activation it is added to (module docstring, "unfused LoRA").

    Args:
        dpre: [..., N] (bf16 or FP32).  x: [..., K] the forward input.  u: [..., r] FP32.
        a: A [r, K] FP32.  bl: B [N, r] FP32.  scale: s.  needs: (dx, dA, dB).
    Returns:
        dx_a [..., K] FP32 (not cast: the caller adds it to the base dX first); dA, dB in the
        factors' dtypes; None where not needed (or where the ledger's sink took the weight's).
    """
    dt = dpre.to(torch.float32) * float(scale)  # the FP32 product; a Python scalar needs no host-to-device copy
    du = _narrow().linear(dt, bl.t()) if needs[0] or needs[1] else None  # [..., r], K (= N) in segments
    db_ = _param_grad(dt, u, bl) if needs[2] else None  # [N, r]
    dx_a = input_grad(du, a, torch.float32) if needs[0] else None  # [..., K]
    da = _param_grad(du, x, a) if needs[1] else None  # [r, K]
    return dx_a, da, db_


def lora_grads(d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, needs=(True, True)):
    """(dA, dB) of W' = fp32(W) + s·(B·A) for D = dL/dW' (module docstring).

    Args:
        d: [out, in] (cast to FP32).  a: [r, in].  b: [out, r].  scale: α / r.
    Returns:
        dA [r, in] in a's dtype, dB [out, r] in b's dtype (None where ``needs`` says so).
    """
    ds = d.to(torch.float32) * float(scale)
    lin = _gemm().linear
    da = lin(b.to(torch.float32).t(), ds.t(), None, out_dtype=a.dtype) if needs[0] else None
    db = lin(ds, a.to(torch.float32), None, out_dtype=b.dtype) if needs[1] else None
    return da, db


# ----------------------------------------------------------------------------- autograd


class Linear(torch.autograd.Function):
    """y = act(x·wᵀ + b) by the strict CUDA GEMM (``forward_fn``); backward as the module says.
    ``gelu`` marks mlp_up_gemm_gelu (its pre-activation is recomputed by ``pre_fn``)."""

    @staticmethod
    def forward(ctx, x, w, b, forward_fn, pre_fn):
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, w, b)
        ctx.pre_fn = pre_fn
        return forward_fn(x, w, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w, b = ctx.saved_tensors
        g = gy.contiguous()
        if ctx.pre_fn is not None:
            g = _bwd().gelu_tanh_f32_grad(g, ctx.pre_fn(x, w, b), gy.dtype)
        return (*linear_grads(g, x, w, b, ctx.needs_input_grad[:3]), None, None)


class QKV(torch.autograd.Function):
    """Three GEMMs of one x (``forward_fn`` returns the [B,S,H,Dh] triple); backward: dX =
    (dq·Wq + dk·Wk) + dv·Wv in FP32, one cast; dW, db per projection."""

    @staticmethod
    def forward(ctx, x, wq, bq, wk, bk, wv, bv, forward_fn):
        if any(ctx.needs_input_grad[:7]):
            ctx.save_for_backward(x, wq, bq, wk, bk, wv, bv)
        return forward_fn(x, wq, bq, wk, bk, wv, bv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk, gv):
        x, wq, bq, wk, bk, wv, bv = ctx.saved_tensors
        need = ctx.needs_input_grad
        ws, bs = (wq, wk, wv), (bq, bk, bv)
        gs = [g.contiguous().flatten(-2) for g in (gq, gk, gv)]  # 3 × [B,S,d] (unused: zeros)
        dx = None
        if need[0]:
            dq, dk, dv = (input_grad(g, w, torch.float32) for g, w in zip(gs, ws))
            dx = ((dq + dk) + dv).to(x.dtype)
        grads = []
        for i in range(3):
            _, dw, db = linear_grads(gs[i], x, ws[i], bs[i], (False, need[1 + 2 * i], need[2 + 2 * i]))
            grads += [dw, db]
        return (dx, *grads, None)


class AdaptedLinear(torch.autograd.Function):
    """y = act(pre + fp32(s)·(u·Bᵀ)), pre = x·Wᵀ + b, u = x·Aᵀ (``forward_fn`` returns (y, u));
    backward as the module says ("unfused LoRA"). ``pre_fn`` (mlp_up) recomputes the adapted FP32
    pre-activation from (x, W, b, u, B, s) for the GELU's derivative."""

    @staticmethod
    def forward(ctx, x, w, b, a, bl, scale, forward_fn, pre_fn):
        y, u = forward_fn(x, w, b, a, bl, scale)
        if any(ctx.needs_input_grad[:5]):
            ctx.save_for_backward(x, w, b, a, bl, u)
        ctx.scale, ctx.pre_fn = float(scale), pre_fn
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w, b, a, bl, u = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = gy.contiguous()
        if ctx.pre_fn is not None:
            g = _bwd().gelu_tanh_f32_grad(g, ctx.pre_fn(x, w, b, u, bl, ctx.scale), gy.dtype)
        dx, dw, db = linear_grads(g, x, w, b, need[:3], dx_dtype=torch.float32)
        dx_a, da, db_ = adapter_grads(g, x, u, a, bl, ctx.scale, (need[0], need[3], need[4]))
        return (dx + dx_a).to(x.dtype) if need[0] else None, dw, db, da, db_, None, None, None


class AdaptedQKV(torch.autograd.Function):
    """``qkv_bias_gemm`` with unfused adapters on some projections (factors None on the others;
    ``forward_fn`` returns ((q, k, v), (uq, uk, uv))). Backward: per projection p, g_p = dX_p +
    dX_a,p in FP32 (dX_a only where adapted); dX = (g_q + g_k) + g_v, one cast; dW, db, dA, dB
    per projection."""

    @staticmethod
    def forward(ctx, x, wq, bq, wk, bk, wv, bv, aq, bbq, ak, bbk, av, bbv, scales, forward_fn):
        outs, us = forward_fn(x, wq, bq, wk, bk, wv, bv, aq, bbq, ak, bbk, av, bbv, scales)
        if any(ctx.needs_input_grad[:13]):
            ctx.save_for_backward(x, wq, bq, wk, bk, wv, bv, aq, bbq, ak, bbk, av, bbv, *us)
        ctx.scales = scales
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk, gv):
        x, *t = ctx.saved_tensors
        need = ctx.needs_input_grad
        gs = [g.contiguous().flatten(-2) for g in (gq, gk, gv)]  # 3 × [B,S,d]
        dxs, base, factors = [], [], []
        for i in range(3):
            w, b, a, bl, u = t[2 * i], t[2 * i + 1], t[6 + 2 * i], t[7 + 2 * i], t[12 + i]
            dx, dw, db = linear_grads(gs[i], x, w, b, (need[0], need[1 + 2 * i], need[2 + 2 * i]),
                                      dx_dtype=torch.float32)
            base += [dw, db]
            if a is None:
                factors += [None, None]
            else:
                dx_a, da, db_ = adapter_grads(gs[i], x, u, a, bl, ctx.scales[i],
                                              (need[0], need[7 + 2 * i], need[8 + 2 * i]))
                dx = None if dx is None else dx + dx_a
                factors += [da, db_]
            dxs.append(dx)
        dx = ((dxs[0] + dxs[1]) + dxs[2]).to(x.dtype) if need[0] else None
        return (dx, *base, *factors, None, None)


class LoraMerge(torch.autograd.Function):
    """W' = ``forward_fn(w, a, b, scale)``; backward ``lora_grads`` (dW = D cast to W's dtype)."""

    @staticmethod
    def forward(ctx, w, a, b, scale, forward_fn):
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(w, a, b)
        ctx.scale = float(scale)
        return forward_fn(w, a, b, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d):
        w, a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        da, db = lora_grads(d, a, b, ctx.scale, (need[1], need[2]))
        return (d.to(w.dtype) if need[0] else None), da, db, None, None
