"""Strict CUDA sampler operators: cfg_combine_renorm, flow_sde_step_logp (contract ``cuda1``;
Triton kernels in ``kernels/sampler.py``). ``flow_sigma_table`` takes no tensors: it runs on the
CPU in every run (``setting_checks.device_operators`` leaves it out of the CUDA set).

Both do the strict CPU family's arithmetic (``drifttool.ops.scheduler``) in its order — the per-token
norms and the per-sample log-probability sum by the same pairwise tree, square roots in FP64
rounded once, elementwise steps one FP32 operation each without FMA — so the bytes equal the
CPU's. The SDE step's per-sample constants (Δ, std_t, a, c, s_t, ln s_t, ...) are computed on the
CPU by ``scheduler.sde_constants``, the CPU family's own code, then moved to the device.

Sigma scalars may arrive as Python floats, 0-dim or [B] tensors on any device. Forward only.
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import require_dtype
from drifttool.ops.scheduler.cfg import check_cfg_inputs
from drifttool.ops.scheduler.sde import MAX_LOGP_ELEMENTS, prepare_sde, rule_is, sde_constants, to_device
from drifttool.ops.specs import OPERATORS
from drifttool.ops.strict_cuda._register import strict_cuda


def _kernels():
    """The Triton kernels module (imports Triton)."""
    from drifttool.ops.strict_cuda.kernels import sampler  # lazy: Triton is imported when a kernel runs
    return sampler


@strict_cuda("cfg_combine_renorm", "v_cond", "v_uncond", kernel="triton.cfg_renorm.pairtree")
def cfg_combine_renorm(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """comb = u + s·(c − u); v = comb·(‖c‖/‖comb‖), norms per token over the channel axis:
    v_cond, v_uncond [B,N,C] (FP32/BF16) → [B,N,C] FP32 (``scheduler.cfg_combine_renorm_strict``).

    Raises:
        ValueError: shape mismatch, empty channel axis, non-finite or tensor scale.
    """
    k = _kernels()
    check_cfg_inputs(v_cond, v_uncond, scale)
    for what, t in (("v_cond", v_cond), ("v_uncond", v_uncond)):
        require_dtype("cfg_combine_renorm", what, t, OPERATORS["cfg_combine_renorm"].dtypes)
    return k.cfg_combine_renorm(v_cond, v_uncond, float(scale))


@strict_cuda("flow_sde_step_logp", "v", "x", "prev_sample", kernel="triton.flowgrpo_sde.pairtree_mean",
             constraints=(rule_is("sde"),))
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
    k = _kernels()
    v32, x32, s, sn, sm, eta = prepare_sde(v, x, sigma, sigma_next, eta, sigma_max, noise, prev_sample,
                                            strict=True, host_schedule=True)  # [B] each, on the CPU
    per_sample = x32[0].numel()
    if per_sample > MAX_LOGP_ELEMENTS:
        raise UnsupportedConfigError(
            f"flow_sde_step_logp: {per_sample} elements per sample exceed 2^24 (strict count)")
    dev, bsz = x32.device, x32.shape[0]
    if eta == 0.0:
        mu = k.euler(x32, v32, to_device(sn - s, dev))
        x_next = prev_sample.to(torch.float32) if prev_sample is not None else mu
        logp = torch.full((bsz,), math.nan, dtype=torch.float32, device=dev)
        return x_next.detach(), logp, mu, torch.zeros(bsz, dtype=torch.float32, device=dev)
    dt, std, a, c, scale, two_var, log_scale, log_sqrt_2pi = sde_constants(s, sn, sm, eta)
    coef = torch.stack([a, c, dt, scale, two_var, log_scale, log_sqrt_2pi.expand(bsz)], dim=1)  # [B, 7]
    count = torch.tensor([float(per_sample)], dtype=torch.float32)
    # one non-blocking transfer of the step's constants: coef [B, 7], std_t [B], count [1]
    packed = to_device(torch.cat([coef.reshape(-1), std, count]), dev)
    coef, std, count = packed[: 7 * bsz].view(bsz, 7), packed[7 * bsz: 8 * bsz], packed[8 * bsz:]
    x_next, logp, mu = k.sde_step(x32, v32, noise, prev_sample, coef, count)
    return x_next, logp, mu, std
