"""The Flow-GRPO SDE step with its log-probability (``flow_sde_step_logp``, numerics §4, §4.1,
§5 trap 9): the step rules, the argument checks every family shares, and the strict
implementation (FP32, binary64 ln s_t rounded once, pairwise-tree mean) with its backward.

    >>> x1, logp, mu, std_t = call(rt, "flow_sde_step_logp", v, x, sig[0], sig[1],
    ...                            eta=1.2, sigma_max=sig[1], noise=eps)
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import Constraint, require_dtype
from drifttool.ops.registry import implements
from drifttool.ops.specs import OPERATORS
from drifttool.ops.strict_math import sqrt32, tree_sum

MAX_LOGP_ELEMENTS = 1 << 24
"""Largest per-sample element count of the strict logp mean (the count is exact in fp32)."""

STEP_RULES = ("sde", "flow_grpo", "diffusers_euler")
"""How a ``flow_sde_step_logp`` call steps (its keyword ``rule``, default ``"sde"``):

* ``"sde"``: Flow-GRPO's SDE step with η > 0 (inside the SDE window); with η = 0 the FP32 Euler
  step x + Δσ·v, any noise ignored (drifttool's default sampler; strict and production).
* ``"flow_grpo"`` (production): Flow-GRPO's ``sde_step_with_logprob`` at **every** step, as its
  Qwen-Image rollout calls it: outside the window η = 0 goes through the same expression
  (std_t = 0) and the step's noise is still added, times 0 (numerics §4.1). Needs ``noise`` or
  ``prev_sample`` at every step.
* ``"diffusers_euler"`` (production): diffusers' ``FlowMatchEulerDiscreteScheduler.step``:
  x_next = (fp32(x) + Δσ·v).to(v.dtype), the product Δσ·v in v's dtype (numerics §3.4);
  η must be 0; no log-probability.
"""


def rule_is(*allowed: str) -> Constraint:
    """Constraint: the call's ``rule`` keyword is one of ``allowed`` (``STEP_RULES``)."""

    def test(args) -> str | None:
        rule = args["rule"]
        if rule in allowed:
            return None
        if rule not in STEP_RULES:
            return f"unknown step rule {rule!r} (one of {', '.join(STEP_RULES)})"
        return f"step rule {rule!r} is not implemented here (this kernel runs {', '.join(allowed)})"

    return Constraint(f"step rule {'|'.join(allowed)}", test, ("rule",))


def _per_sample(value: float | torch.Tensor, batch: int, what: str) -> torch.Tensor:
    """A schedule scalar or [B] vector as an fp32 [B] tensor on the CPU (a device tensor is read
    back: pass host values to keep the step free of host synchronisations)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu", torch.float32)
    else:
        t = torch.tensor(float(value), dtype=torch.float32)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(
            f"flow_sde_step_logp: {what} must be a scalar or [B={batch}], got {tuple(t.shape)}"
        )
    return t.contiguous()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on ``device``: on a GPU through pinned memory without blocking the host
    (torch's pinned-memory cache keeps the buffer until the copy has run), so a step's schedule
    scalars cost no host synchronisation; elsewhere ``host.to(device)``."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def schedule_host(sigma, sigma_next, sigma_max, batch: int, eta: float):
    """The checked schedule of a step on the CPU: ``(sigma, sigma_next, sigma_max)`` fp32 [B] each.

    Raises:
        ValueError: a schedule value neither a scalar nor [B].
        UnsupportedConfigError: σ out of order (0 <= sigma_next < sigma <= 1 per sample), or
            sigma_max outside (0, 1) when eta > 0.
    """
    name = "flow_sde_step_logp"
    s = _per_sample(sigma, batch, "sigma")
    sn = _per_sample(sigma_next, batch, "sigma_next")
    sm = _per_sample(sigma_max, batch, "sigma_max")
    if not bool(((sn >= 0) & (sn < s) & (s <= 1)).all()):
        raise UnsupportedConfigError(
            f"{name}: needs 0 <= sigma_next < sigma <= 1 per sample, got sigma={s.tolist()}, "
            f"sigma_next={sn.tolist()}"
        )
    if eta > 0 and not bool(((sm > 0) & (sm < 1)).all()):
        raise UnsupportedConfigError(
            f"{name}: sigma_max (= sigmas[1]) must be in (0, 1), got {sm.tolist()}"
        )
    return s, sn, sm


def prepare_sde(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None,
    prev_sample: torch.Tensor | None,
    strict: bool,
    host_schedule: bool = False,
):
    """The argument checks of every ``flow_sde_step_logp`` kernel (``strict``: the strict dtypes
    too) and its inputs in FP32: ``(v32, x32, sigma [B], sigma_next [B], sigma_max [B], eta)``,
    the schedule on x's device (``host_schedule``: left on the CPU). The schedule is checked on
    the host: pass CPU scalars and the step makes no host synchronisation.

    Raises:
        ValueError: shapes, noise and prev_sample both given, eta, or eta > 0 without noise.
        UnsupportedConfigError: a dtype strict does not take, σ out of order, sigma_max.
    """
    name = "flow_sde_step_logp"
    if v.shape != x.shape or v.dim() < 2:
        raise ValueError(f"{name}: v {tuple(v.shape)} and x {tuple(x.shape)} must match, [B, ...]")
    if noise is not None and prev_sample is not None:
        raise ValueError(f"{name}: give noise (sampling) or prev_sample (replay), not both")
    for what, t in (("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name}: {what} {tuple(t.shape)} must match x {tuple(x.shape)}")
    eta = float(eta)
    if not math.isfinite(eta) or eta < 0:
        raise ValueError(f"{name}: eta must be finite and >= 0, got {eta}")
    if eta > 0 and noise is None and prev_sample is None:
        raise ValueError(f"{name}: eta > 0 needs pinned noise or prev_sample (the op draws no RNG)")
    if strict:
        for what, t in (("v", v), ("x", x), ("prev_sample", prev_sample)):
            if t is not None:
                require_dtype(name, what, t, OPERATORS["flow_sde_step_logp"].dtypes)
        if noise is not None:
            require_dtype(name, "noise", noise, (torch.float32,))
    s, sn, sm = schedule_host(sigma, sigma_next, sigma_max, x.shape[0], eta)
    if not host_schedule:
        s, sn, sm = to_device(torch.stack([s, sn, sm]), x.device).unbind(0)
    return v.to(torch.float32), x.to(torch.float32), s, sn, sm, eta


def bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B] → [B, 1, ..., 1] with ``ndim`` dims."""
    return t.view(-1, *([1] * (ndim - 1)))


def euler_step(v32, x32, s, sn, prev_sample):
    """eta == 0: x + Δσ·v in fp32; logp undefined (NaN); std_t = 0."""
    dt = bcast(sn - s, x32.dim())
    mu = x32 + dt * v32
    x_next = prev_sample.to(torch.float32) if prev_sample is not None else mu
    B = x32.shape[0]
    logp = torch.full((B,), math.nan, dtype=torch.float32, device=x32.device)
    std_t = torch.zeros(B, dtype=torch.float32, device=x32.device)
    return x_next.detach(), logp, mu, std_t


def sde_constants(s: torch.Tensor, sn: torch.Tensor, sm: torch.Tensor, eta: float):
    """The per-sample constants of the strict SDE step (η > 0), FP32 [B] on ``s``'s device, in
    ``flow_sde_step_logp_strict``'s order: (Δ, std_t, a, c, s_t, 2·(s_t·s_t), ln s_t, ln√(2π)) —
    the last a 0-dim tensor; both logs binary64 on the host, rounded once to FP32. Shared by the
    strict CUDA step, which computes them here on the CPU."""
    eta32 = torch.tensor(eta, dtype=torch.float32, device=s.device)
    dt = sn - s  # [B]
    std = sqrt32(s / (1 - torch.where(s == 1, sm, s))) * eta32  # [B]
    var = std * std
    two_s = 2 * s
    a = 1 + (var / two_s) * dt  # [B]
    c = 1 + (var * (1 - s)) / two_s  # [B]
    scale = std * sqrt32(-dt)  # [B] noise scale s_t
    log_scale = torch.tensor(
        [math.log(q) if q > 0 else (-math.inf if q == 0 else math.nan) for q in scale.tolist()],
        dtype=torch.float32, device=s.device,
    )  # [B]
    log_sqrt_2pi = torch.tensor(0.5 * math.log(2.0 * math.pi), dtype=torch.float32, device=s.device)
    two_var = 2 * (scale * scale)  # [B]
    return dt, std, a, c, scale, two_var, log_scale, log_sqrt_2pi


class _SDEStep(torch.autograd.Function):
    """The strict SDE step (arithmetic in ``flow_sde_step_logp_strict``'s docstring) with a fixed
    backward, all FP32 and elementwise per sample (x_next is detached, so only mu carries the
    gradient of logp):

    coef = g_logp / (fp32(N·C)·(s·s)); dmu = g_mu + d·coef; dx = dmu·a; dv = (dmu·c)·Δ.
    Euler steps (η = 0): dx = g_mu, dv = Δ·g_mu; logp (NaN) has no gradient.
    """

    @staticmethod
    def forward(ctx, v32, x32, s, sn, sm, eta, noise, prev_sample):
        per_sample = x32[0].numel()
        if eta == 0.0:
            x_next, logp, mu, std_t = euler_step(v32, x32, s, sn, prev_sample)
            ctx.mark_non_differentiable(x_next, logp, std_t)
            ctx.save_for_backward(sn - s)
            ctx.euler = True
            return x_next, logp, mu, std_t
        nd = x32.dim()
        dt, std, a, c, scale, two_var, log_scale, log_sqrt_2pi = sde_constants(s, sn, sm, eta)
        mu = x32 * bcast(a, nd) + (v32 * bcast(c, nd)) * bcast(dt, nd)  # [B, N, C]
        if prev_sample is None:
            x_next = mu + bcast(scale, nd) * noise
        else:
            x_next = prev_sample.to(torch.float32)
        x_next = x_next.detach()
        d = x_next - mu
        elem = (-(d * d) / bcast(two_var, nd) - bcast(log_scale, nd)) - log_sqrt_2pi  # [B, N, C]
        total = tree_sum(elem.reshape(elem.shape[0], -1))  # [B]
        logp = total / torch.tensor(float(per_sample), dtype=torch.float32, device=x32.device)
        ctx.mark_non_differentiable(x_next, std)
        ctx.save_for_backward(dt, a, c, scale, d)
        ctx.euler, ctx.count = False, per_sample
        return x_next, logp, mu, std

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_next, g_logp, g_mu, g_std):
        if ctx.euler:
            (dt,) = ctx.saved_tensors
            return (*euler_step_grads(g_mu, dt), None, None, None, None, None, None)
        dt, a, c, scale, d = ctx.saved_tensors
        count = torch.tensor(float(ctx.count), dtype=torch.float32, device=g_mu.device)
        return (*sde_step_grads(g_mu, g_logp, dt, a, c, scale, d, count), None, None, None, None, None, None)


def euler_step_grads(g_mu: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dv, dx) FP32 of the Euler step mu = x + Δ·v given dL/dmu ``g_mu`` [B, ...] and Δ [B]."""
    g = g_mu.contiguous().to(torch.float32)
    return bcast(dt, g.dim()) * g, g


def sde_step_grads(g_mu, g_logp, dt, a, c, scale, d, count) -> tuple[torch.Tensor, torch.Tensor]:
    """(dv, dx) FP32 of the SDE step (``_SDEStep``'s formula) given dL/dmu [B, ...], dL/dlogp [B],
    the per-sample constants Δ, a, c, s_t [B], d = x_next − mu [B, ...] and the element count
    (FP32). Plain torch FP32 operations, one rounding each: the same bytes on any device (the
    strict CUDA backward runs this function on the GPU)."""
    nd = g_mu.dim()
    g_mu = g_mu.contiguous().to(torch.float32)
    coef = g_logp.to(torch.float32) / (count * (scale * scale))  # [B]
    dmu = g_mu + d * bcast(coef, nd)
    return (dmu * bcast(c, nd)) * bcast(dt, nd), dmu * bcast(a, nd)


@implements("flow_sde_step_logp", "strict", kernel="torch.fp32.flowgrpo_sde.pairwise_tree_mean",
            constraints=(rule_is("sde"),))
def flow_sde_step_logp_strict(
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
    """Flow-GRPO 'sde' transition x_t → x_{t+1} and its log-probability, strict FP32 (numerics §4).

    Args:
        v: [B, N, C] velocity (fp32, or bf16 upcast exactly) — the CFG-combined one in a rollout.
        x: [B, N, C] current latent x_t (fp32 or bf16).
        sigma: σ of this step, python float, 0-dim or [B] (per-sample schedules allowed).
        sigma_next: σ of the next step (σ' < σ; 0 at the last step).
        eta: noise level η ≥ 0 (``noise_level`` in Flow-GRPO). ``eta == 0`` (a step outside the
            SDE window) is the deterministic Euler step, see Returns.
        sigma_max: the scheduler's **second** sigma ``sigmas[1]`` (§5 trap 9), substituted for σ
            in 1 − σ when σ == 1.
        noise: [B, N, C] fp32 pinned standard-normal noise (sampling); the op draws no RNG.
        prev_sample: [B, N, C] the stored next latent (replay / training recompute); fp32 or bf16.
        rule: ``"sde"`` only (``STEP_RULES``; the other rules are production kernels, and a
            declared constraint refuses them here).

    Returns:
        ``(x_next, logp, mu, std_t)``, all fp32:
        x_next [B, N, C] (detached; ``prev_sample`` itself in replay), logp [B], mu [B, N, C]
        (differentiable in v and x), std_t [B] (the SDE std η·sqrt(σ/(1−σ̃)), not the step's
        noise scale s = std_t·sqrt(−Δ)). With ``eta == 0``: mu = x + Δ·v, x_next = mu (or
        ``prev_sample``), std_t = 0 and **logp = NaN**: the log-density of a deterministic step is
        not defined; callers must record it as absent, never as a value.

    Arithmetic (fp32, one rounding per op, no FMA, Flow-GRPO's written order), per sample:
    Δ = σ' − σ; std = sqrt(σ / (1 − σ̃)) · η with σ̃ = σ_max if σ == 1 else σ; var = std·std;
    a = 1 + (var / (2σ))·Δ; c = 1 + (var·(1 − σ)) / (2σ); mu = x·a + (v·c)·Δ;
    s = std·sqrt(−Δ); x_next = mu + s·noise (sampling) or prev_sample;
    ℓ = (−(d·d) / (2·(s·s)) − ln s) − ln√(2π) with d = x_next − mu (x_next detached);
    logp = tree_sum(ℓ over the N·C flattened elements) / fp32(N·C) (pairwise tree, module doc).
    ln s and ln√(2π) are binary64 logs rounded once to fp32 (the only transcendental; declared
    tolerance vs the FP64 reference 1e-5 abs on logp), computed per sample on the host, so
    nothing depends on the batch layout. Byte-invariant to batch size, batch position and token
    count; sampling and replay (prev_sample = the sampled x_next) give the same logp bytes.

    Backward (``_SDEStep``): only mu carries gradients (x_next, std_t and the Euler logp are not
    differentiable): dmu = g_mu + d·(g_logp / (fp32(N·C)·(s·s))); dx = dmu·a; dv = (dmu·c)·Δ,
    elementwise FP32 per sample.

    Raises:
        ValueError: shape mismatch; both or (with eta > 0) neither of noise/prev_sample; eta < 0.
        UnsupportedConfigError: unsupported dtype (noise must be fp32); sigma_next ≥ sigma,
            σ > 1 or σ' < 0; sigma_max ∉ (0, 1) with eta > 0; more than 2^24 elements per sample.
    """
    v32, x32, s, sn, sm, eta = prepare_sde(
        v, x, sigma, sigma_next, eta, sigma_max, noise, prev_sample, strict=True
    )
    per_sample = x32[0].numel()
    if per_sample > MAX_LOGP_ELEMENTS:
        raise UnsupportedConfigError(
            f"flow_sde_step_logp: {per_sample} elements per sample exceed 2^24 (strict count)"
        )
    return _SDEStep.apply(v32, x32, s, sn, sm, eta, noise, prev_sample)
