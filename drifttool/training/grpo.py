"""A small Flow-GRPO loop on the tiny preset: LoRA-only policy gradient with a PPO clipped ratio.

    >>> rows = grpo_loop(GRPOConfig(rollout_mode="strict", train_mode="strict", steps=2))
    >>> rows[0]["ratio_exactly_one"], rows[0]["clip_fraction"]     # step 0, first inner epoch
    (True, 0.0)

What one policy-gradient step does (Flow-GRPO's ``train_qwenimage`` pattern, numerics §4.1):

1. **Rollout** (``rollout_mode``, no grad): ``groups`` prompts × ``group_size`` samples, fresh
   logical sample ids every step (pinned noise per id), CFG/SDE sampling with the current LoRA.
   The stored trajectory keeps x_0 … x_N (FP32) and logp_old per SDE step.
2. **Reward** (toy, deterministic): ``toy_reward`` = mean of latent channel 0 of the final
   latent (packed channels 0–3), per sample.
3. **Advantages per group**: (r − mean_group) / (std_group + 1e−4) (population std), clamped to
   ±``adv_clip_max``.
4. **Training** (``train_mode``, autograd on, LoRA parameters only, base frozen; one sample
   and its CFG pair per forward with prompts trimmed to it, ``train_micro_batch``):
   ``inner_epochs`` passes; each pass recomputes every SDE step j from the stored latents
   (``recompute`` with ``prev_sample`` = stored x_{j+1}), ratio = exp(logp − logp_old),
   loss_j = mean_b max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε)) / n_steps, backward per step
   (gradients accumulated over the steps), then one optimizer step (AdamW, LoRA only).

Reported per (step, inner epoch): reward mean, ratio mean/min/max and whether every ratio is
exactly 1, clip fraction (share of |ratio − 1| > ε), Flow-GRPO's ``approx_kl`` =
½·mean((logp − logp_old)²), the KL of the SDE transition between rollout and trainer,
mean over samples and steps of mean((μ_train − μ_rollout)²)/(2 s²) with s the rollout's noise
scale, and the loss. On the first inner epoch the parameters are those that sampled, so with
strict/strict the ratio is exactly 1 and the clip fraction 0; any other combination shows the
train–rollout mismatch as ratio ≠ 1 before any update. On a GPU (one process) the rollouts'
forwards replay CUDA graphs (``model.graphs.GraphedForward``): the same bytes, and each new group
of samples of the same shapes replays the graphs of the first. The training steps go through
``model.graphs_train.GraphedTraining`` too. On an H200 (torch 2.11) its capture was refused inside
this loop ("operation would make the legacy stream depend on a capturing blocking stream") while
the previous step's autograd graph was still alive; the loop now drops it before the next step
(not yet confirmed on the GPU). A refused capture runs the steps eagerly, with one warning (the
same bytes, without the graphs' speed).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from drifttool.errors import DriftToolError
from drifttool.fixture import DEFAULT_FIXTURE
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.config import MMDiTConfig
from drifttool.model.graphs import GraphedForward
from drifttool.model.graphs_train import GraphedTraining
from drifttool.model.lora import add_lora, lora_parameters
from drifttool.model.mmdit import MMDiT
from drifttool.runner import rank_layout, run_device
from drifttool.runtime import Runtime
from drifttool.sampling.inputs import RolloutInputs, build_inputs
from drifttool.sampling.rollout import recompute, rollout
from drifttool.sampling.step import cfg_enabled, sampler_model
from drifttool.setting_checks import check_mode, check_mode_device
from drifttool.settings import RunSpec, resolve
from drifttool.training.ledger import GradLedger
from drifttool.training.trainer import check_micro_batch, micro_batched

MODES = {"strict": "strict", "production": "auto"}
"""Combination labels → runtime modes (production = the production operators, traced)."""


@dataclass(kw_only=True)
class GRPOConfig:
    """Settings of ``grpo_loop`` (defaults: a CPU-test-sized run on the embedded default)."""

    rollout_mode: str = "strict"
    train_mode: str = "strict"
    steps: int = 2
    groups: int = 2
    group_size: int = 2
    inner_epochs: int = 2
    clip_range: float = 0.2
    adv_clip_max: float = 5.0
    lr: float = 3e-2
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_seed: int = 0
    fixture: str = DEFAULT_FIXTURE
    seed: int | None = None
    gradient_checkpointing: bool = False
    device: str = "cpu"
    """Where the policy and every input live (``RunSpec.device``)."""
    height: int | None = None
    width: int | None = None
    """Image size in pixels (multiples of 16); None: the fixture's grid."""
    train_micro_batch: int | None = 1
    """Samples per training forward (with their CFG pair; prompts trimmed per micro-batch, as
    Flow-GRPO's trainer does), ``drifttool.training.trainer.micro_batched``; None = whole batch."""

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_micro_batch(self.train_micro_batch, self.groups * self.group_size)  # one rollout's


def check_lr(lr: Any) -> float:
    """The AdamW learning rate of the loop: a finite number >= 0 (0 leaves the adapter as it is).

    Raises:
        DriftToolError: anything else (one line), before any work.
    """
    ok = isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)
    if not ok or lr < 0:
        raise DriftToolError(f"the learning rate must be a finite number >= 0, got {lr!r}")
    return float(lr)


def toy_reward(final_latents: torch.Tensor) -> torch.Tensor:
    """[B, N, Cp] → [B] fp32: mean of latent channel 0 (packed channels 0–3) over all tokens,
    a deterministic stand-in for a reward model (it favours a bright channel 0)."""
    return final_latents[..., 0:4].to(torch.float32).mean(dim=(1, 2))


def group_advantages(rewards: torch.Tensor, group_size: int, clip: float) -> torch.Tensor:
    """Per-group normalised advantages (Flow-GRPO: (r − mean) / (std + 1e−4), population std),
    clamped to ±clip. ``rewards`` [G·M] ordered group by group."""
    r = rewards.view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
    return adv.reshape(-1).clamp(-clip, clip)


def group_inputs(fx, seed: int, ids: list[int], prompt_rows: list[int], grid, num_steps: int,
                 config: MMDiTConfig) -> RolloutInputs:
    """Replay inputs for samples ``ids`` with prompt ``prompt_rows[b]`` of the fixture (pinned
    noise per sample id with ``config.latent_channels`` channels, prompts right-padded with a
    key mask, the fixture's negative prompt): ``sampling.inputs.build_inputs``."""
    return build_inputs(fx, seed=seed, samples=ids, img_grid=tuple(grid), num_steps=num_steps,
                        config=config, prompt_rows=prompt_rows)[0]


def _policy(cfg: GRPOConfig, fx, dtype, device):
    model = load_checkpoint(fx.model_dir, dtype=dtype, device=device)
    add_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.lora_seed)  # B = 0 (peft)
    return model


def _plan(dist: Any, parallel: Any, inputs: RolloutInputs, model, mode: str, sampler):
    """The parallel plan a ``mode`` rollout or trainer of ``inputs`` runs under (None: one
    process); trainers are checked for what the plan's backward covers."""
    if parallel is None or not parallel.parallel:
        return None
    family = check_mode(MODES[mode]).family
    _, _, plan = rank_layout(dist, parallel, inputs, model.config, family,
                             cfg_on=cfg_enabled(inputs, sampler), cfg_layout=sampler.cfg_layout)
    plan.check_training(model)
    return plan


def grpo_loop(cfg: GRPOConfig, *, model=None, dist: Any = None, parallel: Any = None
              ) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` policy-gradient steps; one row per (step, inner epoch) (module docstring).

    Args:
        model: a policy with a LoRA adapter (default: the fixture's model with a fresh adapter,
            rank ``lora_rank``, alpha ``lora_alpha``, B = 0).
        dist, parallel: this process's place in a torchrun launch and its TP/SP/CFG-parallel
            layout (``DistContext``, ``ParallelDims``; ``runner.rank_layout``): every rollout
            and recompute runs under the plan, every rank holds the logical trajectory and the
            canonical LoRA gradient (``training.ledger``), so every rank takes the same
            optimizer step and returns the same rows. Default one process.

    Raises:
        DriftToolError: unknown mode or fixture, or fixture settings ``drifttool run`` refuses
            (``settings.resolve``: steps outside 2..1000, say); ``parallel`` without ``dist``.
        UnsupportedConfigError: a layout the plan refuses for a mode (a production side under
            TP/SP, CFG off under CFG-parallel), or training it cannot give one device's bytes.
    """
    for m in (cfg.rollout_mode, cfg.train_mode):
        if m not in MODES:
            raise DriftToolError(f"unknown combination mode {m!r} (one of {', '.join(sorted(MODES))})")
    # the fixture's settings with the device and shape, checked as run checks them
    fx, s = resolve(RunSpec(fixture=cfg.fixture, device=cfg.device, height=cfg.height, width=cfg.width))
    for m in (cfg.rollout_mode, cfg.train_mode):
        check_mode_device(check_mode(MODES[m]), s.device)
    if parallel is not None and parallel.parallel and dist is None:
        raise DriftToolError("grpo_loop: a parallel layout needs the launch's DistContext")
    device = s.device if dist is None else run_device(s.device, dist)
    model = model if model is not None else _policy(cfg, fx, s.torch_dtype, device)
    params = list(lora_parameters(model).values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sampler = s.sampler()
    seed = int(s.seed if cfg.seed is None else cfg.seed)
    n_batch = cfg.groups * cfg.group_size
    n_prompts = int(fx.prompts(model.config.joint_attention_dim, seed=seed)[0].shape[0])
    window = [j for j in range(sampler.num_steps) if sampler.in_window(j)]
    # on a GPU, rollout forwards and training steps replay CUDA graphs (the same bytes; a new
    # group of samples of the same shapes reuses them)
    on_gpu = torch.device(device).type == "cuda" and isinstance(model, MMDiT)
    fwd = sampler_model(GraphedForward(model) if on_gpu else model)
    fwd_train = micro_batched(sampler_model(GraphedTraining(model) if on_gpu else model), cfg.train_micro_batch)
    rows = []
    for k in range(cfg.steps):
        ids = [k * n_batch + j for j in range(n_batch)]
        prompt_rows = [((k * cfg.groups) + j // cfg.group_size) % n_prompts for j in range(n_batch)]
        inputs = group_inputs(fx, seed, ids, prompt_rows, s.img_grid, sampler.num_steps,
                              model.config).to(device)
        plans = {m: _plan(dist, parallel, inputs, model, m, sampler) for m in (cfg.rollout_mode, cfg.train_mode)}
        t0 = time.perf_counter()
        traj = rollout(fwd, inputs, sampler, Runtime(mode=MODES[cfg.rollout_mode], plan=plans[cfg.rollout_mode]))
        t_roll = time.perf_counter() - t0
        rewards = toy_reward(traj.latents[-1])
        adv = group_advantages(rewards, cfg.group_size, cfg.adv_clip_max)
        for epoch in range(cfg.inner_epochs):
            t0 = time.perf_counter()
            model.gradient_checkpointing = cfg.gradient_checkpointing
            opt.zero_grad(set_to_none=True)
            ratios, kls, approx, losses = [], [], [], 0.0
            strict_train = check_mode(MODES[cfg.train_mode]).family == "strict"
            plan = plans[cfg.train_mode]
            ledger = GradLedger(model, group=None if plan is None else plan.groups.get("cfg"),
                                plan=plan) if strict_train else None  # canonical gradients (strict)
            rt = Runtime(mode=MODES[cfg.train_mode], grad_ledger=ledger, plan=plan)
            with torch.enable_grad(), (ledger or contextlib.nullcontext()):
                for j in window:
                    re = recompute(fwd_train, inputs, traj.latents, sampler, rt, phase="train", steps=[j])
                    logp, old = re.logp[0], traj.logp[j]
                    ratio = torch.exp(logp - old)
                    unclipped = -adv * ratio
                    clipped = -adv * torch.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range)
                    loss = torch.maximum(unclipped, clipped).mean() / len(window)
                    loss.backward()
                    if ledger is not None:
                        ledger.finish_step(j)
                    losses += float(loss.detach())
                    ratios.append(ratio.detach())
                    approx.append(0.5 * ((logp.detach() - old) ** 2).mean())
                    scale = traj.std_t[j] * math.sqrt(float(traj.sigmas[j] - traj.sigmas[j + 1]))
                    d = (re.mu[0].detach() - traj.mu[j]).to(torch.float64)
                    kls.append((d * d).mean(dim=(1, 2)) / (2 * scale.to(torch.float64) ** 2))
                    # the step's autograd graph goes before the next step's forward: while it lives,
                    # it holds the factors' gradient accumulators with the stream they ran on, which
                    # a CUDA graph capture of the next step cannot wait on
                    del re, logp, ratio, unclipped, clipped, loss
            model.gradient_checkpointing = False
            opt.step()
            r = torch.stack(ratios)  # [steps, B]
            clip_frac = ((r - 1).abs() > cfg.clip_range).to(torch.float64).mean()
            rows.append({
                "rollout_mode": cfg.rollout_mode, "train_mode": cfg.train_mode,
                "combo": f"{cfg.rollout_mode}/{cfg.train_mode}", "step": k, "epoch": epoch,
                "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
                "ratio_mean": float(r.to(torch.float64).mean()), "ratio_min": float(r.min()),
                "ratio_max": float(r.max()), "ratio_exactly_one": bool((r == 1).all()),
                "clip_fraction": float(clip_frac), "approx_kl": float(torch.stack(approx).mean()),
                "kl": float(torch.stack(kls).mean()), "loss": losses,
                "rollout_seconds": t_roll, "train_seconds": time.perf_counter() - t0,
            })
    return rows
