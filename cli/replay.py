"""``drifttool replay`` and ``drifttool recompute``: re-execute or re-score a stored rollout.

    drifttool replay runs/a -o runs/a-replay              # same inputs, same settings, same model
    drifttool diff runs/a runs/a-replay                    # strict: identical
    drifttool recompute runs/a -o runs/a-train             # phase "train", autograd on
    drifttool diff runs/a runs/a-train                     # aligns train <-> rollout
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from drifttool.cli._console import console, progress as _progress, step_task

_DEVICE_HELP = "cpu | cuda | cuda:N (default: the run's). Shapes come from the artifact."


def _branches(stored) -> int:
    """CFG branches per step of a stored rollout (2 with CFG on, else 1: ``sampling.rollout``)."""
    return 2 if stored.sampler.cfg_scale > 1 and stored.inputs.neg_txt is not None else 1


def _summary(title: str, rows: list[tuple[str, object]]) -> None:
    table = Table(title=title, show_header=False)
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)


def replay(
    run_dir: Path = typer.Argument(..., help="Rollout artifact to replay."),
    out: Path = typer.Option(..., "-o", "--out", help="Artifact directory to create."),
    mode: Optional[str] = typer.Option(None, help="strict | audit | auto | off (default: the run's)."),
    capture: Optional[str] = typer.Option(None, help="L0 | L1 | L2 (default: the run's)."),
    fixture: Optional[str] = typer.Option(None, help="Fixture holding the model, if the manifest's name does not resolve."),
    checkpoint: Optional[Path] = typer.Option(None, help="Model folder overriding the manifest's (fingerprint-checked)."),
    lora: Optional[Path] = typer.Option(None, help="LoRA adapter overriding the manifest's (fingerprint-checked)."),
    device: Optional[str] = typer.Option(None, help=_DEVICE_HELP),
    overwrite: bool = typer.Option(False, help="Replace an existing artifact directory."),
) -> None:
    """Re-execute a trajectory from its artifact's replay inputs.

    Uses the stored x0, SDE noise, prompts and masks with the manifest's settings and model
    (fingerprint-checked). `drifttool diff RUN_DIR OUT` is identical in strict mode.
    """
    from drifttool.training.options import RerunOptions  # lazy: keeps torch out of `drifttool --help`
    from drifttool.training.replay import replay_run  # lazy: likewise
    from drifttool.training.stored import load_rollout  # lazy: likewise

    stored = load_rollout(run_dir, need_latents=False)
    options = RerunOptions(mode=mode, capture=capture, fixture=fixture, checkpoint=checkpoint,
                           lora=lora, device=device, overwrite=overwrite)
    with _progress() as progress:
        task = step_task(progress, "replay", stored.sampler.num_steps, stored.inputs.batch,
                         _branches(stored))
        s = replay_run(run_dir, out, options, on_step=lambda _: progress.advance(task))
    _summary(f"drifttool replay {run_dir} → {out}",
             [(k, s[k]) for k in ("mode", "capture", "steps", "samples", "complete")])
    console.print(f"compare: drifttool diff {run_dir} {out}", highlight=False)


def recompute(
    run_dir: Path = typer.Argument(..., help="Complete rollout artifact to re-score."),
    out: Path = typer.Option(..., "-o", "--out", help="Artifact directory to create (kind: recompute)."),
    mode: Optional[str] = typer.Option(None, help="Trainer mode: strict | audit | auto | off (default: the run's)."),
    capture: Optional[str] = typer.Option(None, help="L0 | L1 | L2 (default: the run's)."),
    grad: bool = typer.Option(False, help="Backward of -mean logp_t per SDE step; digest the LoRA gradients."),
    gradient_checkpointing: bool = typer.Option(False, help="Recompute block activations in the backward."),
    micro_batch: Optional[int] = typer.Option(None, min=1, help="Samples per trainer forward (default: the whole batch)."),
    trim_padding: bool = typer.Option(True, help="With --micro-batch: trim prompts to each micro-batch."),
    fixture: Optional[str] = typer.Option(None, help="Fixture holding the model, if the manifest's name does not resolve."),
    checkpoint: Optional[Path] = typer.Option(None, help="Trainer model folder (must match the rollout's fingerprint)."),
    lora: Optional[Path] = typer.Option(None, help="LoRA adapter (must match the rollout's)."),
    device: Optional[str] = typer.Option(None, help=_DEVICE_HELP),
    overwrite: bool = typer.Option(False, help="Replace an existing artifact directory."),
) -> None:
    """Training recompute of a stored rollout (phase train, autograd on).

    Every step is re-run from the stored latents (prev_sample = the stored next latent) under the
    rollout's pinned policy (timestep encoding, stored-latent dtype, CFG layout). `drifttool diff
    RUN_DIR OUT` aligns train with rollout and names the first drifting operator, block, step, row.
    """
    from drifttool.training.options import RerunOptions, TrainOptions  # lazy: keeps torch out of `drifttool --help`
    from drifttool.training.recompute import recompute_run  # lazy: likewise
    from drifttool.training.stored import load_rollout  # lazy: likewise

    stored = load_rollout(run_dir)
    options = RerunOptions(mode=mode, capture=capture, fixture=fixture, checkpoint=checkpoint,
                           lora=lora, device=device, overwrite=overwrite)
    train = TrainOptions(grad=grad, gradient_checkpointing=gradient_checkpointing,
                         micro_batch=micro_batch, trim_padding=trim_padding)
    with _progress() as progress:
        task = step_task(progress, "train recompute", stored.sampler.num_steps, stored.inputs.batch,
                         _branches(stored))
        s = recompute_run(stored, out, options, train, on_step=lambda _: progress.advance(task))
    rows = [(k, s[k]) for k in ("mode", "capture", "steps", "samples", "complete", "grad_records")]
    rows += [("timestep_policy", stored.sampler.timestep_policy), ("cfg_layout", stored.sampler.cfg_layout),
             ("stored latents", stored.latent_dtype), ("seconds", f"{s['seconds']:.2f}")]
    _summary(f"drifttool recompute {run_dir} → {out}", rows)
    console.print(f"compare: drifttool diff {run_dir} {out}", highlight=False)
