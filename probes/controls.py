"""Invariant controls that need more than one ``execute``: replay, training recompute, gradient
checkpointing, run through the training side (``drifttool.training``).

    >>> ref, run = replay_control(ctx)          # (baseline, replay of the baseline's artifact)
    >>> diff_runs(open_run(ref), open_run(run)).verdict
    <Verdict.IDENTICAL: 'identical'>

Each control returns the pair of artifacts its expectation is judged on; under a torchrun launch
every run of it executes in the launch's layout (``ProbeContext.dist``, ``parallel``):

=======================  ==============================================  ====================================
control                  reference run                                   probe run
=======================  ==============================================  ====================================
replay                   the baseline                                    ``replay_run(baseline)``: re-executed
                                                                         from its stored replay inputs
train_recompute          the baseline                                    ``recompute_run(baseline)``: phase
                                                                         ``train``, autograd on, from the
                                                                         stored latents (the diff aligns
                                                                         ``train`` with ``rollout``)
gradient_checkpointing   ``recompute_run(lora, grad=True)``              the same with
                         of a LoRA rollout of the baseline spec          ``gradient_checkpointing=True``:
                         (its first sample)                              v_t, logp_t and every LoRA
                                                                         gradient record (role
                                                                         ``grad_weight``) compared
=======================  ==============================================  ====================================
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from drifttool.collectives import barrier
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_io import save_lora
from drifttool.probes.spec import ProbeContext
from drifttool.runner import execute
from drifttool.settings import resolve
from drifttool.training.options import RerunOptions, TrainOptions
from drifttool.training.recompute import recompute_run
from drifttool.training.replay import replay_run

LORA_RANK, LORA_ALPHA, LORA_SEED = 4, 8.0, 5


def _where(ctx: ProbeContext) -> dict:
    """The launch every run of the control executes in (``ProbeContext.dist``, ``parallel``)."""
    return dict(dist=ctx.dist, parallel=ctx.parallel)


def replay_control(ctx: ProbeContext) -> tuple[Path, Path]:
    replay_run(ctx.baseline, ctx.run_dir, RerunOptions(overwrite=True), **_where(ctx))
    return ctx.baseline, ctx.run_dir


def recompute_control(ctx: ProbeContext) -> tuple[Path, Path]:
    recompute_run(ctx.baseline, ctx.run_dir, RerunOptions(overwrite=True), **_where(ctx))
    return ctx.baseline, ctx.run_dir


def lora_adapter(ctx: ProbeContext) -> Path:
    """A small deterministic adapter (rank 4, non-zero B so every factor gets a gradient) for the
    baseline's checkpoint, saved under the control's work directory (by rank 0 of a launch,
    which the other ranks wait for)."""
    folder = ctx.work / "lora"
    if not ctx.launched or ctx.dist.rank == 0:
        _, s = resolve(ctx.base)
        model = load_checkpoint(ctx.checkpoint, dtype=s.torch_dtype)
        add_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA, seed=LORA_SEED, init_b_std=0.05)
        folder = save_lora(model, folder)
    if ctx.launched:
        barrier()
    return folder


def checkpointing_control(ctx: ProbeContext) -> tuple[Path, Path]:
    # one sample suffices (checkpointing is per forward) and halves the costly checkpointed backward
    first = list(resolve(ctx.base)[1].samples[:1])
    rollout = ctx.work / "lora_rollout"
    execute(dataclasses.replace(ctx.base, lora=lora_adapter(ctx), samples=first, batch=None),
            rollout, overwrite=True, **_where(ctx))
    reference = ctx.work / "recompute_grad"
    again = RerunOptions(overwrite=True)
    recompute_run(rollout, reference, again, TrainOptions(grad=True), **_where(ctx))
    recompute_run(rollout, ctx.run_dir, again, TrainOptions(grad=True, gradient_checkpointing=True),
                  **_where(ctx))
    return reference, ctx.run_dir
