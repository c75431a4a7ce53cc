"""Rollout (sampling) and training recompute of a Qwen-Image CFG/SDE trajectory.

    >>> traj = rollout(model, inputs, SamplerConfig(num_steps=10, cfg_scale=4.0, eta=1.2), rt)
    >>> traj.latents.shape, traj.logp.shape        # x_0..x_10, logp per step (NaN outside window)
    (torch.Size([11, 2, 1024, 64]), torch.Size([10, 2]))
    >>> re = recompute(model, inputs, traj.latents, cfg, rt)   # phase="train"
    >>> torch.equal(re.logp[:9].view(torch.int32), traj.logp[:9].view(torch.int32))   # strict
    True

The sigma table comes first (``sigma_table``: one ``flow_sigma_table`` call, step −1), then
each step runs as ``drifttool.sampling.step`` describes (forwards per CFG branch, CFG combine,
SDE step and logp, step records).

Latents stay fp32 between steps (``SamplerConfig.latents_dtype``; a production preset,
``drifttool.sampling.presets``, keeps them in the model dtype as the pipelines do: the step's
x_next is cast to it before it is stored and fed to the next step, while logp_t is computed on
the step's own FP32 x_next). ``SamplerConfig.step_rule`` picks the step's arithmetic
(``ops.scheduler.STEP_RULES``). ``recompute`` re-runs steps from stored latents with
``prev_sample`` = the stored next latent (Flow-GRPO's ``compute_log_prob``), gradients enabled,
under ``SamplerConfig.train_timestep_policy`` when one is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.ops.scheduler import timestep_input
from drifttool.runtime import Runtime
from drifttool.sampling.config import SAMPLER_BLOCK, SamplerConfig
from drifttool.sampling.inputs import RolloutInputs
from drifttool.sampling.presets import check_conditions
from drifttool.sampling.step import StepCallback, StepOutput, cfg_enabled, run_step


@dataclass(kw_only=True)
class Trajectory:
    """Per-step results of a rollout or recompute (step axis first, batch rows = sample_ids).

    Attributes:
        phase: ``"rollout"`` or the recompute phase (``"train"``).
        sample_ids: logical sample id per batch row.
        cfg: whether CFG ran.
        sigmas: [num_steps + 1] fp32 sigma table; ``tau``: [num_steps] fp32 model timesteps.
        steps: indices of the steps held, in order (all of them unless stopped early or a
            subset was recomputed); the per-step tensors below follow this list.
        in_window, eta: per held step.
        latents: rollout: [len(steps) + 1, B, N, Cp] x_0 … x_k; recompute: the stored latents.
        velocities, v_cond, mu: [len(steps), B, N, Cp]; v_uncond likewise or None.
        std_t, logp: [len(steps), B]; logp is NaN outside the SDE window (absent, not a value).
        complete: every step 0 … num_steps − 1 is held.
    """

    phase: str
    sample_ids: list[int]
    cfg: bool
    sigmas: torch.Tensor
    tau: torch.Tensor
    steps: list[int]
    in_window: list[bool]
    eta: list[float]
    latents: torch.Tensor
    velocities: torch.Tensor
    v_cond: torch.Tensor
    v_uncond: torch.Tensor | None
    mu: torch.Tensor
    std_t: torch.Tensor
    logp: torch.Tensor
    complete: bool


def check_family(rt: Runtime, cfg: SamplerConfig, inputs: RolloutInputs) -> None:
    """A preset's sampler (or any non-default ``step_rule``/``latents_dtype``) reproduces a
    production pipeline's arithmetic: it runs under the production family only, on the condition
    images its pipeline takes (``presets.check_conditions``).

    Raises:
        UnsupportedConfigError: ``rt`` requests another family (strict, audit), one line.
        DriftToolError: condition images the preset's pipeline does not take.
    """
    custom = cfg.preset is not None or cfg.step_rule != "sde" or cfg.latents_dtype != "float32"
    if custom and rt.family != "production":
        what = f"preset {cfg.preset!r}" if cfg.preset else (
            f"step_rule {cfg.step_rule!r} with {cfg.latents_dtype} latents")
        raise UnsupportedConfigError(
            f"{what} reproduces a production pipeline's arithmetic (bf16 latents, its scheduler "
            f"step): mode {rt.mode.value!r} runs the {rt.family!r} family; use mode auto or off")
    if cfg.preset is not None:
        check_conditions(cfg.preset, inputs.cond_grids)


def sigma_table(rt: Runtime, cfg: SamplerConfig, img_grid: tuple[int, int],
                phase: str = "rollout") -> torch.Tensor:
    """The [num_steps + 1] fp32 sigma table of ``cfg`` at ``img_grid``: one ``flow_sigma_table``
    call under ``rt`` (phase ``phase``, step −1, block ``SAMPLER_BLOCK``), so the table follows
    ``rt``'s mode, fallbacks and variants. ``rollout`` and ``recompute`` take their table from
    here, and so does the manifest (``drifttool.lifecycle.manifest_sigma_table``, on a silent
    runtime of the run's settings).

    Raises:
        UnsupportedConfigError: no backend of ``rt``'s mode (the operator's own checks).
    """
    h, w = img_grid
    seq = cfg.image_seq_len if cfg.image_seq_len is not None else h * w
    with rt.scope(phase=phase, step=-1, sigma=float("nan"), branch="none", block=SAMPLER_BLOCK,
                  samples=None, txt_lens=None, img_grid=tuple(img_grid)):
        return call(rt, "flow_sigma_table", cfg.num_steps, seq, stream="none", layout=".")


def _trajectory(phase, inputs, cfg, cfg_on, sigmas, tau_all, outs, latents) -> Trajectory:
    def stack(name):
        vals = [getattr(o, name) for o in outs]
        return torch.stack(vals) if vals else torch.empty(0)

    return Trajectory(
        phase=phase, sample_ids=list(inputs.sample_ids), cfg=cfg_on, sigmas=sigmas, tau=tau_all,
        steps=[o.step for o in outs], in_window=[o.in_window for o in outs],
        eta=[cfg.eta_at(o.step) for o in outs], latents=latents, velocities=stack("v"),
        v_cond=stack("v_cond"), v_uncond=stack("v_uncond") if cfg_on else None, mu=stack("mu"),
        std_t=stack("std_t"), logp=stack("logp"),
        complete=[o.step for o in outs] == list(range(cfg.num_steps)),
    )


def rollout(
    model: Callable[..., torch.Tensor],
    inputs: RolloutInputs,
    cfg: SamplerConfig,
    rt: Runtime,
    *,
    callback: StepCallback | None = None,
    max_steps: int | None = None,
) -> Trajectory:
    """Sample a CFG/SDE trajectory from pinned inputs (see the module docstring for each step).

    Args:
        model: ``model(x [B,N,Cp], txt [B,L,D], txt_mask [B,L] bool | None, tau [B] fp32,
            img_grid (h, w), rt) -> v [B,N,Cp]`` (docs/architecture.md).
        inputs: ``RolloutInputs`` (x0, prompts, masks, pinned noise).
        cfg: ``SamplerConfig``.
        rt: the runtime (mode picks strict/production operators; recorder gets step records).
        callback: called with each step's ``StepOutput`` after its records were flushed; an
            exception it raises propagates (the recorder keeps the finished steps).
        max_steps: stop after this many steps (partial trajectory, ``complete=False``).

    Returns:
        ``Trajectory`` (phase ``"rollout"``), computed under ``torch.no_grad()``.

    Raises:
        ValueError: inconsistent inputs, or a stochastic step without noise.
        UnsupportedConfigError: a preset under a family other than production
            (``check_family``); from the operators (strict dtype/domain checks, missing backend).
    """
    inputs.validate()
    check_family(rt, cfg, inputs)
    phase = "rollout"
    cfg_on = cfg_enabled(inputs, cfg)
    n_run = cfg.num_steps if max_steps is None else max(0, min(int(max_steps), cfg.num_steps))
    with torch.no_grad():
        table = sigma_table(rt, cfg, inputs.img_grid, phase)  # [S+1] fp32, on the CPU
        sigmas = table.to(inputs.x0.device)
        tau_all = timestep_input(sigmas[:-1], cfg.policy(phase))  # [S] fp32
        x = inputs.x0.to(cfg.latents_torch_dtype)  # the pipeline's latents cast (no-op in fp32)
        latents, outs = [x], []
        for i in range(n_run):
            out = run_step(model, rt, inputs, cfg, cfg_on, phase, i, table, tau_all, x, None)
            outs.append(out)
            x = out.x_next
            latents.append(x)
            if callback is not None:
                callback(out)
    return _trajectory(phase, inputs, cfg, cfg_on, sigmas, tau_all, outs, torch.stack(latents))


def rollout_step(
    model: Callable[..., torch.Tensor],
    inputs: RolloutInputs,
    cfg: SamplerConfig,
    rt: Runtime,
    step: int,
    x: torch.Tensor,
) -> StepOutput:
    """Re-execute one rollout step ``step`` from its input latent ``x`` [B, N, Cp] (the x_t a
    rollout recorded for that step, in its stored dtype): the sigma table (one
    ``flow_sigma_table`` call, step −1), then exactly the step ``rollout`` runs — forwards, CFG,
    the SDE step with the pinned noise of ``inputs`` (``prev_sample`` None) — with its records
    written under phase ``rollout``. Used by ``drifttool diff --localize`` to re-run the first
    drifting step of a run at a finer capture level.

    Raises:
        ValueError: ``step`` outside [0, num_steps), ``x`` not shaped as ``inputs.x0``, or
            inconsistent inputs.
        UnsupportedConfigError: from the operators.
    """
    inputs.validate()
    if not 0 <= int(step) < cfg.num_steps:
        raise ValueError(f"step {step} outside [0, {cfg.num_steps})")
    if tuple(x.shape) != tuple(inputs.x0.shape):
        raise ValueError(f"x {tuple(x.shape)} must be shaped as x0 {tuple(inputs.x0.shape)}")
    cfg_on = cfg_enabled(inputs, cfg)
    with torch.no_grad():
        table = sigma_table(rt, cfg, inputs.img_grid, "rollout")
        tau_all = timestep_input(table.to(inputs.x0.device)[:-1], cfg.policy("rollout"))
        return run_step(model, rt, inputs, cfg, cfg_on, "rollout", int(step), table, tau_all,
                         x, None)


def recompute(
    model: Callable[..., torch.Tensor],
    inputs: RolloutInputs,
    stored_latents: torch.Tensor,
    cfg: SamplerConfig,
    rt: Runtime,
    phase: str = "train",
    *,
    steps: Sequence[int] | None = None,
    callback: StepCallback | None = None,
) -> Trajectory:
    """Training-side recompute: re-score stored transitions (numerics §4.1 ``compute_log_prob``).

    Each step i runs from the stored x_i with ``prev_sample`` = stored x_{i+1}: same forwards,
    CFG and SDE arithmetic as ``rollout`` (same ``cfg`` — in particular the same timestep
    policy, unless ``cfg.train_timestep_policy`` names the trainer's own, as Flow-GRPO's
    ``compute_log_prob`` does), so in strict mode v_t and logp_t are byte-equal to the
    rollout's. Stored latents are read in ``cfg.latents_dtype`` (bf16 ones as stored). Gradients are
    enabled as the caller set them (logp is differentiable through mu and v). Step records are
    written with ``phase`` and flushed per step.

    Args:
        stored_latents: [num_steps + 1, B, N, Cp] x_0 … x_N (fp32, or bf16 upcast exactly;
            with ``latents_dtype="bfloat16"`` bf16 values).
        steps: step indices to recompute (default all, in order).
        Other arguments as ``rollout``. ``inputs.noise`` is not used.

    Returns:
        ``Trajectory`` with ``latents = stored_latents`` and per-step tensors for ``steps``.
    """
    inputs.validate()
    check_family(rt, cfg, inputs)
    S = cfg.num_steps
    if stored_latents.dim() != 4 or stored_latents.shape[0] != S + 1 \
            or stored_latents.shape[1:] != inputs.x0.shape:
        raise ValueError(
            f"stored_latents {tuple(stored_latents.shape)} must be [num_steps+1={S + 1}, "
            f"{', '.join(map(str, inputs.x0.shape))}]"
        )
    idx = list(range(S)) if steps is None else [int(i) for i in steps]
    if any(not 0 <= i < S for i in idx):
        raise ValueError(f"steps {idx} outside [0, {S})")
    cfg_on = cfg_enabled(inputs, cfg)
    with torch.no_grad():
        table = sigma_table(rt, cfg, inputs.img_grid, phase)
        sigmas = table.to(inputs.x0.device)
        tau_all = timestep_input(sigmas[:-1], cfg.policy(phase))
    outs = []
    ldt = cfg.latents_torch_dtype
    for i in idx:
        x = stored_latents[i].to(ldt)
        prev = stored_latents[i + 1].to(ldt)
        out = run_step(model, rt, inputs, cfg, cfg_on, phase, i, table, tau_all, x, prev)
        outs.append(out)
        if callback is not None:
            callback(out)
    return _trajectory(phase, inputs, cfg, cfg_on, sigmas, tau_all, outs, stored_latents)
