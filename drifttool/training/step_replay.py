"""Re-execute one step of a stored rollout at a finer capture level (``drifttool diff --localize``).

    >>> stored = load_rollout("runs/a", need_latents=False)    # (variants=... if it used any)
    >>> model = step_model(stored)                          # the manifest's model, checked
    >>> r = replay_step(stored, 2, "loc/a", model=model)    # step 2 at L2, attention unfused
    >>> r.reproduced, r.seconds                              # stored step bytes reproduced?
    (True, 0.41)

The step runs as the rollout ran it (``sampling.rollout.rollout_step``): the run's model (fixture
or checkpoint, dtype, weight variant, LoRA adapter; fingerprint-checked by
``training.trainer.prepare_trainer``), the run's mode, sampler settings (sigma table, timestep
policy, CFG scale and layout, SDE window and η) and replay inputs (prompts, masks, pinned noise of
that step), and as input latent the bytes of the step's stored ``x_t`` records (one per logical
sample, branch ``cfg`` with CFG on, else ``cond``; each re-digested against its record). The
capture level defaults to L2, where fused operators run as their decomposition so that their
internals are captured (``Runtime.wants_internals``; e.g. joint attention as qk / softmax / av).

The artifact is a rollout artifact holding the sigma table (step −1) and the one step, marked
``complete: false`` (it is not a whole trajectory) and ``replay_of`` the source run. After it is
written, its step records are compared by digest with the source run's records of the same step
(``StepReplay.reproduced``): in strict mode they are equal; a production run may differ, since
at L2 its fused attention runs unfused.

Operator variants (probes) cannot be rebuilt from the manifest, which lists only their names: a
run that used them is refused unless the same variants are passed (``variants``), fresh
instances of the same classes (a variant may count its calls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow.compute as pc
import torch

from drifttool.artifact.reader import Run, open_run
from drifttool.capture.digest import digest_tensor, dtype_from_name
from drifttool.diff.uncaptured import declared
from drifttool.environment import environment
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.fingerprint import arch_fingerprint, sampler_record
from drifttool.lifecycle import ArtifactSession
from drifttool.model.lora import has_lora
from drifttool.model.lora_io import lora_record
from drifttool.model.weights import weight_digest
from drifttool.runtime import Mode
from drifttool.sampling.inputs import replay_tensors
from drifttool.sampling.rollout import rollout_step
from drifttool.sampling.step import sampler_model
from drifttool.setting_checks import check_level
from drifttool.training.options import RerunOptions
from drifttool.training.pipeline_replay import is_pipeline_capture, pipeline_transformer
from drifttool.training.stored import StoredRollout, refuse_same_dir, source_record
from drifttool.training.trainer import prepare_trainer, rerun_device

Variants = dict[str, tuple[str, Callable[..., Any]]]
"""``{op: (variant_name, fn)}`` as ``RunSpec.variants`` takes them."""


@dataclass(kw_only=True)
class StepReplay:
    """One re-executed step.

    Attributes:
        out: the artifact written. step: the step re-executed. level: its capture level.
        seconds: wall time of the step itself (sigma table, forwards, CFG, SDE step, capture and
            records), without loading the model or opening the source.
        reproduced: every step record of the step has the digest of the source run's record.
        mismatches: the step records that differ from the source's (``"v_t cfg sample 1"``) or
            that one side lacks.
    """

    out: Path
    step: int
    level: str
    seconds: float
    reproduced: bool
    mismatches: list[str] = field(default_factory=list)


def check_variants(path: str | Path, manifest: dict[str, Any], variants: Variants | None) -> Variants:
    """The variants for a re-execution of the run at ``path``: ``variants`` when their
    ``op=name`` list is the manifest's ``variants``, ``{}`` for a run without any.

    Raises:
        DriftToolError: the run replaced operators and none (or others) are given, or variants
            are given for a run that used none.
    """
    want = sorted(manifest.get("variants") or [])
    given = dict(variants or {})
    got = sorted(f"{op}={name}" for op, (name, _) in given.items())
    if want and not given:
        raise DriftToolError(
            f"{path}: the run replaced operators ({', '.join(want)}); the manifest names them "
            "but cannot re-create them, so its step cannot be re-executed from the command line "
            "(pass the same variants to drifttool.training.localize.localize)")
    if want != got:
        raise DriftToolError(f"{path}: the variants given ({', '.join(got) or 'none'}) are "
                             f"not the run's ({', '.join(want) or 'none'})")
    return given


def step_model(stored: StoredRollout, options: RerunOptions = RerunOptions(), model=None):
    """The model that re-executes a step of ``stored``: ``model`` or the one its manifest names
    (``training.trainer.prepare_trainer``), fingerprint-checked either way. A captured diffusers
    pipeline call's is its transformer from ``options.checkpoint`` (the pipeline folder,
    ``pipeline_replay.pipeline_transformer``) driven through ``DiffusersQwenImage``.

    Raises:
        DriftToolError: the run used another model implementation (``model_source``) and no
            model is given (nor, for a pipeline capture, a checkpoint); the fixture or
            checkpoint cannot be loaded; fingerprint mismatch.
    """
    if model is None and is_pipeline_capture(stored.manifest):
        from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage  # lazy: diffusers

        model = DiffusersQwenImage(pipeline_transformer(stored, options.checkpoint,
                                                        rerun_device(stored, options)))
    if stored.manifest.get("model_source") and model is None:
        raise DriftToolError(f"{stored.path}: the run used another model implementation "
                             f"({stored.manifest['model_source'].get('implementation')!r}); its "
                             "step can be re-executed only with that model passed in")
    return prepare_trainer(stored, options, model)


def model_device(model) -> torch.device:
    """The device of ``model``'s parameters (the CPU for a model without any): where a step
    re-executed with it runs, and so where its inputs must be."""
    first = next(iter(model.parameters()), None)
    return torch.device("cpu") if first is None else first.device


def step_input(run: Run, stored: StoredRollout, step: int) -> torch.Tensor:
    """[B, N, Cp] x_t of ``step`` from the run's stored step records (batch rows in the order of
    ``stored.inputs.sample_ids``, the stored dtype and bytes; each record re-digested).

    Raises:
        ArtifactError: a sample without an x_t record of that step (an incomplete run), two
            ranks' records of one sample that differ, bytes that do not match their digest, or
            a shape other than the replay inputs'.
    """
    inputs = stored.inputs
    cfg_on = stored.sampler.cfg_scale > 1 and inputs.neg_txt is not None
    t = run.steps_table()
    t = t.filter(pc.and_(pc.and_(pc.equal(t["phase"], "rollout"), pc.equal(t["step"], step)),
                         pc.and_(pc.equal(t["quantity"], "x_t"),
                                 pc.equal(t["branch"], "cfg" if cfg_on else "cond"))))
    rows: dict[int, dict] = {}
    for r in t.sort_by("rank").to_pylist():
        first = rows.setdefault(r["sample"], r)
        if first["digest"] != r["digest"]:
            raise ArtifactError(f"{run.path}: x_t of step {step} sample {r['sample']} differs "
                                f"between ranks {first['rank']} and {r['rank']}")
    missing = [s for s in inputs.sample_ids if s not in rows]
    if missing:
        raise ArtifactError(f"{run.path}: no stored x_t of step {step} for sample(s) {missing} "
                            f"(an incomplete run): step {step} cannot be re-executed")
    xs = []
    for sid in inputs.sample_ids:
        r = rows[sid]
        x = torch.frombuffer(bytearray(r["data"]), dtype=torch.uint8)
        x = x.view(dtype_from_name(r["dtype"])).reshape(r["shape"])
        if digest_tensor(x).digest != r["digest"]:
            raise ArtifactError(f"{run.path}: the bytes of x_t of step {step} sample {sid} do not "
                                "match their digest (tampered or corrupt)")
        if tuple(x.shape) != tuple(inputs.x0.shape[1:]):
            raise ArtifactError(f"{run.path}: x_t of step {step} sample {sid} has shape "
                                f"{tuple(x.shape)}, the replay inputs {tuple(inputs.x0.shape[1:])}")
        xs.append(x)
    return torch.stack(xs)  # [B, N, Cp]


def _step_digests(run: Run, step: int) -> dict[tuple[str, str, int], int]:
    """``{(quantity, branch, sample): digest}`` of the phase-rollout step records of ``step``."""
    t = run.steps_table()
    t = t.filter(pc.and_(pc.equal(t["phase"], "rollout"), pc.equal(t["step"], step)))
    t = t.select(["quantity", "branch", "sample", "digest"]).to_pylist()
    return {(r["quantity"], r["branch"], r["sample"]): r["digest"] for r in t}


def compare_step(source: Run, replayed: Run, step: int) -> list[str]:
    """The step records of ``step`` that differ between the source run and its re-execution
    (by digest), or that one of them lacks; ``[]`` when the re-execution reproduced them.
    Quantities the source declares uncaptured (``diff.uncaptured``: a pipeline capture has no
    mu, std_t or logp_t) are not compared, as the diff leaves them out."""
    a, b = _step_digests(source, step), _step_digests(replayed, step)
    skipped, _ = declared(source.manifest)
    out = []
    for key in sorted(k for k in set(a) | set(b) if k[0] not in skipped):
        q, branch, sample = key
        if a.get(key) != b.get(key):
            what = "missing in the re-execution" if key not in b else (
                "not in the source run" if key not in a else "differs")
            out.append(f"{q} {branch} sample {sample} {what}")
    return out


def replay_step(
    stored: StoredRollout,
    step: int,
    out: str | Path,
    *,
    model,
    level: str = "L2",
    variants: Variants | None = None,
    overwrite: bool = False,
) -> StepReplay:
    """Re-execute step ``step`` of ``stored`` at capture level ``level`` into the artifact ``out``
    (module docstring) and compare its step records with the stored ones.

    Args:
        model: the model ``step_model`` returned for ``stored``.
        variants: the run's operator variants (``check_variants``).

    Raises:
        ArtifactError: the step's x_t is not stored; ``out`` cannot be created.
        DriftToolError: a run of mode ``off`` (nothing captured), a step outside the run,
            variants that are not the run's.
    """
    refuse_same_dir(stored, out)
    level = check_level(level)
    mode = Mode(stored.settings.get("mode", "strict"))
    if not mode.captures:
        raise DriftToolError(f"{stored.path}: a run of mode off captured no step records; "
                             "there is no step to re-execute")
    sampler = stored.sampler
    if not 0 <= int(step) < sampler.num_steps:
        raise DriftToolError(f"{stored.path}: step {step} outside the run's {sampler.num_steps} steps")
    variants = check_variants(stored.path, stored.manifest, variants)
    source = open_run(stored.path)
    # the replay inputs and the stored x_t are read on the CPU; the step runs where the model is
    device = model_device(model)
    x = step_input(source, stored, int(step)).to(device)
    inputs = stored.inputs.to(device)
    session = ArtifactSession(mode=mode, level=level, cfg_layout=sampler.cfg_layout,
                              variants=variants)
    sigmas = session.sigma_table(sampler, stored.inputs.img_grid)
    fingerprint = arch_fingerprint(
        arch=model.config.arch_fields(), img_grid=stored.inputs.img_grid,
        weights=weight_digest(model), dtype=model.dtype, mode=mode.value,
        sampler=sampler_record(sampler, sigmas), noise_record=stored.noise_record)
    manifest: dict[str, Any] = {
        "kind": "rollout", "fingerprint": fingerprint,
        # the internals are captured here whatever the stored run left out (``--no-internals``)
        "settings": {**{k: v for k, v in stored.settings.items() if k != "internals"}, "capture": level},
        "environment": environment(),
        "replay": dict(stored.manifest.get("replay") or {}),
        "variants": sorted(stored.manifest.get("variants") or []),
        "replay_of": source_record(stored),
    }
    if stored.manifest.get("model_source"):
        manifest["model_source"] = stored.manifest["model_source"]
    if has_lora(model):
        manifest["lora"] = lora_record(model)
    with session.open(out, manifest, overwrite=overwrite):
        session.write_inputs(replay_tensors(stored.inputs))
        t0 = time.perf_counter()
        rollout_step(sampler_model(model), inputs, sampler, session.rt, int(step), x)
        seconds = time.perf_counter() - t0
        session.finish(complete=False, seconds=round(seconds, 6))
    mismatches = compare_step(source, open_run(out), int(step))
    return StepReplay(out=Path(out), step=int(step), level=level, seconds=seconds,
                      reproduced=not mismatches, mismatches=mismatches)
