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
train_recompute          a LoRA rollout of the baseline spec (the        ``recompute_run(lora rollout)``:
                         adapter merged, as the trainer's rollout)       phase ``train``, autograd on, the
                                                                         adapter's factors trainable and
                                                                         the base frozen, from the stored
                                                                         latents (the diff aligns ``train``
                                                                         with ``rollout``)
gradient_checkpointing   ``recompute_run(lora, grad=True)``              the same with
                         of a LoRA rollout of the baseline spec          ``gradient_checkpointing=True``:
                         (its first sample)                              v_t, logp_t and every LoRA
                                                                         gradient record (role
                                                                         ``grad_weight``) compared
=======================  ==============================================  ====================================

The training controls train what a Flow-GRPO trainer trains, a LoRA adapter on the block
projections (``lora_adapter``), so the same control runs on every device: the strict CUDA family
has a backward for the block GEMMs, the fused joint attention, the row operators and the LoRA
factors, while its timestep and modulation projections are forward only (their weights stay
frozen). Their runs capture at ``TRAIN_CAPTURE[device type]`` (the baseline's level elsewhere).
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

TRAIN_CAPTURE = {"cuda": "L1"}
"""The capture level of the training controls' runs per device type (absent: the baseline's).
CUDA: L1. At L2 dispatch runs ``joint_attention_fused`` as its decomposition to capture the
attention internals, and the strict CUDA decomposition is forward only (the fused operator holds
the attention backward). The controls' verdicts are on the step records (v_t, logp_t), the L1
operator outputs and the LoRA gradient records, all of which L1 captures; on the CPU they keep the
baseline's level (L2: the internals and row digests too)."""


def train_capture(device: str) -> str | None:
    """``TRAIN_CAPTURE`` for a device type (``None``: the baseline's level)."""
    return TRAIN_CAPTURE.get(device)


def _where(ctx: ProbeContext) -> dict:
    """The launch every run of the control executes in (``ProbeContext.dist``, ``parallel``)."""
    return dict(dist=ctx.dist, parallel=ctx.parallel)


def replay_control(ctx: ProbeContext) -> tuple[Path, Path]:
    replay_run(ctx.baseline, ctx.run_dir, RerunOptions(overwrite=True), **_where(ctx))
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


def lora_rollout(ctx: ProbeContext, capture: str | None, **changes) -> Path:
    """A rollout of the baseline spec with ``lora_adapter`` (merged, as the baseline's LoRA mode
    gives it) and ``changes`` (``RunSpec`` fields), at ``capture`` (``None``: the baseline's level),
    written under the control's work directory."""
    if capture is not None:
        changes["capture"] = capture
    rollout = ctx.work / "lora_rollout"
    execute(dataclasses.replace(ctx.base, lora=lora_adapter(ctx), **changes), rollout,
            overwrite=True, **_where(ctx))
    return rollout


@dataclasses.dataclass(frozen=True)
class Recompute:
    """``Probe.execute``: a LoRA rollout of the baseline spec (``lora_rollout``, at ``capture``)
    against its training recompute (phase ``train``, autograd on, the adapter's factors trainable),
    in micro-batches of ``micro_batch`` samples (``None``: the rollout's batch)."""

    capture: str | None = None
    micro_batch: int | None = None

    def __call__(self, ctx: ProbeContext) -> tuple[Path, Path]:
        rollout = lora_rollout(ctx, self.capture)
        recompute_run(rollout, ctx.run_dir, RerunOptions(overwrite=True),
                      TrainOptions(micro_batch=self.micro_batch), **_where(ctx))
        return rollout, ctx.run_dir


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """``Probe.execute``: the gradient recompute of a LoRA rollout of the baseline's first sample
    (``lora_rollout``, at ``capture``) with gradient checkpointing off (the reference) and on."""

    capture: str | None = None

    def __call__(self, ctx: ProbeContext) -> tuple[Path, Path]:
        # one sample suffices (checkpointing is per forward) and halves the costly checkpointed
        # backward
        first = list(resolve(ctx.base)[1].samples[:1])
        rollout = lora_rollout(ctx, self.capture, samples=first, batch=None)
        reference = ctx.work / "recompute_grad"
        again = RerunOptions(overwrite=True)
        recompute_run(rollout, reference, again, TrainOptions(grad=True), **_where(ctx))
        recompute_run(rollout, ctx.run_dir, again, TrainOptions(grad=True, gradient_checkpointing=True),
                      **_where(ctx))
        return reference, ctx.run_dir
