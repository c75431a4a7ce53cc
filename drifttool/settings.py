"""Typed run settings: what a run asks for (``RunSpec``), what it runs with (``RunSettings``).

    >>> fx, s = resolve(RunSpec(mode="strict", batch=3))
    >>> s.steps, s.samples, s.mode
    (4, (0, 1, 2), <Mode.STRICT: 'strict'>)
    >>> s.record()["samples"]              # the manifest's ``settings``
    [0, 1, 2]

``RunSpec`` holds what the CLI exposes; unset fields come from the fixture's settings
(``fixtures/<name>/fixture.json``). ``resolve`` merges the two and validates every field in one
place (``DriftToolError`` with a one-line message); the result is a frozen ``RunSettings`` that
the runner, the training side and the probes read instead of an untyped dict. Every
byte-changing choice ends up in the manifest through ``RunSettings.record`` (keys of
``schema._SETTINGS``; ``variant``, ``lora``, ``pad_prompts_to`` and ``sample_labels`` only when
set, so the default manifest is unchanged).

``check_mode`` and ``check_level`` are the validators the training side's options use too, so
``drifttool run``, ``replay`` and ``recompute`` refuse a bad ``--mode`` or ``--capture`` with the
same line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from drifttool.errors import DriftToolError
from drifttool.fixture import DEFAULT_FIXTURE, Fixture, load_fixture
from drifttool.model.config import MMDiTConfig
from drifttool.ops.scheduler import TIMESTEP_POLICIES
from drifttool.runtime import Mode
from drifttool.sampling.inputs import RolloutInputs, build_inputs
from drifttool.sampling.presets import apply_preset, preset_inputs, preset_settings
from drifttool.sampling.rollout import CFG_LAYOUTS, SamplerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Model dtypes a run may use (``schema.MODEL_DTYPES`` repeats the names)."""
LEVELS = ("L0", "L1", "L2")
"""Capture levels a run may ask for (``schema.LEVELS`` repeats them; a test checks they agree)."""
MAX_STEPS = 1000
"""Most denoising steps a run may ask for: the flow-matching scheduler's ``num_train_timesteps``
(FlowMatchEulerDiscreteScheduler of Qwen-Image, numerics §1); more would only re-visit timesteps."""


def check_mode(mode: Any) -> Mode:
    """``mode`` as a ``Mode``.

    Raises:
        DriftToolError: not one of strict, audit, auto, off.
    """
    try:
        return Mode(mode)
    except ValueError:
        raise DriftToolError(f"unknown mode {mode!r} (strict, audit, auto, off)") from None


def check_level(level: Any) -> str:
    """``level`` if it is a capture level.

    Raises:
        DriftToolError: not one of L0, L1, L2.
    """
    if level not in LEVELS:
        raise DriftToolError(f"unknown capture level {level!r} (L0, L1, L2)")
    return level


@dataclass(frozen=True, kw_only=True)
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
        preset: a production preset (``drifttool.sampling.presets``: ``diffusers`` |
            ``flow-grpo``): fixes CFG layout, timestep policy, (η), latents dtype, step rule and
            noise; needs mode auto or off.
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
    preset: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The validated settings of one run (``resolve``); the manifest's ``settings`` is
    ``record()``.

    Attributes:
        fixture: the fixture's name. checkpoint: resolved path of an external model, or None.
        variant: weight variant of ``checkpoint`` (None: the default weights).
        lora: resolved path of the LoRA adapter, or None.
        mode: runtime mode. capture: capture level. dtype: model dtype name (``DTYPES``).
        steps, cfg_scale, eta, seed, cfg_layout, timestep_policy: sampler settings (values as
            the fixture or the caller gave them: ``cfg_scale`` 4.0 stays a float in the manifest).
        samples: logical sample ids of the batch. img_grid: (h, w) patch grid.
        pad_prompts_to: prompt padding (None: the batch's longest prompt).
        sample_labels: ids written instead of ``samples`` (a probe), or None.
        preset: the production preset (``drifttool.sampling.presets``), or None.
    """

    fixture: str
    checkpoint: str | None = None
    variant: str | None = None
    lora: str | None = None
    mode: Mode
    capture: str
    dtype: str
    steps: int
    cfg_scale: float
    eta: float
    seed: int
    samples: tuple[int, ...]
    img_grid: tuple[int, int]
    cfg_layout: str
    timestep_policy: str
    pad_prompts_to: int | None = None
    sample_labels: tuple[int, ...] | None = None
    preset: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype (``DTYPES[dtype]``)."""
        return DTYPES[self.dtype]

    @property
    def labels(self) -> list[int]:
        """The logical id written for each batch row (``sample_labels``, else ``samples``)."""
        return list(self.sample_labels if self.sample_labels is not None else self.samples)

    def sampler(self) -> SamplerConfig:
        """The ``SamplerConfig`` these settings run (default SDE window; the preset's choices)."""
        cfg = SamplerConfig(num_steps=int(self.steps), cfg_scale=float(self.cfg_scale),
                            eta=float(self.eta), cfg_layout=self.cfg_layout,
                            timestep_policy=self.timestep_policy)
        return cfg if self.preset is None else apply_preset(cfg, self.preset, self.torch_dtype)

    def inputs(self, fx: Fixture, config: MMDiTConfig) -> tuple[RolloutInputs, dict[str, Any]]:
        """The replay inputs of these settings and their noise record
        (``sampling.inputs.build_inputs`` with the fixture's prompts).

        Raises:
            UnsupportedConfigError: the config cannot drive a rollout.
            DriftToolError: ``pad_prompts_to`` shorter than the longest prompt.
        """
        built = build_inputs(fx, seed=self.seed, samples=self.samples, img_grid=self.img_grid,
                             num_steps=self.steps, config=config, pad_prompts_to=self.pad_prompts_to,
                             sample_labels=self.sample_labels)
        if self.preset is None:
            return built
        return preset_inputs(self.preset, *built, seed=self.seed, num_steps=self.steps,
                             model_dtype=self.torch_dtype, samples=self.samples)

    def record(self) -> dict[str, Any]:
        """The manifest's ``settings`` (``schema._SETTINGS``): every field as JSON, the optional
        ones (``variant``, ``lora``, ``pad_prompts_to``, ``sample_labels``) only when set."""
        out: dict[str, Any] = {
            "fixture": self.fixture, "checkpoint": self.checkpoint, "mode": self.mode.value,
            "capture": self.capture, "dtype": self.dtype, "steps": self.steps,
            "cfg_scale": self.cfg_scale, "eta": self.eta, "seed": self.seed,
            "samples": list(self.samples), "img_grid": list(self.img_grid),
            "cfg_layout": self.cfg_layout, "timestep_policy": self.timestep_policy,
        }
        optional = {"variant": self.variant, "lora": self.lora, "pad_prompts_to": self.pad_prompts_to,
                    "sample_labels": None if self.sample_labels is None else list(self.sample_labels),
                    "preset": self.preset}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= MAX_STEPS:
        raise DriftToolError(f"steps must be an integer from 2 to {MAX_STEPS} (the flow-matching "
                             f"scheduler's num_train_timesteps), got {steps!r}")
    return steps


def _check_number(key: str, value: Any, floor: float | None) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (floor is not None and value < floor):
        bound = "" if floor is None else f" >= {floor:g}"
        raise DriftToolError(f"{key} must be a finite number{bound}, got {value!r}")
    return value


def _samples(spec: RunSpec, default: Any) -> tuple[int, ...]:
    if spec.samples is not None:
        ids = [int(i) for i in spec.samples]
    elif spec.batch is not None:
        ids = list(range(int(spec.batch)))
    else:
        ids = list(default or [])
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise DriftToolError(f"sample ids must be distinct and >= 0, got {ids}")
    return tuple(ids)


def resolve(spec: RunSpec) -> tuple[Fixture, RunSettings]:
    """Merge the spec over the fixture's settings; validate. Returns (fixture, settings).

    Raises:
        DriftToolError: steps outside 2..``MAX_STEPS``; cfg_scale or eta not a finite number
            (eta < 0); unknown mode, capture level, dtype, CFG layout or timestep policy; empty,
            repeated or negative sample ids; a batch size and sample ids together; a weight
            variant without a checkpoint; sample labels not one per sample; an unknown preset,
            or an explicit setting it contradicts (``sampling.presets.preset_settings``;
            ``UnsupportedConfigError`` for a preset under mode strict or audit).
        FixtureError: the fixture cannot be found or read.
    """
    fx = load_fixture(spec.fixture or DEFAULT_FIXTURE)
    base = fx.settings
    if spec.samples is not None and spec.batch is not None:
        raise DriftToolError("give either a batch size or sample ids, not both")
    s = {key: _pick(getattr(spec, key), base.get(key))
         for key in ("steps", "cfg_scale", "eta", "seed", "capture", "dtype", "cfg_layout",
                     "timestep_policy")}
    if spec.preset is not None:
        if s["dtype"] not in DTYPES:
            raise DriftToolError(f"unsupported dtype {s['dtype']!r} (one of {sorted(DTYPES)})")
        s.update(preset_settings(spec.preset, mode=check_mode(spec.mode), model_dtype=DTYPES[s["dtype"]],
                                 asked={k: getattr(spec, k) for k in ("cfg_layout", "timestep_policy", "eta")}))
    steps = _check_steps(s["steps"])
    cfg_scale = _check_number("cfg_scale", s["cfg_scale"], None)
    eta = _check_number("eta", s["eta"], 0.0)
    if s["cfg_layout"] not in CFG_LAYOUTS:
        raise DriftToolError(f"unknown cfg_layout {s['cfg_layout']!r} (one of {', '.join(CFG_LAYOUTS)})")
    if s["timestep_policy"] not in TIMESTEP_POLICIES:
        raise DriftToolError(f"unknown timestep_policy {s['timestep_policy']!r} "
                             f"(one of {', '.join(TIMESTEP_POLICIES)})")
    samples = _samples(spec, base.get("samples"))
    mode = check_mode(spec.mode)
    if s["dtype"] not in DTYPES:
        raise DriftToolError(f"unsupported dtype {s['dtype']!r} (one of {sorted(DTYPES)})")
    capture = check_level(s["capture"])
    if spec.variant is not None and not spec.checkpoint:
        raise DriftToolError("a weight variant needs a checkpoint (--variant goes with --checkpoint)")
    labels = None
    if spec.sample_labels is not None:
        labels = tuple(int(i) for i in spec.sample_labels)
        if len(labels) != len(samples):
            raise DriftToolError(f"sample_labels {list(labels)} must name one id per sample "
                                 f"of {list(samples)}")
    missing = [k for k in ("seed", "img_grid") if base.get(k) is None and getattr(spec, k, None) is None]
    if missing:
        raise DriftToolError(f"{fx.path}: fixture settings lack {', '.join(missing)}")
    return fx, RunSettings(
        fixture=fx.name,
        checkpoint=str(Path(spec.checkpoint).resolve()) if spec.checkpoint else None,
        variant=spec.variant, lora=None if spec.lora is None else str(Path(spec.lora).resolve()),
        mode=mode, capture=capture, dtype=s["dtype"], steps=steps, cfg_scale=cfg_scale, eta=eta,
        seed=s["seed"], samples=samples, img_grid=tuple(int(v) for v in base["img_grid"]),
        cfg_layout=s["cfg_layout"], timestep_policy=s["timestep_policy"],
        pad_prompts_to=None if spec.pad_prompts_to is None else int(spec.pad_prompts_to),
        sample_labels=labels, preset=spec.preset,
    )
