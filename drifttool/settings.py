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
``manifest_schema._SETTINGS``; ``variant``, ``lora``, ``pad_prompts_to``, ``sample_labels``, ``device``
(when not ``cpu``) and ``input_files`` only when set, so the default manifest is unchanged).

Device and shape: ``device`` is ``cpu`` (default), ``cuda`` or ``cuda:N``; the model and every
replay input live there (inputs are drawn on the CPU, then moved). ``height``/``width`` are image
sizes in pixels, multiples of 16 (``PATCH_PIXELS``: 8× VAE downsampling, 2×2 patches, numerics
§3.2), giving ``img_grid = (height/16, width/16)``. ``prompt_embeds``, ``negative_prompt_embeds``
and ``latents`` name safetensors files (``sampling.input_files``) replacing the fixture's prompts
and the drawn initial latents; they are read and checked here, once, and their SHA-256 digests
go to the manifest (``input_files``).

The checks of single values (``check_mode``, ``check_level``, ``check_device``, ...) are in
``drifttool.setting_checks``: the training side's options use them too, so ``drifttool run``,
``replay`` and ``recompute`` refuse a bad ``--mode`` or ``--capture`` with the same line.
The bounds and checks a ``fixture.json``'s settings share with the flags (``check_steps``,
``check_seed``, ``check_fixture_settings``, ...) are in ``drifttool.fixture_settings``, which
needs no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from drifttool.artifact.levels import captures_internals
from drifttool.errors import DriftToolError
from drifttool.fixture import DEFAULT_FIXTURE, Fixture, load_fixture
from drifttool.fixture_settings import (  # noqa: F401  (MAX_STEPS, SEEDS, check_fixture_settings: re-exported)
    MAX_SAMPLE_ID, MAX_STEPS, SEEDS, check_fixture_settings, check_number, check_sample_ids, check_seed,
    check_steps)
from drifttool.model.checkpoint import read_config
from drifttool.model.config import MMDiTConfig
from drifttool.model.lora import check_lora_mode
from drifttool.ops.scheduler import TIMESTEP_POLICIES
from drifttool.runtime import Mode
from drifttool.sampling.config import CFG_LAYOUTS, SamplerConfig
from drifttool.sampling.input_files import ExternalInputs, read_external_inputs
from drifttool.sampling.inputs import RolloutInputs, build_inputs
from drifttool.sampling.presets import (PRESET_NAMES, apply_preset, check_conditions, check_preset_seed,
                                        get_preset, preset_inputs, preset_settings)
from drifttool.setting_checks import (DTYPES, PATCH_PIXELS, check_device, check_level, check_mode,
                                      check_mode_device, check_pixels, check_sigma_table)

MAX_BATCH = 2**20
"""Most samples one run takes (``--batch``): its per-sample lists, prompts and noise are built on
the host before the memory check (``memory.check_memory``) can weigh the run, and a batch of
2**31 filled 24 GB of them; a million samples is more than any batch a model runs at once."""


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
        internals: at L2, also capture the fused attention's internals (its scores and
            probabilities, ``artifact.levels``); ``None`` or True: yes, False: no.
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
        lora_mode: how the adapter runs (``model.lora.LORA_MODES``: merged | fused | unfused |
            unfused-fp32); ``None`` takes the preset's (``Preset.lora_mode``: what its pipeline
            runs), else ``merged``. Needs ``lora``; modes other than merged need mode auto/off.
        preset: a production preset (``drifttool.sampling.presets``: ``diffusers`` |
            ``flow-grpo``; in any case): fixes CFG layout, timestep policy, (η), latents dtype,
            step rule and noise; needs mode auto or off. ``None`` takes the fixture's (``tiny-edit`` names
            ``diffusers-edit``).
        device: ``cpu`` (default), ``cuda`` or ``cuda:N``: where the model and the replay inputs
            live (inputs are drawn on the CPU, then moved).
        height, width: image size in pixels, multiples of 16; ``None`` takes the fixture's
            ``img_grid`` (× 16). ``img_grid = (height / 16, width / 16)``.
        prompt_embeds, negative_prompt_embeds: safetensors files with ``prompt_embeds``
            [B, L, joint_attention_dim] and optional ``prompt_embeds_mask`` [B, L]
            (``sampling.input_files``) replacing the fixture's prompts; without a negative file
            there is no negative prompt, so CFG is off (diffusers' rule).
        latents: safetensors file with packed ``latents`` [B, N, in_channels] replacing the drawn
            initial latents x0 (the SDE noise is still drawn from ``seed``).
        condition: safetensors file with the edit pipelines' packed condition latents
            ``image_latents`` [B or 1, Nc, in_channels] and ``condition_grids`` [K, 2]
            (``sampling.input_files``): joined to the noisy tokens at every forward
            (``drifttool.model.conditions``); presets check the image count
            (``sampling.presets.check_conditions``).
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
    internals: bool | None = None
    dtype: str | None = None
    cfg_layout: str | None = None
    timestep_policy: str | None = None
    unavailable: tuple[tuple[str, str], ...] = ()
    variants: dict[str, tuple[str, Callable[..., Any]]] = dataclasses.field(default_factory=dict)
    pad_prompts_to: int | None = None
    sample_labels: list[int] | None = None
    lora: str | Path | None = None
    lora_mode: str | None = None
    preset: str | None = None
    device: str = "cpu"
    height: int | None = None
    width: int | None = None
    prompt_embeds: str | Path | None = None
    negative_prompt_embeds: str | Path | None = None
    latents: str | Path | None = None
    condition: str | Path | None = None

    def __post_init__(self) -> None:
        """A preset named in any case (``Diffusers-Edit``) kept by its canonical name, as a mode
        is (``check_mode``); an unknown name stays as given, for its refusal to show."""
        if isinstance(self.preset, str) and self.preset.lower() in PRESET_NAMES:
            object.__setattr__(self, "preset", self.preset.lower())


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The validated settings of one run (``resolve``); the manifest's ``settings`` is
    ``record()``.

    Attributes:
        fixture: the fixture's name. checkpoint: resolved path of an external model, or None.
        variant: weight variant of ``checkpoint`` (None: the default weights).
        lora: resolved path of the LoRA adapter, or None.
        lora_mode: how it runs (``model.lora.LORA_MODES``), None without an adapter.
        mode: runtime mode. capture: capture level. dtype: model dtype name (``DTYPES``).
        internals: whether a capture at L2 takes the fused attention's internals.
        steps, cfg_scale, eta, seed, cfg_layout, timestep_policy: sampler settings (values as
            the fixture or the caller gave them: ``cfg_scale`` 4.0 stays a float in the manifest).
        samples: logical sample ids of the batch. img_grid: (h, w) patch grid.
        pad_prompts_to: prompt padding (None: the batch's longest prompt).
        sample_labels: ids written instead of ``samples`` (a probe), or None.
        preset: the production preset (``drifttool.sampling.presets``), or None.
        device: where the model and the replay inputs live (``check_device``).
        external: the inputs read from ``--prompt-embeds``/``--negative-prompt-embeds``/
            ``--latents`` files (CPU tensors; ``ExternalInputs.files`` is recorded as
            ``input_files``), or None.
    """

    fixture: str
    checkpoint: str | None = None
    variant: str | None = None
    lora: str | None = None
    lora_mode: str | None = None
    mode: Mode
    capture: str
    internals: bool = True
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
    device: str = "cpu"
    external: ExternalInputs | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype (``DTYPES[dtype]``)."""
        return DTYPES[self.dtype]

    @property
    def internals_apply(self) -> bool:
        """Whether ``internals`` changes the capture: at L2 in a strict-family mode (production
        attention is one fused SDPA call that exposes no internals)."""
        return captures_internals(self.capture) and self.mode.family == "strict"

    @property
    def labels(self) -> list[int]:
        """The logical id written for each batch row (``sample_labels``, else ``samples``)."""
        return list(self.sample_labels if self.sample_labels is not None else self.samples)

    @property
    def image_size(self) -> tuple[int, int]:
        """(height, width) in pixels: ``img_grid`` × ``PATCH_PIXELS``."""
        return self.img_grid[0] * PATCH_PIXELS, self.img_grid[1] * PATCH_PIXELS

    @property
    def cfg_branches(self) -> int:
        """CFG branches per step: 2 (cond, uncond) when ``cfg_scale`` > 1 and there is a negative
        prompt (the fixture's, or a ``--negative-prompt-embeds`` file), else 1 (diffusers' rule,
        ``sampling.rollout``)."""
        ext = self.external
        has_negative = ext is None or ext.txt is None or ext.neg_txt is not None
        return 2 if self.cfg_scale > 1 and has_negative else 1

    def sampler(self) -> SamplerConfig:
        """The ``SamplerConfig`` these settings run (default SDE window; the preset's choices)."""
        cfg = SamplerConfig(num_steps=int(self.steps), cfg_scale=float(self.cfg_scale),
                            eta=float(self.eta), cfg_layout=self.cfg_layout,
                            timestep_policy=self.timestep_policy)
        return cfg if self.preset is None else apply_preset(cfg, self.preset, self.torch_dtype)

    def inputs(self, fx: Fixture, config: MMDiTConfig) -> tuple[RolloutInputs, dict[str, Any]]:
        """The replay inputs of these settings (CPU tensors) and their noise record
        (``sampling.inputs.build_inputs`` with the fixture's prompts, or the files' inputs).

        Raises:
            UnsupportedConfigError: the config cannot drive a rollout.
            DriftToolError: ``pad_prompts_to`` shorter than the longest prompt.
        """
        built = build_inputs(fx, seed=self.seed, samples=self.samples, img_grid=self.img_grid,
                             num_steps=self.steps, config=config, pad_prompts_to=self.pad_prompts_to,
                             sample_labels=self.sample_labels, external=self.external)
        if self.preset is None:
            return built
        inputs, record = preset_inputs(self.preset, *built, seed=self.seed, num_steps=self.steps,
                                       model_dtype=self.torch_dtype, samples=self.samples)
        if self.external is not None and self.external.x0 is not None:
            # latents from --latents: the pipeline casts given latents to its dtype, draws none
            x0 = built[0].x0.to(self.torch_dtype).to(torch.float32)
            inputs = dataclasses.replace(inputs, x0=x0)
            # said in the noise record's own field: the reader refuses keys it does not know
            order = [e for e in record.get("consumption_order", []) if not e.startswith("x0")]
            record = {**record, "consumption_order": [
                "x0: from --latents (rounded to the model dtype)", *order]}
        return inputs, record

    def record(self) -> dict[str, Any]:
        """The manifest's ``settings`` (``manifest_schema._SETTINGS``): every field as JSON, the optional
        ones (``variant``, ``lora``, ``pad_prompts_to``, ``sample_labels``, ``device`` when not
        ``cpu``, ``input_files`` when a file was given, ``internals`` when an L2 capture leaves
        them out) only when set."""
        out: dict[str, Any] = {
            "fixture": self.fixture, "checkpoint": self.checkpoint, "mode": self.mode.value,
            "capture": self.capture, "dtype": self.dtype, "steps": self.steps,
            "cfg_scale": self.cfg_scale, "eta": self.eta, "seed": self.seed,
            "samples": list(self.samples), "img_grid": list(self.img_grid),
            "cfg_layout": self.cfg_layout, "timestep_policy": self.timestep_policy,
        }
        optional = {"variant": self.variant, "lora": self.lora, "lora_mode": self.lora_mode,
                    "pad_prompts_to": self.pad_prompts_to,
                    "sample_labels": None if self.sample_labels is None else list(self.sample_labels),
                    "preset": self.preset,
                    "device": None if self.device == "cpu" else self.device,
                    "internals": None if self.internals or not self.internals_apply else False,
                    "input_files": dict(self.external.files) if self.external is not None and self.external.files
                    else None}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out


def _lora_mode(spec: RunSpec, mode: Mode) -> str | None:
    """The adapter's mode: ``spec.lora_mode``, else the preset's, else ``merged``; None without
    an adapter.

    Raises:
        DriftToolError: a mode without an adapter.
        UnsupportedConfigError: unknown mode; a non-merged mode under the strict family.
    """
    if spec.lora is None:
        if spec.lora_mode is not None:
            check_lora_mode(spec.lora_mode)  # a mistyped mode is named first
            raise DriftToolError("a LoRA mode needs an adapter (--lora-mode goes with --lora)")
        return None
    chosen = spec.lora_mode or (get_preset(spec.preset).lora_mode if spec.preset else "merged")
    return check_lora_mode(chosen, Mode(mode).family)


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _samples(spec: RunSpec, default: Any) -> tuple[int, ...]:
    if spec.samples is not None:
        ids = [int(i) for i in spec.samples]
    elif spec.batch is not None:
        if int(spec.batch) > MAX_SAMPLE_ID + 1:  # before its ids are listed
            raise DriftToolError(f"a batch of {spec.batch} samples is more than logical sample ids "
                                 f"0..{MAX_SAMPLE_ID} hold (the artifact's int32 sample column)")
        if int(spec.batch) > MAX_BATCH:  # before per-sample lists fill the host's memory
            raise DriftToolError(f"--batch {spec.batch}: more samples than one run takes (at most "
                                 f"{MAX_BATCH:,}); split them over runs (--samples)")
        ids = list(range(int(spec.batch)))
    else:
        ids = list(default or [])
    if not ids:
        raise DriftToolError("no sample ids: give at least one (--samples 0,1 or --batch N)")
    check_sample_ids(ids)
    return tuple(ids)


def _img_grid(spec: RunSpec, base: dict[str, Any]) -> tuple[int, int] | None:
    """The patch grid: ``height``/``width`` in pixels over the fixture's ``img_grid``."""
    grid = base.get("img_grid")
    h = None if spec.height is None else check_pixels("height", spec.height) // PATCH_PIXELS
    w = None if spec.width is None else check_pixels("width", spec.width) // PATCH_PIXELS
    if grid is None and (h is None or w is None):
        return None
    return (int(grid[0]) if h is None else h, int(grid[1]) if w is None else w)


def _lacking(fx: Fixture, values: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse a setting neither the fixture nor a flag (nor a preset) gave.

    Raises:
        DriftToolError: naming the fixture's file, the keys and the flags that give them.
    """
    missing = [k for k in keys if values[k] is None]
    if missing:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in missing)
        raise DriftToolError(f"{fx.path / 'fixture.json'}: its settings lack {', '.join(missing)}; "
                             f"give {flags}")


def resolve(spec: RunSpec) -> tuple[Fixture, RunSettings]:
    """Merge the spec over the fixture's settings; validate. Returns (fixture, settings).

    Raises:
        DriftToolError: steps outside 2..``MAX_STEPS``; cfg_scale or eta not a finite number
            >= 0 (a scale in [0, 1] runs without CFG, as diffusers does); unknown mode, capture level, dtype, CFG layout or timestep policy; empty,
            repeated or negative sample ids, or one past ``MAX_SAMPLE_ID``; a batch size and sample
            ids together; a seed outside ``SEEDS`` or one the preset's generators cannot take
            (``check_preset_seed``); a weight
            variant without a checkpoint; sample labels not one per sample; an unknown preset,
            or an explicit setting it contradicts (``sampling.presets.preset_settings``;
            ``UnsupportedConfigError`` for a preset under mode strict or audit); an unknown or
            unavailable device; height or width not a multiple of 16 in 16..``MAX_PIXELS``,
            or a size whose sigma table is not finite (``check_sigma_table``, an
            ``UnsupportedConfigError``); a bad input file (``sampling.input_files``).
        UnsupportedConfigError: a mode whose family cannot run on the device (strict on CUDA,
            ``check_mode_device``).
        FixtureError: the fixture cannot be found or read, or its settings are malformed.
    """
    fx = load_fixture(DEFAULT_FIXTURE if spec.fixture is None else spec.fixture)
    check_fixture_settings(fx)
    base = fx.settings
    if spec.samples is not None and spec.batch is not None:
        raise DriftToolError("give either a batch size or sample ids, not both")
    s = {key: _pick(getattr(spec, key), base.get(key))
         for key in ("steps", "cfg_scale", "eta", "seed", "capture", "dtype", "cfg_layout",
                     "timestep_policy")}
    for key in ("dtype", "cfg_layout", "timestep_policy"):  # names in any case, as --mode's
        if isinstance(s[key], str):
            s[key] = s[key].lower()
    preset = spec.preset if spec.preset is not None else base.get("preset")  # a fixture's own
    _lacking(fx, s, ("dtype",) if preset is not None else tuple(s))  # a preset gives some
    if s["dtype"] not in DTYPES:
        raise DriftToolError(f"unsupported dtype {s['dtype']!r} (one of {', '.join(sorted(DTYPES))})")
    if preset is not None:
        s.update(preset_settings(preset, mode=check_mode(spec.mode), model_dtype=DTYPES[s["dtype"]],
                                 asked={k: None if getattr(spec, k) is None else s[k]
                                        for k in ("cfg_layout", "timestep_policy", "eta")}))
    _lacking(fx, s, ("steps", "cfg_scale", "eta", "seed", "capture", "cfg_layout", "timestep_policy"))
    steps = check_steps(s["steps"])
    cfg_scale = check_number("cfg_scale", s["cfg_scale"], 0.0)  # <= 1: CFG off (diffusers' rule)
    eta = check_number("eta", s["eta"], 0.0)
    check_seed(s["seed"])
    if s["cfg_layout"] not in CFG_LAYOUTS:
        raise DriftToolError(f"unknown cfg_layout {s['cfg_layout']!r} (one of {', '.join(CFG_LAYOUTS)})")
    if s["timestep_policy"] not in TIMESTEP_POLICIES:
        raise DriftToolError(f"unknown timestep_policy {s['timestep_policy']!r} "
                             f"(one of {', '.join(TIMESTEP_POLICIES)})")
    mode = check_mode(spec.mode)
    device = check_device("cpu" if spec.device is None else spec.device)
    check_mode_device(mode, device)
    lora_mode = _lora_mode(spec, mode)
    capture = check_level(s["capture"])
    if spec.variant is not None and not spec.checkpoint:
        raise DriftToolError("a weight variant needs a checkpoint (--variant goes with --checkpoint)")
    grid = _img_grid(spec, base)
    if grid is None:
        raise DriftToolError(f"{fx.path / 'fixture.json'}: its settings lack img_grid; give "
                             "--height and --width")
    check_sigma_table(steps, grid)  # before any work: a size whose dynamic shift breaks the table
    explicit = spec.samples is not None or spec.batch is not None
    external = None
    files = (spec.prompt_embeds, spec.negative_prompt_embeds, spec.latents, spec.condition)
    if any(f is not None for f in files):
        external = read_external_inputs(
            prompt_embeds=spec.prompt_embeds, negative_prompt_embeds=spec.negative_prompt_embeds,
            latents=spec.latents, config=read_config(spec.checkpoint or fx.model_dir), img_grid=grid,
            batch=len(_samples(spec, None)) if explicit else None, condition=spec.condition)
    if preset is not None and spec.condition is not None:  # too many; too few: the runner,
        check_conditions(preset, external.cond_grids)       # which sees replayed inputs too
    default_ids = base.get("samples")
    if external is not None and not explicit:
        default_ids = list(range(external.batch or len(default_ids or ())))
    samples = _samples(spec, default_ids)
    if preset is not None:
        check_preset_seed(preset, s["seed"], samples)
    labels = None
    if spec.sample_labels is not None:
        labels = tuple(int(i) for i in spec.sample_labels)
        if len(labels) != len(samples):
            raise DriftToolError(f"sample_labels {list(labels)} must name one id per sample "
                                 f"of {list(samples)}")
    return fx, RunSettings(
        fixture=fx.name,
        checkpoint=str(Path(spec.checkpoint).resolve()) if spec.checkpoint else None,
        variant=spec.variant, lora=None if spec.lora is None else str(Path(spec.lora).resolve()),
        lora_mode=lora_mode, mode=mode, capture=capture, internals=spec.internals is not False, dtype=s["dtype"], steps=steps, cfg_scale=cfg_scale, eta=eta,
        seed=s["seed"], samples=samples, img_grid=grid,
        cfg_layout=s["cfg_layout"], timestep_policy=s["timestep_policy"],
        pad_prompts_to=None if spec.pad_prompts_to is None else int(spec.pad_prompts_to),
        sample_labels=labels, preset=preset, device=device, external=external,
    )
