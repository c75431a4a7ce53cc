"""Strict CUDA backward of the row operators (contract ``qwenimage.<op>.grad.cuda1``):
``qk_rmsnorm``, ``txt_in_rmsnorm_linear``, ``adaln_modulation``, ``adaln_gate_residual``,
``multi_axis_rope`` and ``final_adaln_out``, as ``torch.autograd.Function``s the operators of ``strict_cuda.rows`` run
through; their forward is the code there unchanged.

    >>> dx, dgain = rms_gain_grads(go, x, gain, eps, needs)   # qk_rmsnorm, txt_in's norm
    >>> dshift = sample_row_sums(go)                          # [B, d] FP32, contract v2 rows

Gradients and orders (kernels in ``kernels.rows_backward``; docs/strict-arithmetic.md, "Strict
CUDA backward"), each the strict CPU backward's formula in its order, FP32, cast once to the
input's dtype:

* ``qk_rmsnorm``: dx = rstd·(g − xhat·(tree(g·xhat) ÷ Dh)), g = go·gain, the statistics
  recomputed by the forward's tree; dgain = Σ over samples (pairwise tree, batch order:
  ``TreeAccumulator``) of each sample's contract-v2 row sum of go·xhat over its live rows
  (rows = the sample's (position, head) pairs, row-major). Byte-equal to the CPU's.
* ``txt_in_rmsnorm_linear``: the GEMM's backward (``backward.linear_grads``: dX = dY·W by the
  strict CUDA GEMM, dW and db per sample then the tree) on the norm's FP32 output, recomputed by
  the forward's kernel; then the RMSNorm backward above with go = that FP32 dX. The GEMM's N
  order (cuda1) differs from the CPU's (contract v2), so de and dgain differ from the CPU's by
  what the GEMM's bytes differ; given the same dX they are the CPU's bytes.
* ``adaln_modulation``: g = go·(1 + scale); dx = rstd·((g − tree(g) ÷ d) − xhat·(tree(g·xhat) ÷ d));
  dshift = row sum of go, dscale = row sum of go·xhat, per sample (contract v2 over its live
  rows; they are per-sample inputs: no sum over samples). Byte-equal to the CPU's.
* ``final_adaln_out``: emb = SiLU(temb)·wᵀ + b = [scale | shift] (FP32 [B, 2d], saved from the
  forward); dx as ``adaln_modulation`` with that scale; demb = [dscale | dshift] per sample
  (contract-v2 row sums, as above); then the projection's dw, db by the GEMM backward
  (``backward.linear_grads``) of demb against SiLU(temb) (recomputed by the forward's kernel):
  one row per sample, the per-sample partials summed by the pairwise tree. temb's own gradient
  is not computed (the operator's constraint refuses a temb that requires one). Given the same
  emb, the CPU's bytes; the GEMM's K order (cuda1) makes emb itself differ from the CPU's.
* ``adaln_gate_residual``: dx = go; dy = go·gate; dgate = row sum of go·y per sample. Byte-equal.
* ``multi_axis_rope``: the inverse rotation (dx0 = g0·c + g1·s, dx1 = g1·c − g0·s). Byte-equal.

Live rows (``ops.strict.grad.live_rows``): of what each row sum adds (go, or the product), so
trailing all-±0 rows — prompt padding — are dropped and a padded sample's sums are the unpadded
one's bytes. A sample's partial depends on its own rows only: batch-, position- and
padding-invariant. Not supported: double backward; a gain carrying the gradient ledger's sink.
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict.grad import sample_rows
from drifttool.ops.strict_cuda import backward as bwd
from drifttool.ops.strict_math import TreeAccumulator

def _k():
    from drifttool.ops.strict_cuda.kernels import rows_backward  # lazy: Triton only when a call runs

    return rows_backward


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


def live_product_counts(a3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """[B] int64: per sample the rows up to the last where the FP32 product a3·b3 has an element
    that is not ±0 (``live_counts`` of the product the row sum adds; no host sync)."""
    return bwd.live_counts(a3.to(torch.float32) * b3.to(torch.float32))


def sample_row_sums(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample contract-v2 row sums of ``a`` (or of ``a·b``): ``[B, ..., C]`` → ``[B, C]`` FP32
    (the CPU's ``grad.row_sum``), over each sample's live rows of what is summed."""
    a3 = sample_rows(a.contiguous())
    b3 = None if b is None else sample_rows(b.contiguous())
    live = bwd.live_counts(a3) if b3 is None else live_product_counts(a3, b3)
    return _k().row_sums(a3, b3, live)


def _over_samples(parts: torch.Tensor) -> torch.Tensor:
    acc = TreeAccumulator()
    for p in parts:
        acc.add(p)
    return acc.result()


def rms_gain_grads(go, x, gain, eps, needs):
    """(dx, dgain) of xhat·gain (module docstring), each cast once to its input's dtype."""
    if not any(needs):
        return None, None
    dx, xhat = _k().norm_grads(x, go, eps, gain=gain, dx_dtype=x.dtype if needs[0] else None,
                               want_xhat=needs[1])
    dgain = _cast(_over_samples(sample_row_sums(go, xhat)), gain) if needs[1] else None
    return dx, dgain


class QKNorm(torch.autograd.Function):
    """y = ``forward_fn(x, gain, eps)``; backward ``rms_gain_grads``."""

    @staticmethod
    def forward(ctx, x, gain, eps, forward_fn):
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x, gain)
        ctx.eps = float(eps)
        return forward_fn(x, gain, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, gain = ctx.saved_tensors
        return (*rms_gain_grads(go, x, gain, ctx.eps, ctx.needs_input_grad[:2]), None, None)


class TxtIn(torch.autograd.Function):
    """txt_in(RMSNorm(e)) = ``forward_fn(e, gain, w, b, eps)``; ``norm_fn(e, gain, eps)`` is the
    forward's FP32 norm output (recomputed in the backward)."""

    @staticmethod
    def forward(ctx, e, gain, w, b, eps, forward_fn, norm_fn):
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(e, gain, w, b)
        ctx.eps, ctx.norm_fn = float(eps), norm_fn
        return forward_fn(e, gain, w, b, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        e, gain, w, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        norm_needed = need[0] or need[1]
        y = ctx.norm_fn(e, gain, ctx.eps)  # [B, L, Dj] FP32: the forward's bytes
        dy, dw, db = bwd.linear_grads(go.contiguous(), y, w, b, (norm_needed, need[2], need[3]))
        de, dgain = rms_gain_grads(dy, e, gain, ctx.eps, need[:2]) if norm_needed else (None, None)
        return de, dgain, dw, db, None, None, None


class Modulation(torch.autograd.Function):
    """y = LN(x)·(1 + scale) + shift = ``forward_fn(x, shift, scale, eps)`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, shift, scale, eps, forward_fn):
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, shift, scale)
        ctx.eps = float(eps)
        return forward_fn(x, shift, scale, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, shift, scale = ctx.saved_tensors
        need = ctx.needs_input_grad
        if x.dim() != 3 or tuple(shift.shape) != (x.shape[0], x.shape[2]):
            raise UnsupportedConfigError(f"strict CUDA adaln_modulation backward: x {tuple(x.shape)}, shift "
                                         f"{tuple(shift.shape)}; one [B, d] row per sample needed")
        dx = xhat = None
        if need[0] or need[2]:
            dx, xhat = _k().norm_grads(x, go, ctx.eps, scale=scale, dx_dtype=x.dtype if need[0] else None,
                                       want_xhat=need[2])
        dshift = _cast(sample_row_sums(go), shift) if need[1] else None
        dscale = _cast(sample_row_sums(go, xhat), scale) if need[2] else None
        return dx, dshift, dscale, None, None


class FinalAdaLN(torch.autograd.Function):
    """norm_out: emb = ``emb_fn(temb, w, b)`` [B, 2d] FP32 (scale, shift), y = ``mod_fn(x, emb, eps,
    dt)``; ``silu_fn(temb)`` is the forward's FP32 SiLU (recomputed in the backward)."""

    @staticmethod
    def forward(ctx, x, temb, w, b, eps, dt, emb_fn, mod_fn, silu_fn):
        emb = emb_fn(temb, w, b)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(x, temb, w, b, emb)
        ctx.eps, ctx.silu_fn = float(eps), silu_fn
        return mod_fn(x, emb, eps, dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, temb, w, b, emb = ctx.saved_tensors
        need = ctx.needs_input_grad
        if need[1]:  # the operator's constraint refuses this in the forward
            raise UnsupportedConfigError("strict CUDA final_adaln_out backward: no gradient to temb")
        want_emb = need[2] or need[3]
        d = emb.shape[-1] // 2
        dx = xhat = None
        if need[0] or want_emb:
            dx, xhat = _k().norm_grads(x, go, ctx.eps, scale=emb[:, :d].contiguous(),
                                       dx_dtype=x.dtype if need[0] else None, want_xhat=want_emb)
        dw = db = None
        if want_emb:
            demb = torch.cat([sample_row_sums(go, xhat), sample_row_sums(go)], dim=-1)  # [B, 2d] FP32
            _, dw, db = bwd.linear_grads(demb, ctx.silu_fn(temb), w, b, (False, need[2], need[3]))
        return dx, None, dw, db, None, None, None, None, None


class GateResidual(torch.autograd.Function):
    """x + gate·y = ``forward_fn(x, gate, y)``; dx = go, dy = go·gate, dgate = row sum of go·y."""

    @staticmethod
    def forward(ctx, x, gate, y, forward_fn):
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(gate, y)
        ctx.x_dtype = x.dtype
        return forward_fn(x, gate, y)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        gate, y = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = go.to(torch.float32).to(ctx.x_dtype) if need[0] else None
        dgate = _cast(sample_row_sums(go, y), gate) if need[1] else None
        dy = _k().gate_grad(go, gate, y.dtype) if need[2] else None
        return dx, dgate, dy, None


class Rope(torch.autograd.Function):
    """The interleaved-pair rotation ``forward_fn(x, freqs)``; dx the inverse rotation of go."""

    @staticmethod
    def forward(ctx, x, freqs, forward_fn):
        ctx.save_for_backward(freqs)
        ctx.x_dtype = x.dtype
        return forward_fn(x, freqs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        (freqs,) = ctx.saved_tensors
        dx = _k().rope_grad(go, freqs, ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None
