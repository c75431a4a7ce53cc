"""The production ``flow_sde_step_logp`` kernels: Flow-GRPO's ``sde_step_with_logprob`` verbatim
(rules ``sde`` and ``flow_grpo``) and diffusers' ``FlowMatchEulerDiscreteScheduler.step`` (rule
``diffusers_euler``). The argument checks and the η = 0 Euler step are the strict family's
(``sde``).
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implements
from drifttool.ops.scheduler.sde import bcast, euler_step, prepare_sde, rule_is


@implements("flow_sde_step_logp", "production", device=("cpu", "cuda"),
            kernel="torch.native.flowgrpo_sde.mean", constraints=(rule_is("sde", "flow_grpo"),))
def flow_sde_step_logp_production(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    rule: str = "sde",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-GRPO's ``sde_step_with_logprob`` ('sde' branch) as written upstream (numerics §4).

    Same signature, meaning and outputs as ``flow_sde_step_logp_strict``; the expression is
    Flow-GRPO's on [B, 1, ..., 1]-shaped schedule tensors, ``torch.log`` for ln s and
    ln(sqrt(2·fp32(π))), and ``torch.mean`` over the non-batch dims for logp. ``x_next``, ``mu``
    and ``std_t`` are byte-equal to strict; ``logp`` agrees to the declared tolerance.
    The pinned ``noise`` replaces Flow-GRPO's global-RNG draw.

    ``rule="sde"`` (default): η = 0 is the FP32 Euler step (noise ignored), as strict.
    ``rule="flow_grpo"``: η = 0 runs the same expression as η > 0 (std_t = 0, so mu = x + Δσ·v
    and x_next = mu + 0·noise) and needs ``noise`` or ``prev_sample`` — Flow-GRPO's Qwen-Image
    rollout calls the step that way outside its SDE window (numerics §4.1); logp is then NaN
    (0/0), absent, as in Flow-GRPO where it is discarded.

    Raises:
        ValueError: as strict; ``rule="flow_grpo"`` without noise or prev_sample.
        UnsupportedConfigError: as strict (σ ordering, sigma_max).
    """
    v32, x32, s, sn, sm, eta = prepare_sde(
        v, x, sigma, sigma_next, eta, sigma_max, noise, prev_sample, strict=False
    )
    if eta == 0.0 and rule == "sde":
        return euler_step(v32, x32, s, sn, prev_sample)
    if noise is None and prev_sample is None:
        raise ValueError("flow_sde_step_logp: rule 'flow_grpo' draws its step noise at every step: "
                         "give noise (sampling) or prev_sample (replay)")
    nd = x32.dim()
    sigma_b = bcast(s, nd)
    sigma_prev = bcast(sn, nd)
    sigma_max_b = bcast(sm, nd)
    dt = sigma_prev - sigma_b
    eta32 = torch.tensor(eta, dtype=torch.float32, device=x32.device)
    std_dev_t = torch.sqrt(sigma_b / (1 - torch.where(sigma_b == 1, sigma_max_b, sigma_b))) * eta32
    mu = x32 * (1 + std_dev_t**2 / (2 * sigma_b) * dt) + v32 * (
        1 + std_dev_t**2 * (1 - sigma_b) / (2 * sigma_b)
    ) * dt
    if prev_sample is None:
        x_next = mu + std_dev_t * torch.sqrt(-1 * dt) * noise
    else:
        x_next = prev_sample.to(torch.float32)
    x_next = x_next.detach()
    elem = (
        -((x_next - mu) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=torch.float32)))
    )
    logp = elem.mean(dim=tuple(range(1, nd)))
    return x_next, logp, mu, std_dev_t.reshape(-1)


def _sigma_scalar(value: float | torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """A sigma as a 0-dim fp32 tensor on ``device`` (the scheduler's own sigmas live on the
    execution device); a [B] tensor must hold one value."""
    t = value.detach().to(torch.float32) if isinstance(value, torch.Tensor) \
        else torch.tensor(float(value), dtype=torch.float32)
    if t.dim() > 0:
        flat = t.reshape(-1)
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            raise UnsupportedConfigError(
                f"flow_sde_step_logp (diffusers_euler): {what} must be one value for the batch "
                f"(diffusers' scheduler steps every row with one sigma), got {t.tolist()}")
        t = flat[0]
    return t.reshape(()).to(device)


@implements("flow_sde_step_logp", "production", device=("cpu", "cuda"),
            kernel="torch.native.diffusers_scheduler_step", constraints=(rule_is("diffusers_euler"),))
def flow_euler_step_diffusers(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    rule: str = "diffusers_euler",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``FlowMatchEulerDiscreteScheduler.step`` (deterministic, numerics §3.4) as the
    ``diffusers_euler`` rule of ``flow_sde_step_logp`` (production family).

    Args:
        v: [B, N, C] velocity in the model dtype (bf16 in a bf16 pipeline; the CFG-combined one).
        x: [B, N, C] latents x_t (the pipeline keeps them in the model dtype).
        sigma, sigma_next: σ_i and σ_{i+1}: python floats, 0-dim tensors or [B] tensors holding
            one value; used as 0-dim fp32 tensors on the latents' device, as the scheduler's.
        eta: must be 0 (the pipeline's step is deterministic). sigma_max: unused.
        noise: must be None. prev_sample: the stored next latent (replay), returned as x_next.

    Returns:
        ``(x_next, logp, mu, std_t)``: mu [B, N, C] fp32 = fp32(x) + Δσ·v (the scheduler's
        ``prev_sample`` before its cast), x_next = mu.to(v.dtype) [B, N, C] (or
        ``prev_sample``), logp [B] NaN (absent: a deterministic step has no density), std_t [B]
        fp32 zeros.

    Arithmetic (diffusers' expression, verbatim): Δσ = σ_{i+1} − σ_i (0-dim fp32); the product
    Δσ·v has v's dtype by type promotion (a 0-dim tensor does not promote a dimensioned one), so
    in a bf16 pipeline it is rounded to bf16 before the FP32 addition; the sum is cast to v's
    dtype.

    Raises:
        ValueError: v and x shapes differ; noise given.
        UnsupportedConfigError: eta ≠ 0; per-row sigmas that differ; not 0 ≤ σ' < σ ≤ 1.
    """
    if v.shape != x.shape or v.dim() < 2:
        raise ValueError(f"flow_sde_step_logp: v {tuple(v.shape)} and x {tuple(x.shape)} must match, [B, ...]")
    if float(eta) != 0.0:
        raise UnsupportedConfigError(
            f"flow_sde_step_logp (diffusers_euler): diffusers' scheduler.step is deterministic, "
            f"eta must be 0, got {eta}")
    if noise is not None:
        raise ValueError("flow_sde_step_logp (diffusers_euler): the deterministic step takes no noise")
    s = _sigma_scalar(sigma, x.device, "sigma")
    sn = _sigma_scalar(sigma_next, x.device, "sigma_next")
    if not bool((sn >= 0) & (sn < s) & (s <= 1)):
        raise UnsupportedConfigError(
            f"flow_sde_step_logp: needs 0 <= sigma_next < sigma <= 1, got sigma={float(s)}, "
            f"sigma_next={float(sn)}")
    dt = sn - s  # 0-dim fp32
    mu = x.to(torch.float32) + dt * v  # dt * v in v's dtype, the addition in fp32
    x_next = mu.to(v.dtype) if prev_sample is None else prev_sample
    B = x.shape[0]
    logp = torch.full((B,), math.nan, dtype=torch.float32, device=x.device)
    std_t = torch.zeros(B, dtype=torch.float32, device=x.device)
    return x_next.detach(), logp, mu, std_t
