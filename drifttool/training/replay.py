"""Replay: re-execute a rollout from its stored replay inputs with the manifest's settings and model.

    >>> replay_run("runs/a", "runs/a-replay")               # re-sample from the replay inputs
    >>> diff_runs(open_run("runs/a"), open_run("runs/a-replay")).verdict   # strict
    <Verdict.IDENTICAL: 'identical'>

The replay is an ordinary ``drifttool.runner.execute`` whose inputs are the stored ones (x0, SDE
noise, prompts, masks) and whose ``RunSpec`` is the stored settings with the ``RerunOptions``
over them; its manifest adds ``replay_of`` (the source run).

**Layouts.** A replay runs in the layout it is given, not the stored run's: ``dist`` and
``parallel`` are ``execute``'s (under torchrun: sample-parallel, or a TP/SP/CFG-parallel plan),
so a one-process run replayed under ``--tp 2`` and a ``--tp 2`` run replayed in one process both
diff identical to their source (strict arithmetic does not depend on the layout).

    $ torchrun --standalone --nproc-per-node 2 -m drifttool replay runs/a --tp 2 -o runs/a-tp2
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from drifttool.artifact.reader import open_run
from drifttool.artifact.schema import MANIFEST
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.runner import execute
from drifttool.sampling.step import StepOutput
from drifttool.setting_checks import PATCH_PIXELS, check_mode, check_mode_device
from drifttool.settings import RunSpec
from drifttool.training.chain_replay import chain_section, replay_chain
from drifttool.training.options import RerunOptions
from drifttool.training.pipeline_replay import is_pipeline_capture, replay_pipeline
from drifttool.training.stored import StoredRollout, load_rollout, refuse_same_dir, source_record
from drifttool.training.trainer import prepare_trainer, rerun_device

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.distributed import DistContext
    from drifttool.distributed.plan import ParallelDims

_SPEC_KEYS = ("steps", "cfg_scale", "eta", "seed", "samples", "dtype", "cfg_layout",
              "timestep_policy", "pad_prompts_to", "sample_labels", "lora", "lora_mode", "variant",
              "preset")
"""Stored settings carried into the replay's ``RunSpec`` (mode, capture, fixture and checkpoint
come from the options first)."""


def replay_spec(stored: StoredRollout, options: RerunOptions) -> RunSpec:
    """The ``RunSpec`` of a replay of ``stored``: its settings, the options over them (the
    stored weight variant belongs to the stored checkpoint: an overriding checkpoint drops it;
    the device is the options', else the rollout's). The image grid and the prompts are those
    of the stored inputs (``replay_inputs``), never drawn anew.

    Raises:
        ArtifactError: the stored settings name no sample (``settings.samples`` empty)."""
    s = stored.settings
    if s.get("samples") == []:  # (resolve would ask for a --samples flag replay does not have)
        raise ArtifactError(f"{stored.path / MANIFEST}: corrupt manifest (settings.samples is empty: "
                            "the run names no sample to replay)")
    keys = [k for k in _SPEC_KEYS if not (k == "variant" and options.checkpoint)]
    kw = {k: s[k] for k in keys if s.get(k) is not None}
    h, w = (int(g) * PATCH_PIXELS for g in stored.inputs.img_grid)
    return RunSpec(**kw, fixture=options.fixture or s.get("fixture"), height=h, width=w,
                   checkpoint=options.checkpoint or s.get("checkpoint"),
                   device=rerun_device(stored, options),
                   mode=options.mode or s.get("mode", "strict"),
                   capture=options.capture or stored.manifest.get("capture_level"),
                   internals=options.rerun_internals(s))


def replay_run(
    source: str | Path,
    out: str | Path,
    options: RerunOptions = RerunOptions(),
    *,
    model=None,
    on_step: Callable[[StepOutput], Any] | None = None,
    dist: "DistContext | None" = None,
    parallel: "ParallelDims | None" = None,
) -> dict[str, Any]:
    """Re-execute a rollout from its stored replay inputs (x0, SDE noise, prompts, masks) with the
    manifest's settings and model, on the options' device (default: the rollout's); writes a
    rollout artifact with ``replay_of``. In strict mode
    ``drifttool diff SOURCE OUT`` is identical. An incomplete source (a run that was stopped)
    is replayed up to the steps it finished (``finished_steps``), never further: the replay is
    then ``complete: false`` too, and the summary's ``note`` says so.

    A captured diffusers pipeline call (``capture_pipeline``) is re-executed through the
    pipeline itself (``pipeline_replay.replay_pipeline``: ``options.checkpoint`` is its folder),
    in one process. A chain run (``run --prompt``) or an edit run from condition images re-runs
    every stage — text encoder or VAE encode, trajectory, VAE decode — from its pipeline folder
    (``chain_replay.replay_chain``), in one process.

    ``dist`` and ``parallel`` place the replay on ranks as ``runner.execute`` does (default one
    process): the stored run's own layout is not re-created, and need not be. Under torchrun the
    model loads onto the rank's ``dist.device`` (``cuda:LOCAL_RANK`` on a GPU).

    Raises:
        ArtifactError: no or tampered replay inputs, unreadable manifest.
        DriftToolError: fingerprint mismatch, bad settings, a run that replaced operators,
            another model implementation not passed as ``model``, or an incomplete run that
            finished no step.
    """
    refuse_same_dir(source, out)
    stored = load_rollout(source, need_latents=False)
    if stored.manifest.get("variants"):
        raise DriftToolError(f"{stored.path}: the run replaced operators ({', '.join(stored.manifest['variants'])}); "
                             "a replay cannot re-create them (use the probe that made it)")
    if is_pipeline_capture(stored.manifest) and model is None:
        if (dist is not None and dist.distributed) or (parallel is not None and parallel.parallel):
            raise DriftToolError(f"{stored.path}: a captured diffusers pipeline replays in one "
                                 "process (no torchrun, --tp, --sp or --cfg-parallel)")
        return replay_pipeline(stored, out, options)  # the pipeline folder: options.checkpoint
    if stored.manifest.get("model_source") and model is None:
        src = stored.manifest["model_source"]
        name = src.get("implementation", "another implementation") if isinstance(src, dict) else src
        raise DriftToolError(f"{stored.path}: captured from {name}, not drifttool's model: the CLI "
                             "cannot re-create it (in Python, pass that model to "
                             "drifttool.training.replay.replay_run(model=...))")
    spec = replay_spec(stored, options)
    check_mode_device(check_mode(spec.mode), spec.device)  # before the model loads
    upto = None if stored.complete else finished_steps(stored)
    if upto == 0:
        raise DriftToolError(f"{stored.path}: the run stopped before it finished a step (0 of its "
                             f"{stored.sampler.num_steps}): nothing to replay")
    if chain_section(stored.manifest) is not None and model is None:  # every stage again
        summary = replay_chain(stored, spec, out, options, max_steps=upto, on_step=on_step,
                               dist=dist, parallel=parallel)
        return _incomplete_note(summary, stored, upto)
    load = options
    if dist is not None and dist.distributed and dist.device.type == spec.device.split(":")[0]:
        load = dataclasses.replace(options, device=str(dist.device))  # this rank's own device
    model = prepare_trainer(stored, load, model)
    summary = execute(spec, out, overwrite=options.overwrite, on_step=on_step,
                      model=model, replay_inputs=(stored.inputs, stored.noise_record),
                      manifest_extra={"replay_of": source_record(stored)}, dist=dist,
                      parallel=parallel, max_steps=upto)
    return _incomplete_note(summary, stored, upto)


def _incomplete_note(summary: dict[str, Any], stored: StoredRollout, upto: int | None) -> dict[str, Any]:
    if upto is not None:
        summary["note"] = (f"the source run is incomplete: replayed the {upto} of its "
                           f"{stored.sampler.num_steps} steps it finished; the replay is "
                           "incomplete too")
    return summary


def finished_steps(stored: StoredRollout) -> int:
    """How many steps (0, 1, ... in order) of an incomplete rollout were finished: those whose
    ``x_next`` record (phase ``rollout``) every sample has. Reads the step records."""
    t = open_run(stored.path).steps_table().to_pylist()
    done: dict[int, set[int]] = {}
    for r in t:
        if r["phase"] == "rollout" and r["quantity"] == "x_next" and r["step"] >= 0:
            done.setdefault(r["step"], set()).add(r["sample"])
    want, n = set(stored.inputs.sample_ids), 0
    while want <= done.get(n, set()):
        n += 1
    return n
