"""Training recompute and replay from a stored rollout artifact.

    >>> recompute_run("runs/a", "runs/a-train")            # phase "train", autograd on
    >>> diff_runs(open_run("runs/a"), open_run("runs/a-train")).verdict   # strict/strict
    <Verdict.IDENTICAL: 'identical'>
    >>> replay_run("runs/a", "runs/a-replay")               # re-sample from the replay inputs

``load_rollout`` reads and checks every file of a rollout artifact (``Run.check``) before anything
is re-executed or written, and refuses anything it cannot trust: a damaged file, an incomplete run,
missing step records, stored latents whose bytes do not match their recorded digests, a broken
latent chain (x_next of step i must be the x_t of step i + 1, x_t of step 0 the stored x0),
replay inputs whose digests differ from the manifest's, a sigma table other than the one the
manifest pins. ``trainer_model`` rebuilds the model the manifest names (fixture or checkpoint,
dtype, LoRA adapter) and ``check_fingerprint`` refuses one whose architecture or weight digest
differs from the rollout's.

**Pinned policy.** The recompute takes from the rollout manifest, and records in its own under
``policy``: the timestep encoding (``timestep_policy``, numerics §3.4/§5.2), the CFG execution
layout and scale, the SDE settings and sigma table, and the stored-latent dtype: logp_t is
evaluated on the stored bytes of x_t and x_{t+1} (numerics §5.3; ``prev_sample`` = the stored next
latent), never on a re-rounded copy.

**Recompute artifact.** ``kind: "recompute"``; its step and op records use phase ``train`` with
the rollout's identities otherwise, so ``drifttool diff ROLLOUT RECOMPUTE`` aligns phase
``train`` of the recompute with phase ``rollout`` (``drifttool.diff.compare``) and names the first
drifting operator, block, step and row. With ``grad=True`` (needs a LoRA adapter in the rollout)
each SDE step runs ``(−mean_b logp_t).backward()`` right after its forward (Flow-GRPO's per-step
backward, gradients accumulated over steps) and the accumulated LoRA gradients are digested
(role ``grad_weight``) after each step, so two training runs diff at the gradient level.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from drifttool.artifact.reader import open_run
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.digest import digest_tensor, dtype_from_name
from drifttool.capture.recorder import Recorder
from drifttool.digestcore import label
from drifttool.environment import environment
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.fingerprint import arch_fingerprint
from drifttool.model.checkpoint import load_checkpoint, weight_digest
from drifttool.model.lora import capture_lora_grads, has_lora, load_lora, lora_parameters, lora_record
from drifttool.ops.registry import implementation
from drifttool.runner import (
    DTYPES, RunSpec, close_incomplete, execute, replay_tensors, sampler_model, tensor_digest,
)
from drifttool.runtime import Mode, Runtime
from drifttool.sampling.rollout import RolloutInputs, SamplerConfig, StepOutput, recompute

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
    """The ``SamplerConfig`` pinned in a manifest's fingerprint.

    Raises:
        ArtifactError: fields missing or invalid.
    """
    fp = manifest.get("fingerprint") or {}
    try:
        sch, cfg, sde = fp["scheduler"], fp["cfg"], fp["sde"]
        window = sde.get("sde_window")
        return SamplerConfig(
            num_steps=int(sch["num_steps"]), cfg_scale=float(cfg["cfg_scale"]),
            eta=float(sde["eta"]), sde_window=None if window is None else tuple(int(w) for w in window),
            timestep_policy=sch["timestep_policy"], cfg_layout=cfg["cfg_layout"],
            image_seq_len=sch.get("image_seq_len"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"manifest fingerprint lacks a usable sampler config ({e!r})") from None


def _tensor(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype_from_name(dtype)).reshape(shape)


def _inputs_from(tensors: dict[str, torch.Tensor], where: Path) -> RolloutInputs:
    need = [k for k in ("sample_ids", "x0", "txt", "img_grid") if k not in tensors]
    if need:
        raise ArtifactError(f"{where}: inputs.safetensors lacks {need} (no replay inputs)")
    # re-hashed against the manifest's input_digests when the run was opened (check_inputs)
    mask = tensors.get("txt_mask")
    neg_mask = tensors.get("neg_mask")
    inputs = RolloutInputs(
        sample_ids=[int(i) for i in tensors["sample_ids"].tolist()], x0=tensors["x0"],
        txt=tensors["txt"], img_grid=tuple(int(i) for i in tensors["img_grid"].tolist()),
        txt_mask=None if mask is None else mask.to(torch.bool), noise=tensors.get("noise"),
        neg_txt=tensors.get("neg_txt"), neg_mask=None if neg_mask is None else neg_mask.to(torch.bool),
    )
    try:
        inputs.validate()
    except ValueError as e:
        raise ArtifactError(f"{where}: inconsistent replay inputs: {e}") from None
    return inputs


def _stored_latents(run, inputs: RolloutInputs, sampler: SamplerConfig, cfg_on: bool,
                    expected_dtype: str | None) -> tuple[torch.Tensor, str, torch.Tensor]:
    """[S+1, B, N, Cp] latents and [S, B] logp from the step records, every byte verified."""
    import pyarrow.compute as pc

    where = run.path
    t = run.steps_table()
    t = t.filter(pc.and_(pc.equal(t["phase"], "rollout"), pc.equal(t["rank"], 0)))
    branch = "cfg" if cfg_on else "cond"
    rows: dict[tuple[int, int, str], dict] = {}
    for r in t.filter(pc.equal(t["branch"], branch)).to_pylist():
        if r["quantity"] in (*LATENT_QUANTITIES, "logp_t"):
            key = (r["step"], r["sample"], r["quantity"])
            if key in rows:
                raise ArtifactError(f"{where}: step record {key} occurs twice")
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


def load_rollout(path: str | Path, *, need_latents: bool = True) -> StoredRollout:
    """Open and verify a rollout artifact (module docstring).

    Args:
        need_latents: read and verify the stored trajectory (training recompute). Without it
            (replay) the trajectory is not needed and an incomplete run is accepted; its files
            are still read and checked (``Run.check``), so a damaged one is refused.

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
    h, w = inputs.img_grid
    sig = implementation("flow_sigma_table", "strict")(sampler.num_steps, sampler.image_seq_len or h * w)
    pinned = fp["scheduler"].get("sigma_table_digest")
    if pinned is not None and label(digest_tensor(sig).digest) != pinned:
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


def trainer_model(stored: StoredRollout, *, fixture: str | Path | None = None,
                  checkpoint: str | Path | None = None, lora: str | Path | None = None):
    """The model the rollout manifest names (``checkpoint`` setting, else the fixture's model),
    in its dtype, with its LoRA adapter; each can be overridden (checked by
    ``check_fingerprint`` afterwards).

    Raises:
        DriftToolError: the fixture or checkpoint cannot be loaded.
    """
    from drifttool.fixture import load_fixture

    s = stored.settings
    ckpt = checkpoint or s.get("checkpoint")
    if ckpt is None:
        name = fixture or s.get("fixture")
        if name is None:
            raise DriftToolError(f"{stored.path}: the manifest names no fixture or checkpoint; "
                                 "pass one")
        ckpt = load_fixture(name).model_dir
    dtype = DTYPES.get(s.get("dtype", "float32"))
    if dtype is None:
        raise ArtifactError(f"{stored.path}: unsupported model dtype {s.get('dtype')!r}")
    model = load_checkpoint(ckpt, dtype=dtype, variant=None if checkpoint else s.get("variant"))
    adapter = lora or s.get("lora")
    if adapter is not None:
        load_lora(model, adapter)
    return model


def check_fingerprint(stored: StoredRollout, model) -> None:
    """Refuse a trainer model that is not the rollout's: architecture (with the image grid),
    model dtype, weight digest (base and adapter weights), adapter digest.

    Raises:
        DriftToolError: naming every differing field.
    """
    from drifttool.diff.context import dict_differences

    fp = stored.manifest.get("fingerprint") or {}
    arch = {**model.config.arch_fields(), "img_grid": list(stored.inputs.img_grid)}
    diffs = dict_differences(fp.get("arch", {}), arch, "arch")
    dt = str(model.dtype).removeprefix("torch.")
    if (fp.get("dtype_policy") or {}).get("weights") != dt:
        diffs.append(f"dtype: rollout {(fp.get('dtype_policy') or {}).get('weights')!r}, trainer {dt!r}")
    wd = weight_digest(model)
    if fp.get("weights") != wd:
        diffs.append(f"weights: rollout {fp.get('weights')}, trainer {wd}")
    ra = (stored.manifest.get("lora") or {}).get("digest")
    ta = (lora_record(model) or {}).get("digest")
    if ra != ta:
        diffs.append(f"lora adapter: rollout {ra}, trainer {ta}")
    if diffs:
        raise DriftToolError(f"{stored.path}: the rollout's fingerprint differs from the trainer's "
                             "model: " + "; ".join(diffs))


def micro_batched(forward: Callable[..., torch.Tensor], size: int | None, *,
                  trim_padding: bool = True) -> Callable[..., torch.Tensor]:
    """A trainer's execution layout around ``forward(x, txt, txt_mask, tau, img_grid, rt)``: the
    rows of each logical sample (with batched CFG: its cond and its uncond row, so the pinned CFG
    layout is kept) are run ``size`` samples per forward, and with ``trim_padding`` each
    micro-batch's prompts are cut after its last valid text row (mask dropped when all valid, as
    the pipeline does; left padding is kept, since text RoPE positions count from row 0), as Flow-GRPO's ``compute_log_prob`` trims embeddings. Identity scopes
    (samples, text lengths, per-row branches) are sliced per micro-batch and the call counters
    restart for each, so the records align with the whole-batch rollout's. ``size=None``:
    ``forward`` unchanged. Strict bytes do not change (batch- and padding-invariant operators);
    production bytes may.
    """
    if size is None:
        return forward
    size = int(size)
    if size < 1:
        raise DriftToolError(f"micro-batch size must be >= 1, got {size}")

    def run(x, txt, txt_mask, tau, img_grid, rt):
        scope = rt._scope
        samples = list(scope["samples"]) if scope.get("samples") is not None else list(range(x.shape[0]))
        lens, starts = scope.get("txt_lens"), scope.get("txt_starts")
        branch = scope.get("branch")
        order = list(dict.fromkeys(samples))
        before = dict(rt._calls)
        out = None
        after: dict = {}
        for c in range(0, len(order), size):
            chunk = set(order[c:c + size])
            idx = [r for r, sid in enumerate(samples) if sid in chunk]
            sel = torch.tensor(idx, dtype=torch.long, device=x.device)
            t, m = txt[sel], None if txt_mask is None else txt_mask[sel]
            if trim_padding and m is not None:
                # cut the padding after the last valid row of the micro-batch only: text RoPE
                # positions count from row 0, so leading (left) padding stays where it is
                ends = torch.where(m.any(dim=1), m.shape[1] - m.flip(1).to(torch.uint8).argmax(dim=1), 0)
                width = int(ends.max())  # [B] one past each row's last valid text row
                t, m = t[:, :width], m[:, :width]
                m = None if bool(m.all()) else m
            sub = {"samples": [samples[r] for r in idx]}
            if lens is not None:
                sub["txt_lens"] = [lens[r] for r in idx]
            if starts is not None:
                sub["txt_starts"] = [starts[r] for r in idx]
            if branch is not None and not isinstance(branch, str):
                sub["branch"] = tuple(branch[r] for r in idx)
            rt._calls = dict(before)
            with rt.scope(**sub):
                v = forward(x[sel], t, m, tau[sel], img_grid, rt)
            after.update(rt._calls)
            if out is None:
                out = v.new_empty((x.shape[0], *v.shape[1:]))
            out = out.index_copy(0, sel, v)
        rt._calls = {**before, **after}
        return out

    return run


def _source_record(stored: StoredRollout) -> dict[str, Any]:
    return {"path": str(stored.path), "kind": stored.manifest.get("kind", "rollout"),
            "mode": stored.settings.get("mode"), "weights": stored.manifest["fingerprint"].get("weights"),
            "complete": stored.complete, "variants": list(stored.manifest.get("variants") or []),
            "model_source": stored.manifest.get("model_source")}


def policy_record(stored: StoredRollout, tau: torch.Tensor | None = None) -> dict[str, Any]:
    """The arithmetic policy shared by rollout and recompute (module docstring)."""
    s = stored.sampler
    out = {"timestep_policy": s.timestep_policy, "cfg_layout": s.cfg_layout, "cfg_scale": s.cfg_scale,
           "eta": s.eta, "sde_window": None if s.sde_window is None else list(s.sde_window),
           "stored_latent_dtype": stored.latent_dtype,
           "logp_evaluated_on": "stored x_t and stored x_{t+1} bytes (prev_sample), upcast exactly to fp32",
           "sigma_table_digest": stored.manifest["fingerprint"]["scheduler"].get("sigma_table_digest")}
    if tau is not None:
        out["timesteps"] = [float(v) for v in tau.tolist()]
    return out


def _prepare(stored: StoredRollout, model, fixture, checkpoint, lora):
    if model is None:
        model = trainer_model(stored, fixture=fixture, checkpoint=checkpoint, lora=lora)
    if lora is not None and not stored.manifest.get("lora"):
        raise DriftToolError(f"{stored.path}: the rollout ran without a LoRA adapter, and a replay or "
                             "recompute re-runs the rollout's own model: drop --lora (to check an "
                             "adapter, roll out with it first: drifttool run --lora ADAPTER)")
    check_fingerprint(stored, model)
    return model


def _refuse_same_dir(source: Any, out: str | Path) -> None:
    """The output must never be the source artifact (``--overwrite`` would destroy it)."""
    src = source.path if isinstance(source, StoredRollout) else source
    if Path(src).resolve() == Path(out).resolve():
        raise DriftToolError(f"{out}: the output directory is the source run itself; choose another -o")


def recompute_run(
    source: str | Path | StoredRollout,
    out: str | Path,
    *,
    mode: str | None = None,
    capture: str | None = None,
    grad: bool = False,
    gradient_checkpointing: bool = False,
    micro_batch: int | None = None,
    trim_padding: bool = True,
    overwrite: bool = False,
    fixture: str | Path | None = None,
    checkpoint: str | Path | None = None,
    lora: str | Path | None = None,
    model=None,
    on_step: Callable[[StepOutput], Any] | None = None,
) -> dict[str, Any]:
    """Recompute a stored rollout in phase ``train`` and write a ``kind: "recompute"`` artifact.

    Args:
        source: rollout artifact directory (or an already loaded ``StoredRollout``).
        mode: runtime mode of the trainer (default: the rollout's).
        capture: capture level (default: the rollout's).
        grad: backward per SDE step and digest the LoRA gradients (needs an adapter).
        gradient_checkpointing: sets ``model.gradient_checkpointing``.
        micro_batch, trim_padding: the trainer's execution layout (``micro_batched``); default
            the rollout's whole batch.
        fixture, checkpoint, lora: override the model the manifest names.
        model: a ready trainer model (still fingerprint-checked).

    Returns:
        Summary: out, complete, steps, samples, mode, capture, grad_records, seconds.

    Raises:
        ArtifactError: the source is incomplete, tampered or unreadable; the output location.
        DriftToolError: fingerprint mismatch, bad mode or level, ``grad`` without an adapter.
    """
    _refuse_same_dir(source, out)
    stored = source if isinstance(source, StoredRollout) else load_rollout(source)
    model = _prepare(stored, model, fixture, checkpoint, lora)
    try:
        m = Mode(mode or stored.settings.get("mode", "strict"))
    except ValueError:
        raise DriftToolError(f"unknown mode {mode!r} (strict, audit, auto, off)") from None
    level = capture or stored.manifest.get("capture_level") or "L1"
    if level not in ("L0", "L1", "L2"):
        raise DriftToolError(f"unknown capture level {level!r} (L0, L1, L2)")
    if grad and not lora_parameters(model):
        raise DriftToolError("gradients (recompute --grad) need trainable LoRA parameters, and the "
                             "rollout ran without an adapter: roll out with one (drifttool run --lora "
                             "ADAPTER) and recompute that run")
    sampler = stored.sampler
    h, w = stored.inputs.img_grid
    sig = implementation("flow_sigma_table", "strict")(sampler.num_steps, sampler.image_seq_len or h * w)
    from drifttool.ops.scheduler import timestep_input

    tau = timestep_input(sig[:-1], sampler.timestep_policy)
    fingerprint = arch_fingerprint(
        arch=model.config.arch_fields(), img_grid=stored.inputs.img_grid, weights=weight_digest(model),
        dtype=model.dtype, mode=m.value,
        sampler={**dataclasses.asdict(sampler), "sigma_table": sig.tolist(),
                 "sigma_table_digest": tensor_digest(sig)}, noise_record=stored.noise_record,
    )
    settings = {**stored.settings, "mode": m.value, "capture": level}
    manifest = {
        "kind": "recompute",
        "fingerprint": fingerprint,
        "settings": settings,
        "environment": environment(),
        "source": _source_record(stored),
        "policy": policy_record(stored, tau),
        "train": {"phase": "train", "autograd": True, "grad": bool(grad),
                  "loss": "per SDE step: -mean over samples of logp_t, backward per step, "
                          "gradients accumulated" if grad else None,
                  "gradient_checkpointing": bool(gradient_checkpointing),
                  "micro_batch": micro_batch, "trim_padding": bool(trim_padding and micro_batch)},
        "replay": dict(stored.manifest.get("replay") or {}),
        "layout": dict(stored.manifest.get("layout") or {}),
    }
    if has_lora(model):
        manifest["lora"] = lora_record(model)
    writer = ArtifactWriter(out, manifest, overwrite=overwrite)
    recorder = Recorder(level=level, writer=writer) if m.captures else None
    rt = None
    n_grad = 0
    t0 = time.perf_counter()

    def step_done(o: StepOutput) -> None:
        nonlocal n_grad
        if grad and o.in_window:
            (-o.logp.mean()).backward()
            n_grad += capture_lora_grads(model, recorder, phase="train", step=o.step, sigma=o.sigma)
        if on_step is not None:
            on_step(o)

    try:
        model.gradient_checkpointing = bool(gradient_checkpointing)
        rt = Runtime(mode=m, recorder=recorder)
        writer.write_inputs(replay_tensors(stored.inputs))
        with torch.enable_grad():
            fwd = micro_batched(sampler_model(model), micro_batch, trim_padding=trim_padding)
            traj = recompute(fwd, stored.inputs, stored.latents, sampler, rt,
                             phase="train", callback=step_done)
        writer.write_trace(rt.trace.rows())
        if m is Mode.STRICT:
            rt.trace.check_strict()
    except BaseException:
        close_incomplete(rt, recorder, writer)
        raise
    finally:
        model.gradient_checkpointing = False
    seconds = time.perf_counter() - t0
    writer.update_manifest(seconds=round(seconds, 3))
    if recorder is not None:
        recorder.close(complete=traj.complete)
    writer.close(complete=traj.complete)
    return {"out": str(out), "complete": traj.complete, "steps": len(traj.steps),
            "samples": stored.inputs.sample_ids, "mode": m.value, "capture": level,
            "grad_records": n_grad, "seconds": seconds, "trajectory": traj}


def replay_run(
    source: str | Path,
    out: str | Path,
    *,
    mode: str | None = None,
    capture: str | None = None,
    overwrite: bool = False,
    fixture: str | Path | None = None,
    checkpoint: str | Path | None = None,
    lora: str | Path | None = None,
    model=None,
    on_step: Callable[[StepOutput], Any] | None = None,
) -> dict[str, Any]:
    """Re-execute a rollout from its stored replay inputs (x0, SDE noise, prompts, masks) with the
    manifest's settings and model; writes a rollout artifact with ``replay_of``. In strict mode
    ``drifttool diff SOURCE OUT`` is identical. An incomplete source is accepted (its inputs are
    written first).

    Raises:
        ArtifactError: no or tampered replay inputs, unreadable manifest.
        DriftToolError: fingerprint mismatch, bad settings.
    """

    _refuse_same_dir(source, out)
    stored = load_rollout(source, need_latents=False)
    if stored.manifest.get("variants"):
        raise DriftToolError(f"{stored.path}: the run replaced operators ({', '.join(stored.manifest['variants'])}); "
                             "a replay cannot re-create them (use the probe that made it)")
    if stored.manifest.get("model_source") and model is None:
        raise DriftToolError(f"{stored.path}: the run used another model implementation "
                             f"({stored.manifest['model_source']!r}); pass that model to replay_run")
    model = _prepare(stored, model, fixture, checkpoint, lora)
    s = stored.settings
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    own = ("mode", "capture", "fixture", "checkpoint") + (("variant",) if checkpoint else ())  # variant: of the stored checkpoint
    kw = {k: v for k, v in s.items() if k in fields and k not in own}
    spec = RunSpec(**kw, fixture=fixture or s.get("fixture"), checkpoint=checkpoint or s.get("checkpoint"),
                   mode=mode or s.get("mode", "strict"),
                   capture=capture or stored.manifest.get("capture_level"))
    extra = {"replay_of": _source_record(stored)}
    return execute(spec, out, overwrite=overwrite, on_step=on_step, model=model,
                   replay_inputs=(stored.inputs, stored.noise_record), manifest_extra=extra)
