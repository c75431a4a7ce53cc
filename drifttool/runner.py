"""The main job: run a strict (or production) trajectory and write its artifact.

    >>> summary = execute(RunSpec(mode="strict", capture="L1"), "runs/a")
    >>> summary["complete"], summary["steps"], summary["samples"]
    (True, 4, [0, 1])

``RunSpec`` holds what the CLI exposes; unset fields come from the fixture's settings
(``fixtures/<name>/fixture.json``). Every byte-changing choice ends up in the manifest.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import drifttool.ops  # noqa: F401  (registers every operator backend)
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.digest import digest
from drifttool.capture.recorder import Recorder
from drifttool.digestcore import label
from drifttool.environment import environment
from drifttool.errors import DriftToolError
from drifttool.fingerprint import arch_fingerprint
from drifttool.fixture import DEFAULT_FIXTURE, Fixture, load_fixture
from drifttool.model.checkpoint import load_checkpoint, weight_digest
from drifttool.model.config import MMDiTConfig
from drifttool.model.lora import has_lora, load_lora, lora_record
from drifttool.ops.registry import implementation
from drifttool.ops.scheduler import TIMESTEP_POLICIES
from drifttool.runtime import Mode, Runtime
from drifttool.sampling.noise import draw_noise
from drifttool.sampling.rollout import CFG_LAYOUTS, RolloutInputs, SamplerConfig, StepOutput, rollout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_STEPS = 1000
"""Most denoising steps a run may ask for: the flow-matching scheduler's ``num_train_timesteps``
(FlowMatchEulerDiscreteScheduler of Qwen-Image, numerics §1); more would only re-visit timesteps."""


@dataclass(kw_only=True)
class RunSpec:
    """What to run. ``None`` fields take the fixture's setting.

    Attributes:
        fixture: fixture name (under ``fixtures/``) or path; default ``tiny-t2i``.
        checkpoint: diffusers-format transformer folder, or pipeline folder (``model_index.json``
            + ``transformer/``), replacing the fixture's model (prompt embeddings are then drawn
            from ``seed`` at the fixture's prompt lengths, latents with its latent channels).
        variant: diffusers weight variant of ``checkpoint`` (``fp16`` reads
            ``diffusion_pytorch_model.fp16.safetensors``).
        steps, cfg_scale, eta, seed: sampler settings (numerics §3.3, §3.4, §4).
        samples: logical sample ids to run as one batch; ``batch`` B means ids 0..B-1.
        mode: runtime mode (strict | audit | auto | off).
        capture: L0 | L1 | L2.
        dtype: model dtype (float32 | bfloat16).
        cfg_layout: batched | sequential.  timestep_policy: see ``ops.scheduler``.
        unavailable: (op, backend) pairs planted as unavailable (tests, probes).
        variants: ``{op: (variant_name, fn)}`` operator replacements (probes), see ``Runtime``.
        pad_prompts_to: right-pad every prompt (and the negative prompt) with zeros to this many
            tokens, masked (an invariant control: strict bytes must not change); ``None`` = pad
            to the batch's longest prompt only.
        sample_labels: logical ids written for each batch row instead of ``samples`` (the data
            stays that of ``samples``); a probe of mislabelled distributed metadata.
        lora: a LoRA adapter (peft folder or .safetensors, ``drifttool.model.lora``) loaded onto
            the model; recorded in the settings and the manifest (``lora``), and pinned by the
            fingerprint's weight digest.
    """

    fixture: str | Path | None = None
    checkpoint: str | Path | None = None
    variant: str | None = None
    steps: int | None = None
    cfg_scale: float | None = None
    eta: float | None = None
    seed: int | None = None
    batch: int | None = None
    samples: list[int] | None = None
    mode: str = "strict"
    capture: str | None = None
    dtype: str | None = None
    cfg_layout: str | None = None
    timestep_policy: str | None = None
    unavailable: tuple[tuple[str, str], ...] = ()
    variants: dict[str, tuple[str, Callable[..., Any]]] = dataclasses.field(default_factory=dict)
    pad_prompts_to: int | None = None
    sample_labels: list[int] | None = None
    lora: str | Path | None = None


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def resolve(spec: RunSpec) -> tuple[Fixture, dict[str, Any]]:
    """Merge the spec over the fixture's settings; validate. Returns (fixture, settings).

    Raises:
        DriftToolError: steps outside 2..``MAX_STEPS``; cfg_scale or eta not a finite number
            (eta < 0); unknown mode, capture level or dtype; empty or negative sample ids.
    """
    fx = load_fixture(spec.fixture or DEFAULT_FIXTURE)
    s = dict(fx.settings)
    for key in ("steps", "cfg_scale", "eta", "seed", "capture", "dtype", "cfg_layout",
                "timestep_policy"):
        s[key] = _pick(getattr(spec, key), s.get(key))
    if spec.samples is not None and spec.batch is not None:
        raise DriftToolError("give either a batch size or sample ids, not both")
    steps = s["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= MAX_STEPS:
        raise DriftToolError(f"steps must be an integer from 2 to {MAX_STEPS} (the flow-matching "
                             f"scheduler's num_train_timesteps), got {steps!r}")
    for key, floor in (("cfg_scale", None), ("eta", 0.0)):
        value = s[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (floor is not None and value < floor):
            bound = "" if floor is None else f" >= {floor:g}"
            raise DriftToolError(f"{key} must be a finite number{bound}, got {value!r}")
    if s["cfg_layout"] not in CFG_LAYOUTS:
        raise DriftToolError(f"unknown cfg_layout {s['cfg_layout']!r} (one of {', '.join(CFG_LAYOUTS)})")
    if s["timestep_policy"] not in TIMESTEP_POLICIES:
        raise DriftToolError(f"unknown timestep_policy {s['timestep_policy']!r} "
                             f"(one of {', '.join(TIMESTEP_POLICIES)})")
    if spec.samples is not None:
        s["samples"] = [int(i) for i in spec.samples]
    elif spec.batch is not None:
        s["samples"] = list(range(int(spec.batch)))
    if not s["samples"] or min(s["samples"]) < 0 or len(set(s["samples"])) != len(s["samples"]):
        raise DriftToolError(f"sample ids must be distinct and >= 0, got {s['samples']}")
    try:
        s["mode"] = Mode(spec.mode).value
    except ValueError:
        raise DriftToolError(f"unknown mode {spec.mode!r} (strict, audit, auto, off)") from None
    if s["dtype"] not in DTYPES:
        raise DriftToolError(f"unsupported dtype {s['dtype']!r} (one of {sorted(DTYPES)})")
    if s["capture"] not in ("L0", "L1", "L2"):
        raise DriftToolError(f"unknown capture level {s['capture']!r} (L0, L1, L2)")
    s["checkpoint"] = str(Path(spec.checkpoint).resolve()) if spec.checkpoint else None
    if spec.variant is not None:  # recorded only when set: the default manifest is unchanged
        if not spec.checkpoint:
            raise DriftToolError("a weight variant needs a checkpoint (--variant goes with --checkpoint)")
        s["variant"] = spec.variant
    if spec.pad_prompts_to is not None:  # recorded only when set: the default manifest is unchanged
        s["pad_prompts_to"] = int(spec.pad_prompts_to)
    if spec.sample_labels is not None:
        s["sample_labels"] = [int(i) for i in spec.sample_labels]
        if len(s["sample_labels"]) != len(s["samples"]):
            raise DriftToolError(f"sample_labels {s['sample_labels']} must name one id per sample "
                                 f"of {s['samples']}")
    if spec.lora is not None:  # recorded only when set
        s["lora"] = str(Path(spec.lora).resolve())
    s["fixture"] = fx.name
    return fx, s


def build_inputs(fx: Fixture, s: dict[str, Any], config: MMDiTConfig) -> tuple[RolloutInputs, dict]:
    """Replay inputs for the sample batch: pinned noise (``sampling.noise``) with
    ``config.latent_channels`` latent channels (x0 ``[B, N, in_channels]``) and prompt
    embeddings ``[B, L, joint_attention_dim]`` (the fixture's, or seeded random ones at the
    fixture's lengths for an external checkpoint), right-padded to the batch's longest prompt with
    a key mask (None if all valid, as the pipeline does, numerics §5.11).

    Raises:
        UnsupportedConfigError: the config cannot drive a rollout (``MMDiTConfig.latent_channels``).
        DriftToolError: ``pad_prompts_to`` shorter than the longest prompt.
    """
    ids = s["samples"]
    grid = tuple(s["img_grid"])
    noise = draw_noise(s["seed"], ids, img_grid=grid, num_steps=s["steps"], channels=config.latent_channels)
    txt, lens, neg, neg_len = fx.prompts(config.joint_attention_dim, seed=s["seed"])
    rows = [i % txt.shape[0] for i in ids]
    width = max(int(lens[r]) for r in rows)
    pad_to = s.get("pad_prompts_to")
    if pad_to is not None:
        if int(pad_to) < max(width, int(neg_len)):
            raise DriftToolError(f"pad_prompts_to={pad_to} is shorter than the longest prompt "
                                 f"({max(width, int(neg_len))} tokens)")
        txt = torch.cat([txt, txt.new_zeros(txt.shape[0], max(0, int(pad_to) - txt.shape[1]),
                                            txt.shape[2])], dim=1)
        width = int(pad_to)
    tb = torch.stack([txt[r, :width] for r in rows])  # [B, L, D]
    mask = torch.stack([torch.arange(width) < lens[r] for r in rows])  # [B, L] bool
    nb = neg[:, : int(neg_len)].expand(len(ids), -1, -1).contiguous()  # [B, Ln, D]
    neg_mask = None
    if pad_to is not None:
        nb = torch.cat([nb, nb.new_zeros(len(ids), width - nb.shape[1], nb.shape[2])], dim=1)
        neg_mask = (torch.arange(width) < int(neg_len)).expand(len(ids), -1).contiguous()
    inputs = RolloutInputs(
        sample_ids=list(s.get("sample_labels") or ids), x0=noise.x0, txt=tb, img_grid=grid,
        txt_mask=None if bool(mask.all()) else mask, noise=noise.noise,
        neg_txt=nb, neg_mask=None if neg_mask is None or bool(neg_mask.all()) else neg_mask,
    )
    return inputs, noise.record


def tensor_digest(t: torch.Tensor) -> str:
    """Digest v2 of ``t`` (one row) as written into the manifest (``digestcore.label``)."""
    return label(digest(t))


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse non-finite replay inputs or weights: a NaN must be reported, never hashed as if it
    were an ordinary value.

    Raises:
        DriftToolError: naming every tensor with NaN/Inf, its count and first index.
    """
    bad = []
    for name, t in tensors.items():
        if t.is_floating_point():
            nf = ~torch.isfinite(t)
            if bool(nf.any()):
                first = tuple(nf.nonzero()[0].tolist())
                bad.append(f"{name}: {int(nf.sum())} non-finite value(s), first at index {first}")
    if bad:
        raise DriftToolError(f"non-finite {what}: " + "; ".join(bad))


def sampler_model(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The model as the sampler calls it: latents stay FP32 between steps; they and the prompt
    embeddings are cast to the model dtype W at the model input (the cast point of the
    pipeline), and the velocity comes back in W (the SDE step upcasts it, numerics §4)."""
    w = model.dtype

    def forward(x, txt, txt_mask, tau, img_grid, rt):
        return model(x.to(w), txt.to(w), txt_mask, tau, img_grid, rt)

    return forward


def replay_tensors(inputs: RolloutInputs) -> dict[str, torch.Tensor]:
    """The tensors stored in ``inputs.safetensors``."""
    t = {"sample_ids": torch.tensor(inputs.sample_ids, dtype=torch.int64), "x0": inputs.x0,
         "txt": inputs.txt, "img_grid": torch.tensor(inputs.img_grid, dtype=torch.int64)}
    if inputs.txt_mask is not None:
        t["txt_mask"] = inputs.txt_mask.to(torch.uint8)
    if inputs.noise is not None:
        t["noise"] = inputs.noise
    if inputs.neg_txt is not None:
        t["neg_txt"] = inputs.neg_txt
    if inputs.neg_mask is not None:
        t["neg_mask"] = inputs.neg_mask.to(torch.uint8)
    return t


def close_incomplete(rt: Runtime | None, recorder: Recorder | None, writer: ArtifactWriter) -> None:
    """Flush what finished, keep the trace so far, and mark the artifact incomplete — never
    masking the run's own exception."""
    try:
        if rt is not None:
            writer.write_trace(rt.trace.rows())
        if recorder is not None:
            recorder.close(complete=False)  # flushes the finished steps, closes the writer
    except Exception:  # noqa: BLE001 - the run's own exception is the one to report
        pass
    writer.close(complete=False)


def execute(
    spec: RunSpec,
    out: str | Path,
    *,
    overwrite: bool = False,
    on_step: Callable[[StepOutput], Any] | None = None,
    max_steps: int | None = None,
    model: torch.nn.Module | None = None,
    replay_inputs: tuple[RolloutInputs, dict[str, Any]] | None = None,
    manifest_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one trajectory and write its artifact to ``out``.

    ``replay_inputs`` = (inputs, noise record) replaces the inputs drawn from the fixture (a
    replay of a stored artifact, ``drifttool.sampling.train.replay_run``); ``manifest_extra`` is
    merged into the manifest. A model without an adapter gets ``spec.lora`` loaded.

    ``model`` replaces the checkpoint's ``MMDiT`` with another implementation of the same call
    (``config``, ``dtype``, named parameters under the checkpoint's names, and
    ``model(x, txt, txt_mask, tau, img_grid, rt)``), e.g. the diffusers capture adapter
    (``drifttool.adapters.diffusers_qwenimage``); its ``source`` attribute goes to the manifest.

    A failure after the artifact was opened closes it with ``complete=false`` (finished steps
    stay readable) and re-raises.

    Returns:
        A summary: out, complete, steps, samples, mode, capture, records.
    Raises:
        DriftToolError (or subclasses): bad settings, checkpoint, fixture, strict configuration
            or artifact location.
    """
    fx, s = resolve(spec)
    dtype = DTYPES[s["dtype"]]
    source = getattr(model, "source", None) if model is not None else None
    if model is None:
        model = load_checkpoint(s["checkpoint"] or fx.model_dir, dtype=dtype, variant=s.get("variant"))
    elif model.dtype != dtype:
        raise DriftToolError(f"the given model is {model.dtype}, the run asks for {s['dtype']}")
    model.config.check_rollout()  # before the artifact opens
    sampler = SamplerConfig(
        num_steps=int(s["steps"]), cfg_scale=float(s["cfg_scale"]), eta=float(s["eta"]),
        cfg_layout=s["cfg_layout"], timestep_policy=s["timestep_policy"],
    )
    if s.get("lora") and not has_lora(model):
        load_lora(model, s["lora"])
    check_finite(dict(model.state_dict()), "checkpoint weights")
    if replay_inputs is not None:
        inputs, noise_rec = replay_inputs
    else:
        inputs, noise_rec = build_inputs(fx, s, model.config)
    check_finite(replay_tensors(inputs), "replay inputs")
    sigmas = implementation("flow_sigma_table", "strict")(sampler.num_steps, inputs.img_grid[0] * inputs.img_grid[1])
    fingerprint = arch_fingerprint(
        arch=model.config.arch_fields(), img_grid=inputs.img_grid, weights=weight_digest(model),
        dtype=dtype, mode=s["mode"],
        sampler={**dataclasses.asdict(sampler), "sigma_table": sigmas.tolist(),
                 "sigma_table_digest": tensor_digest(sigmas)}, noise_record=noise_rec,
    )
    manifest = {
        "kind": "rollout",
        "fingerprint": fingerprint,
        "settings": s,
        "environment": environment(),
        "replay": {"noise": noise_rec, "inputs": "inputs.safetensors",
                   "prompt_lengths": inputs.txt_mask.sum(-1).tolist() if inputs.txt_mask is not None
                   else [inputs.txt.shape[1]] * inputs.batch,
                   "input_digests": {k: tensor_digest(v) for k, v in replay_tensors(inputs).items()}},
        "variants": sorted(f"{op}={name}" for op, (name, _) in spec.variants.items()),
        "layout": {"world_size": 1, "tp": 1, "sp": 1, "cfg_parallel": 1, "cfg_layout": s["cfg_layout"]},
    }
    if source is not None:
        manifest["model_source"] = source
    if has_lora(model):
        manifest["lora"] = lora_record(model)
    manifest.update(manifest_extra or {})
    writer = ArtifactWriter(out, manifest, overwrite=overwrite)
    mode = Mode(s["mode"])
    recorder = Recorder(level=s["capture"], writer=writer) if mode.captures else None
    rt = None
    try:
        rt = Runtime(mode=mode, recorder=recorder, unavailable=set(spec.unavailable),
                     variants=dict(spec.variants))
        writer.write_inputs(replay_tensors(inputs))
        traj = rollout(sampler_model(model), inputs, sampler, rt, callback=on_step, max_steps=max_steps)
        writer.write_trace(rt.trace.rows())
        if mode is Mode.STRICT:
            rt.trace.check_strict()
    except BaseException:
        close_incomplete(rt, recorder, writer)
        raise
    done = traj.complete
    if recorder is not None:
        recorder.close(complete=done)
    writer.close(complete=done)
    nonfinite = sum(int((~torch.isfinite(t)).sum()) for t in (traj.latents, traj.velocities))
    return {"out": str(out), "complete": done, "steps": len(traj.steps), "samples": inputs.sample_ids,
            "mode": mode.value, "capture": s["capture"] if mode.captures else "none (mode off)",
            "nonfinite": nonfinite}
