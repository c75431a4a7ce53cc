"""Strict CUDA sampler operators: cfg_combine_renorm, flow_sde_step_logp (contract ``cuda1``;
Triton kernels in ``kernels/sampler.py``). ``flow_sigma_table`` takes no tensors: it runs on the
CPU in every run (``setting_checks.device_operators`` leaves it out of the CUDA set).

Both do the strict CPU family's arithmetic (``drifttool.ops.scheduler``) in its order — the per-token
norms and the per-sample log-probability sum by the same pairwise tree, square roots in FP64
rounded once, elementwise steps one FP32 operation each without FMA — so the bytes equal the
CPU's. The SDE step's per-sample constants (Δ, std_t, a, c, s_t, ln s_t, ...) are computed on the
CPU by ``scheduler.sde_constants``, the CPU family's own code, then moved to the device.

Sigma scalars may arrive as Python floats, 0-dim or [B] tensors on any device.

Backward (contract ``qwenimage.<op>.grad.cuda1``): the strict CPU family's own formulas
(``scheduler.cfg.renorm_grads``, ``scheduler.sde.sde_step_grads`` / ``euler_step_grads``), run on
the GPU as plain torch FP32 operations — each one IEEE operation, correctly rounded, in its own
kernel (no FMA contraction across them), the channel sums by the same pairwise tree, square roots
in FP64 rounded once — so the gradients are strict CPU's bytes. What they need is recomputed or
saved: the renorm's norms by ``renorm_parts`` from the inputs; the SDE step's constants (the
forward's device copy) and d = x_next − mu from the forward's outputs. Only mu and logp carry
gradients (x_next and std_t do not), as on the CPU.
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import require_dtype
from drifttool.ops.scheduler.cfg import check_cfg_inputs, renorm_grads, renorm_parts
from drifttool.ops.scheduler.sde import (MAX_LOGP_ELEMENTS, euler_step_grads, prepare_sde, rule_is,
                                         sde_constants, sde_step_grads, to_device)
from drifttool.ops.specs import OPERATORS
from drifttool.ops.strict_cuda._register import strict_cuda


def _kernels():
    """The Triton kernels module (imports Triton)."""
    from drifttool.ops.strict_cuda.kernels import sampler  # lazy: Triton is imported when a kernel runs
    return sampler


class _CFGRenorm(torch.autograd.Function):
    """The Triton combine + renorm; backward ``renorm_grads`` on ``renorm_parts`` recomputed."""

    @staticmethod
    def forward(ctx, v_cond, v_uncond, scale):
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(v_cond, v_uncond)
        ctx.scale = scale
        return _kernels().cfg_combine_renorm(v_cond, v_uncond, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gv):
        v_cond, v_uncond = ctx.saved_tensors
        dc, du = renorm_grads(gv, *renorm_parts(v_cond, v_uncond, ctx.scale))
        return dc.to(v_cond.dtype), du.to(v_uncond.dtype), None


class _SDEStep(torch.autograd.Function):
    """The Triton SDE step (η > 0) → (x_next, logp, mu); backward ``sde_step_grads``. ``coef`` [B, 7]
    and ``count`` [1] are the forward's device constants (a, c, Δ, s_t, ...)."""

    @staticmethod
    def forward(ctx, v32, x32, coef, count, noise, prev_sample):
        x_next, logp, mu = _kernels().sde_step(x32, v32, noise, prev_sample, coef, count)
        ctx.mark_non_differentiable(x_next)
        ctx.save_for_backward(coef, count, x_next, mu)
        return x_next, logp, mu

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_next, g_logp, g_mu):
        coef, count, x_next, mu = ctx.saved_tensors
        a, c, dt, scale = coef.unbind(1)[:4]
        dv, dx = sde_step_grads(g_mu, g_logp, dt, a, c, scale, x_next - mu, count)
        return dv, dx, None, None, None, None


class _Euler(torch.autograd.Function):
    """The Triton Euler step mu = x + Δ·v (η = 0); backward ``euler_step_grads``."""

    @staticmethod
    def forward(ctx, v32, x32, dt):
        ctx.save_for_backward(dt)
        return _kernels().euler(x32, v32, dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_mu):
        (dt,) = ctx.saved_tensors
        return (*euler_step_grads(g_mu, dt), None)


@strict_cuda("cfg_combine_renorm", "v_cond", "v_uncond", kernel="triton.cfg_renorm.pairtree", trainable=True)
def cfg_combine_renorm(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """comb = u + s·(c − u); v = comb·(‖c‖/‖comb‖), norms per token over the channel axis:
    v_cond, v_uncond [B,N,C] (FP32/BF16) → [B,N,C] FP32 (``scheduler.cfg_combine_renorm_strict``).

    Raises:
        ValueError: shape mismatch, empty channel axis, non-finite or tensor scale.
    """
    check_cfg_inputs(v_cond, v_uncond, scale)
    for what, t in (("v_cond", v_cond), ("v_uncond", v_uncond)):
        require_dtype("cfg_combine_renorm", what, t, OPERATORS["cfg_combine_renorm"].dtypes)
    return _CFGRenorm.apply(v_cond, v_uncond, float(scale))


@strict_cuda("flow_sde_step_logp", "v", "x", "prev_sample", kernel="triton.flowgrpo_sde.pairtree_mean",
             constraints=(rule_is("sde"),), trainable=True)
def flow_sde_step_logp(v, x, sigma, sigma_next, *, eta: float, sigma_max, noise=None, prev_sample=None,
                       rule: str = "sde"):
    """Flow-GRPO 'sde' step x_t → x_{t+1} and its log-probability, as
    ``scheduler.flow_sde_step_logp_strict`` (same arguments, returns, arithmetic and errors):
    ``(x_next [B,...], logp [B], mu [B,...], std_t [B])`` FP32; η = 0 is the FP32 Euler step with
    logp NaN and std_t 0.

    Raises:
        ValueError, UnsupportedConfigError: as the CPU family (shapes, σ order, dtypes, > 2^24
            elements per sample).
    """
    v32, x32, s, sn, sm, eta = prepare_sde(v, x, sigma, sigma_next, eta, sigma_max, noise, prev_sample,
                                            strict=True, host_schedule=True)  # [B] each, on the CPU
    per_sample = x32[0].numel()
    if per_sample > MAX_LOGP_ELEMENTS:
        raise UnsupportedConfigError(
            f"flow_sde_step_logp: {per_sample} elements per sample exceed 2^24 (strict count)")
    dev, bsz = x32.device, x32.shape[0]
    if eta == 0.0:
        mu = _Euler.apply(v32, x32, to_device(sn - s, dev))
        x_next = prev_sample.to(torch.float32) if prev_sample is not None else mu
        logp = torch.full((bsz,), math.nan, dtype=torch.float32, device=dev)
        return x_next.detach(), logp, mu, torch.zeros(bsz, dtype=torch.float32, device=dev)
    dt, std, a, c, scale, two_var, log_scale, log_sqrt_2pi = sde_constants(s, sn, sm, eta)
    coef = torch.stack([a, c, dt, scale, two_var, log_scale, log_sqrt_2pi.expand(bsz)], dim=1)  # [B, 7]
    count = torch.tensor([float(per_sample)], dtype=torch.float32)
    # one non-blocking transfer of the step's constants: coef [B, 7], std_t [B], count [1]
    packed = to_device(torch.cat([coef.reshape(-1), std, count]), dev)
    coef, std, count = packed[: 7 * bsz].view(bsz, 7), packed[7 * bsz: 8 * bsz], packed[8 * bsz:]
    x_next, logp, mu = _SDEStep.apply(v32, x32, coef, count, noise, prev_sample)
    return x_next, logp, mu, std
