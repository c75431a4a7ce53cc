"""Replay a captured diffusers pipeline call (``capture_pipeline``) from its artifact.

    $ drifttool replay runs/pipe --checkpoint Qwen-Image -o runs/pipe-replay   # the pipeline folder
    $ drifttool diff runs/pipe runs/pipe-replay                                 # identical
    >>> replay_pipeline(load_rollout("runs/pipe", need_latents=False), "runs/pipe-replay",
    ...                 RerunOptions(checkpoint="Qwen-Image"))

A pipeline artifact records the call, not the pipeline: its manifest names the pipeline class,
its scheduler's class and configuration (``model_source``), the transformer's dtype and weight
digest (``fingerprint``), the call's settings (steps, ``true_cfg_scale``, image grid) and its
replay inputs: the initial latents and the prompt embeddings with their masks as the
transformer received them (``inputs.safetensors``, upcast exactly to fp32). The replay rebuilds
the same call: the transformer from the given folder (a pipeline folder's ``transformer/`` or a
transformer folder, ``diffusers.QwenImageTransformer2DModel.from_pretrained`` in the recorded
dtype, its weight digest checked against the fingerprint before anything runs), the scheduler
from the recorded class and configuration, an unmodified ``QwenImagePipeline`` around them
(no text encoder or VAE: the embeddings are passed, ``output_type="latent"``), called with the
stored latents and embeddings cast back to the pipeline's latent dtype (exact: they were upcast
from it), and captured again with ``capture_pipeline``; the new manifest adds ``replay_of``.

Refused, one line each: no ``--checkpoint``; weights other than the recorded ones; a mode other
than ``auto`` (the pipeline runs diffusers' own kernels); a LoRA adapter (replay it in Python
with the adapter loaded); a call captured with stages around the loop (text encoder, VAE: the
manifest's ``stages``; the replay re-runs the loop only, so call ``capture_pipeline`` on the whole
pipeline instead); an incomplete source; a run laid over several ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drifttool.errors import DriftToolError
from drifttool.model.weights import weight_digest
from drifttool.setting_checks import DTYPES, check_level
from drifttool.training.options import RerunOptions
from drifttool.training.stored import StoredRollout, source_record
from drifttool.training.trainer import rerun_device

ADAPTER = "drifttool.adapters.diffusers_pipeline"
"""``model_source.adapter`` of a captured pipeline call."""

PIXELS_PER_GRID_CELL = 16
"""Image pixels per latent grid cell: the VAE's 8× and the 2×2 patch (``img_grid`` = size / 16)."""


def is_pipeline_capture(manifest: dict[str, Any]) -> bool:
    """Whether ``manifest`` is a ``capture_pipeline`` artifact's."""
    src = manifest.get("model_source")
    return isinstance(src, dict) and src.get("adapter") == ADAPTER


def _diffusers():
    """diffusers, or one line saying it is needed (an optional dependency)."""
    try:
        import diffusers
    except ModuleNotFoundError:
        raise DriftToolError("replaying a captured diffusers pipeline needs diffusers "
                             "(pip install 'diffusers>=0.42,<0.43')") from None
    return diffusers


def _scheduler(stored: StoredRollout):
    diffusers = _diffusers()

    src = stored.manifest["model_source"]
    cls = getattr(diffusers, src.get("scheduler", ""), None)
    if cls is None or not hasattr(cls, "from_config"):
        raise DriftToolError(f"{stored.path}: scheduler {src.get('scheduler')!r} is not a diffusers "
                             "scheduler this diffusers has")
    return cls.from_config(src.get("scheduler_config") or {})


def pipeline_transformer(stored: StoredRollout, checkpoint: str | Path | None,
                         device: str) -> torch.nn.Module:
    """The diffusers transformer of a captured pipeline call, from ``checkpoint`` (a pipeline or
    transformer folder) in the recorded dtype on ``device``, its weights checked.

    Raises:
        DriftToolError: no checkpoint; diffusers missing or the folder unloadable; a weight
            digest or dtype other than the fingerprint's.
    """
    _diffusers()
    from drifttool.adapters.diffusers_qwenimage import (  # lazy: diffusers, only for a pipeline
        DiffusersQwenImage, load_transformer)

    name = stored.manifest["model_source"].get("implementation", "a diffusers pipeline")
    if checkpoint is None:
        raise DriftToolError(f"{stored.path}: captured from {name}: pass --checkpoint with the "
                             "pipeline's folder (or hub id) to re-execute it")
    dtype = DTYPES[stored.settings["dtype"]]
    transformer = load_transformer(checkpoint, dtype).to(device)
    digest = weight_digest(DiffusersQwenImage(transformer))
    recorded = stored.manifest["fingerprint"].get("weights")
    if digest != recorded:
        raise DriftToolError(f"{checkpoint}: its transformer's weights ({digest}) are not the "
                             f"captured run's ({recorded})")
    return transformer


def replay_pipeline(stored: StoredRollout, out: str | Path,
                    options: RerunOptions = RerunOptions()) -> dict[str, Any]:
    """Re-execute the captured pipeline call of ``stored`` (module docstring) into ``out``.

    Returns:
        ``{"mode", "capture", "steps", "samples", "complete"}`` as ``replay_run``'s summary.

    Raises:
        DriftToolError: as the module docstring lists; ``pipeline_transformer``'s refusals.
        ArtifactError: ``out`` cannot be created (``capture_pipeline``).
    """
    s, m = stored.settings, stored.manifest
    if options.mode not in (None, "auto"):
        raise DriftToolError(f"{stored.path}: a captured diffusers pipeline runs diffusers' own "
                             f"kernels (mode auto); --mode {options.mode} cannot re-create it")
    if m.get("lora"):
        raise DriftToolError(f"{stored.path}: captured with a LoRA adapter; replay it in Python "
                             "(capture_pipeline with the adapter loaded)")
    around = [st["stage"] for st in m.get("stages", []) if st["stage"] != "transformer"]
    if around:
        raise DriftToolError(f"{stored.path}: captured with its {', '.join(around)} stage(s); a replay "
                             "re-runs the denoising loop only: call capture_pipeline on the whole "
                             "pipeline instead")
    if not stored.complete:
        raise DriftToolError(f"{stored.path}: an incomplete pipeline capture (complete=false) "
                             "cannot be replayed: the pipeline call runs whole")
    if m.get("layout", {}).get("world_size", 1) != 1:
        raise DriftToolError(f"{stored.path}: captured on several ranks; a pipeline replays in "
                             "one process")
    level = check_level(options.capture or m.get("capture_level") or "L1")
    device = rerun_device(stored, options)
    transformer = pipeline_transformer(stored, options.checkpoint, device)

    from drifttool.adapters.diffusers_pipeline import capture_pipeline  # lazy: diffusers, likewise

    pipe = _diffusers().QwenImagePipeline(scheduler=_scheduler(stored), vae=None, text_encoder=None,
                             tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    inputs = stored.inputs
    lat = DTYPES.get(m["fingerprint"]["dtype_policy"]["latents_between_steps"])
    if lat is None:
        raise DriftToolError(f"{stored.path}: latent dtype "
                             f"{m['fingerprint']['dtype_policy']['latents_between_steps']!r} "
                             "is not one drifttool replays")
    h, w = (int(g) * PIXELS_PER_GRID_CELL for g in inputs.img_grid)
    kwargs: dict[str, Any] = dict(
        latents=inputs.x0.to(device=device, dtype=lat),
        prompt_embeds=inputs.txt.to(device=device, dtype=lat),
        prompt_embeds_mask=None if inputs.txt_mask is None else inputs.txt_mask.to(device),
        true_cfg_scale=float(s["cfg_scale"]), height=h, width=w,
        num_inference_steps=int(s["steps"]), max_sequence_length=int(inputs.txt.shape[1]))
    if inputs.neg_txt is not None:
        kwargs.update(negative_prompt_embeds=inputs.neg_txt.to(device=device, dtype=lat),
                      negative_prompt_embeds_mask=None if inputs.neg_mask is None
                      else inputs.neg_mask.to(device))
    run = capture_pipeline(pipe, out, level=level, overwrite=options.overwrite,
                           manifest_extra={"replay_of": source_record(stored)}, **kwargs)
    return {"mode": "auto", "capture": level, "steps": run.steps, "samples": run.samples,
            "complete": run.complete}
