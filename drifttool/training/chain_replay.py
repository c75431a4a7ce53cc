"""Replay of a chain run (``run --prompt``) or an edit run from its condition images: every stage
runs again, not the transformer stage alone.

    >>> replay_run("runs/chain", "runs/chain-replay")       # text encoder → trajectory → VAE
    >>> diff_runs(open_run("runs/chain"), open_run("runs/chain-replay")).verdict   # strict
    <Verdict.IDENTICAL: 'identical'>

The manifest's ``chain`` (or ``edit``) section names the pipeline folder; ``--checkpoint`` gives
another copy of it (the transformer is fingerprint-checked as in any replay). The stages re-run
with the replay's mode and capture level: the text encoder encodes the stored prompts again (or
the VAE encodes the condition images again, each checked against its recorded SHA-256, and an
edit run's prompts, if it encoded them, with its image and position rule), and the trajectory
takes those fresh embeddings (and condition latents) with the stored x0 and SDE noise;
the VAE decodes x_N and the image is written beside the replay (``chain.image_paths``). So a
replay in another mode drifts first where that mode first changes a byte, whichever stage it is,
and a strict replay diffs identical to its source record for record, every component included.

Without the pipeline folder nothing can re-run the text encoder or the VAE: the replay is
refused with one line (it never falls back to the transformer stage alone, whose diff against
the source could only be inconclusive). A chain replay runs in one process on the CPU, as
``run --prompt`` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from drifttool.chain import prepare
from drifttool.chain_edit import prepare_edit
from drifttool.errors import DriftToolError
from drifttool.runner import execute
from drifttool.sampling.step import StepOutput
from drifttool.training.options import RerunOptions
from drifttool.training.stored import StoredRollout, source_record
from drifttool.training.trainer import prepare_trainer

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.distributed import DistContext
    from drifttool.distributed.plan import ParallelDims
    from drifttool.settings import RunSpec

SECTIONS = ("chain", "edit")
"""Manifest sections of runs whose stages around the trajectory a replay re-runs."""


def chain_section(manifest: dict[str, Any]) -> str | None:
    """``chain`` or ``edit`` when the manifest's run has stages around the trajectory, else None."""
    return next((k for k in SECTIONS if isinstance(manifest.get(k), dict)), None)


def _pipeline(stored: StoredRollout, options: RerunOptions, section: str) -> Path:
    folder = options.checkpoint or stored.manifest[section].get("pipeline")
    if folder is None or not Path(folder).is_dir():
        what = "a prompt run" if section == "chain" else "an edit run from images"
        raise DriftToolError(f"{stored.path}: a replay of {what} re-runs every stage and needs its "
                             f"pipeline folder {folder} (not found); pass --checkpoint PIPELINE_DIR")
    return Path(folder)


def _condition_images(stored: StoredRollout) -> list[Path]:
    """The recorded condition images, each checked against its recorded SHA-256.

    Raises:
        DriftToolError: an image missing or changed since the run.
    """
    out = []
    for rec in stored.manifest["edit"].get("condition_images", []):
        p = Path(rec["path"])
        if not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != rec["sha256"]:
            raise DriftToolError(f"{stored.path}: condition image {p} is missing or changed since the "
                                 "run (its SHA-256 differs from the manifest's)")
        out.append(p)
    return out


def replay_chain(
    stored: StoredRollout,
    spec: "RunSpec",
    out: str | Path,
    options: RerunOptions,
    *,
    max_steps: int | None = None,
    on_step: Callable[[StepOutput], Any] | None = None,
    dist: "DistContext | None" = None,
    parallel: "ParallelDims | None" = None,
) -> dict[str, Any]:
    """Re-run every stage of ``stored`` (module docstring) into ``out``; ``execute``'s summary.

    ``spec`` is the replay's (``replay.replay_spec``); its checkpoint becomes the pipeline
    folder.

    Raises:
        DriftToolError: no pipeline folder; a condition image missing or changed; several ranks
            or a parallel layout; as ``chain.prepare``, ``chain_edit.prepare_edit`` and
            ``runner.execute`` (a fingerprint mismatch of the transformer, say).
    """
    section = chain_section(stored.manifest)
    if (dist is not None and dist.distributed) or (parallel is not None and parallel.parallel):
        raise DriftToolError(f"{stored.path}: a replay of a {section} run re-runs every stage in one "
                             "process (no torchrun, --tp, --sp or --cfg-parallel)")
    folder = _pipeline(stored, options, section)
    options = dataclasses.replace(options, checkpoint=folder)
    spec = dataclasses.replace(spec, checkpoint=folder)
    rec = stored.manifest[section]
    if section == "chain":
        spec, stages = prepare(spec, out, prompts=rec["prompts"], negative_prompts=rec.get("negative_prompts"),
                               overwrite=options.overwrite)
    else:
        if "vae_image_area" not in rec:
            raise DriftToolError(f"{stored.path}: an edit run recorded before drifttool resized condition "
                                 "images as the pipelines do (no vae_image_area): run it again")
        spec, stages = prepare_edit(spec, out, condition_images=_condition_images(stored),
                                    prompts=rec.get("prompts"), negative_prompts=rec.get("negative_prompts"),
                                    positions=rec.get("prompt_positions", "rope_index"),
                                    vae_area=rec["vae_image_area"], prompt_area=rec.get("prompt_image_area"),
                                    overwrite=options.overwrite)
    model = prepare_trainer(stored, options)
    inputs = fresh_inputs(stored, stages.external)
    return execute(spec, out, overwrite=options.overwrite, on_step=on_step, model=model,
                   replay_inputs=(inputs, stored.noise_record), stages=stages,
                   manifest_extra={"replay_of": source_record(stored)}, max_steps=max_steps)


def fresh_inputs(stored: StoredRollout, external) -> Any:
    """The stored replay inputs with what the early stages made anew in place of the stored:
    the prompt embeddings and masks (a prompt run) or the condition latents (an edit run; one
    row per sample, as ``sampling.inputs.build_inputs`` repeats them)."""
    inputs = stored.inputs
    if external.txt is not None:
        def _mask(m):
            return None if m is None or bool(m.all()) else m

        inputs = dataclasses.replace(inputs, txt=external.txt, txt_mask=_mask(external.txt_mask),
                                     neg_txt=external.neg_txt, neg_mask=_mask(external.neg_mask))
    if external.cond is not None:
        cond = external.cond
        if cond.shape[0] == 1 and inputs.batch > 1:
            cond = cond.expand(inputs.batch, -1, -1).contiguous()
        inputs = dataclasses.replace(inputs, cond=cond, cond_grids=tuple(external.cond_grids))
    return inputs
