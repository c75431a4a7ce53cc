"""Load a rollout artifact for replay or training recompute, verifying every byte it uses.

    >>> stored = load_rollout("runs/a")                  # complete rollout, latents verified
    >>> stored.latents.shape, stored.sampler.num_steps    # [S + 1, B, N, Cp]
    (torch.Size([5, 2, 24, 64]), 4)
    >>> load_rollout("runs/a", need_latents=False)       # replay: inputs only

``load_rollout`` reads and checks every file of a rollout artifact (``Run.check``) before anything
is re-executed or written, and refuses anything it cannot trust: a damaged file, an incomplete run,
missing step records, stored latents whose bytes do not match their recorded digests, a broken
latent chain (x_next of step i must be the x_t of step i + 1, x_t of step 0 the stored x0),
replay inputs whose digests differ from the manifest's, a sigma table other than the one the
manifest pins (recomputed through ``sampling.rollout.sigma_table`` under the rollout's mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch

from drifttool.artifact.reader import open_run
from drifttool.capture.digest import digest_tensor, dtype_from_name
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.fingerprint import tensor_digest
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.inputs import RolloutInputs, inputs_from_tensors
from drifttool.sampling.presets import apply_preset
from drifttool.sampling.rollout import sigma_table

LATENT_QUANTITIES = ("x_t", "x_next")


@dataclass(kw_only=True)
class StoredRollout:
    """A verified rollout artifact.

    Attributes:
        path, manifest, settings: the artifact, its manifest and ``settings``.
        sampler: the ``SamplerConfig`` the manifest pins (fingerprint scheduler/cfg/sde).
        inputs: the replay inputs (``inputs.safetensors``).
        noise_record: the manifest's noise record.
        latents: [num_steps + 1, B, N, Cp] stored x_0 … x_N in their stored dtype (None when
            not loaded); ``latent_dtype`` its name.
        logp: [num_steps, B] fp32 stored logp_t (NaN where absent).
        complete: the manifest's flag.
    """

    path: Path
    manifest: dict[str, Any]
    settings: dict[str, Any]
    sampler: SamplerConfig
    inputs: RolloutInputs
    noise_record: dict[str, Any] | None
    latents: torch.Tensor | None
    latent_dtype: str | None
    logp: torch.Tensor | None
    complete: bool


def sampler_from_manifest(manifest: dict[str, Any]) -> SamplerConfig:
    """The ``SamplerConfig`` pinned in a manifest's fingerprint, with the settings' production
    preset (``sampling.presets``) applied when the run had one.

    Raises:
        ArtifactError: fields missing or invalid.
    """
    fp = manifest.get("fingerprint") or {}
    settings = manifest.get("settings") or {}
    try:
        sch, cfg, sde = fp["scheduler"], fp["cfg"], fp["sde"]
        window = sde.get("sde_window")
        sampler = SamplerConfig(
            num_steps=int(sch["num_steps"]), cfg_scale=float(cfg["cfg_scale"]),
            eta=float(sde["eta"]), sde_window=None if window is None else tuple(int(w) for w in window),
            timestep_policy=sch["timestep_policy"], cfg_layout=cfg["cfg_layout"],
            image_seq_len=sch.get("image_seq_len"),
        )
        if settings.get("preset") is None:
            return sampler
        return apply_preset(sampler, settings["preset"], dtype_from_name(settings["dtype"]))
    except (KeyError, TypeError, ValueError, DriftToolError) as e:
        raise ArtifactError(f"manifest fingerprint lacks a usable sampler config ({e!r})") from None


def _tensor(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype_from_name(dtype)).reshape(shape)


def _inputs_from(tensors: dict[str, torch.Tensor], where: Path) -> RolloutInputs:
    # re-hashed against the manifest's input_digests when the run was opened (check_inputs)
    try:
        return inputs_from_tensors(tensors)
    except KeyError as e:
        raise ArtifactError(f"{where}: inputs.safetensors lacks {e.args[0]} (no replay inputs)") from None
    except ValueError as e:
        raise ArtifactError(f"{where}: inconsistent replay inputs: {e}") from None


def _stored_latents(run, inputs: RolloutInputs, sampler: SamplerConfig, cfg_on: bool,
                    expected_dtype: str | None) -> tuple[torch.Tensor, str, torch.Tensor]:
    """[S+1, B, N, Cp] latents and [S, B] logp from the step records, every byte verified."""
    where = run.path
    t = run.steps_table()
    # every rank's records: rank is the owning rank, not identity (a sample-parallel run holds
    # each sample's records on the rank that ran it); lowest rank first for replicated records
    t = t.filter(pc.equal(t["phase"], "rollout")).sort_by("rank")
    branch = "cfg" if cfg_on else "cond"
    rows: dict[tuple[int, int, str], dict] = {}
    for r in t.filter(pc.equal(t["branch"], branch)).to_pylist():
        if r["quantity"] in (*LATENT_QUANTITIES, "logp_t"):
            key = (r["step"], r["sample"], r["quantity"])
            first = rows.get(key)
            if first is not None:
                # the same record written by several ranks is one record if its bytes agree
                if first["rank"] != r["rank"] and first["digest"] == r["digest"]:
                    continue
                raise ArtifactError(f"{where}: step record {key} occurs twice (ranks {first['rank']} "
                                    f"and {r['rank']}{'' if first['digest'] == r['digest'] else ', different digests'})")
            rows[key] = r
    S, ids = sampler.num_steps, inputs.sample_ids
    lat = torch.empty(S + 1, inputs.batch, *inputs.x0.shape[1:])
    logp = torch.full((S, inputs.batch), float("nan"))
    missing, tampered, dtypes = [], [], set()
    for b, sid in enumerate(ids):
        for i in range(S):
            for q in ("x_t", "x_next") if i == S - 1 else ("x_t",):
                r = rows.get((i, sid, q))
                if r is None:
                    missing.append(f"step {i} sample {sid} {q}")
                    continue
                x = _tensor(r["data"], r["dtype"], r["shape"])
                if digest_tensor(x).digest != r["digest"]:
                    tampered.append(f"step {i} sample {sid} {q}")
                dtypes.add(r["dtype"])
                if tuple(x.shape) != tuple(inputs.x0.shape[1:]):
                    raise ArtifactError(f"{where}: {q} of step {i} sample {sid} has shape "
                                        f"{tuple(x.shape)}, the inputs {tuple(inputs.x0.shape[1:])}")
                lat[i + (q == "x_next"), b] = x.to(torch.float32)
            lp = rows.get((i, sid, "logp_t"))
            if lp is not None:
                x = _tensor(lp["data"], lp["dtype"], lp["shape"])
                if digest_tensor(x).digest != lp["digest"]:
                    tampered.append(f"step {i} sample {sid} logp_t")
                logp[i, b] = x.to(torch.float32)
            if i + 1 < S and (i, sid, "x_next") in rows and (i + 1, sid, "x_t") in rows \
                    and rows[(i, sid, "x_next")]["data"] != rows[(i + 1, sid, "x_t")]["data"]:
                tampered.append(f"x_next of step {i} != x_t of step {i + 1} (sample {sid})")
    if missing:
        raise ArtifactError(f"{where}: incomplete rollout: {len(missing)} latent record(s) missing, "
                            f"first {missing[:3]}")
    if tampered:
        raise ArtifactError(f"{where}: tampered artifact: stored latents do not match their "
                            f"digests or chain: {tampered[:4]}")
    if not torch.equal(lat[0].view(torch.int32), inputs.x0.to(torch.float32).view(torch.int32)):
        raise ArtifactError(f"{where}: tampered artifact: stored x_t of step 0 differs from the "
                            "replay input x0")
    if len(dtypes) != 1:
        raise ArtifactError(f"{where}: stored latents mix dtypes {sorted(dtypes)}")
    dt = dtypes.pop()
    if expected_dtype is not None and dt != expected_dtype:
        raise ArtifactError(f"{where}: stored latents are {dt}, the manifest pins "
                            f"latents_between_steps={expected_dtype}")
    return lat.to(dtype_from_name(dt)), dt, logp


def load_rollout(path: str | Path, *, need_latents: bool = True,
                 variants: dict[str, tuple[str, Any]] | None = None) -> StoredRollout:
    """Open and verify a rollout artifact (module docstring).

    Args:
        need_latents: read and verify the stored trajectory (training recompute). Without it
            (replay) the trajectory is not needed and an incomplete run is accepted; its files
            are still read and checked (``Run.check``), so a damaged one is refused.
        variants: the operator variants the run used (``RunSpec.variants``), applied when the
            sigma table is recomputed (a ``flow_sigma_table`` variant changes it).

    Raises:
        ArtifactError: not a rollout, incomplete (``need_latents``), missing or tampered records
            or inputs, a damaged or unreadable file, a manifest its records contradict.
    """
    run = open_run(path)
    run.check()  # every file read and checked before anything is re-executed or written
    m = run.manifest
    kind = m.get("kind", "rollout")
    if kind != "rollout":
        raise ArtifactError(f"{run.path}: kind {kind!r} is not a rollout artifact")
    if need_latents and not run.complete:
        raise ArtifactError(f"{run.path}: incomplete rollout (manifest complete=false); "
                            "a training recompute needs every step")
    settings = dict(m.get("settings") or {})
    sampler = sampler_from_manifest(m)
    tensors = run.inputs()
    if not tensors:
        raise ArtifactError(f"{run.path}: no replay inputs (inputs.safetensors missing)")
    inputs = _inputs_from(tensors, run.path)
    fp = m["fingerprint"]
    sig = sigma_table(Runtime(mode=settings.get("mode", "strict"), variants=dict(variants or {})),
                      sampler, inputs.img_grid)
    pinned = fp["scheduler"].get("sigma_table_digest")
    if pinned is not None and tensor_digest(sig) != pinned:
        raise ArtifactError(f"{run.path}: the manifest's sigma table digest {pinned} is not the "
                            "table of its scheduler settings")
    latents = latent_dtype = logp = None
    if need_latents:
        cfg_on = sampler.cfg_scale > 1 and inputs.neg_txt is not None
        expected = (fp.get("dtype_policy") or {}).get("latents_between_steps")
        latents, latent_dtype, logp = _stored_latents(run, inputs, sampler, cfg_on, expected)
    return StoredRollout(path=run.path, manifest=m, settings=settings, sampler=sampler,
                         inputs=inputs, noise_record=(m.get("replay") or {}).get("noise"),
                         latents=latents, latent_dtype=latent_dtype, logp=logp,
                         complete=run.complete)


def source_record(stored: StoredRollout) -> dict[str, Any]:
    """The manifest's record of the run a replay (``replay_of``) or recompute (``source``) was
    made from (``manifest_schema._SOURCE``)."""
    return {"path": str(stored.path), "kind": stored.manifest.get("kind", "rollout"),
            "mode": stored.settings.get("mode"), "weights": stored.manifest["fingerprint"].get("weights"),
            "complete": stored.complete, "variants": list(stored.manifest.get("variants") or []),
            "model_source": stored.manifest.get("model_source")}


def refuse_same_dir(source: Any, out: str | Path) -> None:
    """The output must never be the source artifact (``--overwrite`` would destroy it)."""
    src = source.path if isinstance(source, StoredRollout) else source
    if Path(src).resolve() == Path(out).resolve():
        raise DriftToolError(f"{out}: the output directory is the source run itself; choose another -o")
