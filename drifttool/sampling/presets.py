"""Production presets: drifttool's sampler set up to reproduce a real pipeline byte for byte.

    >>> cfg = apply_preset(SamplerConfig(num_steps=10, cfg_scale=4.0), "diffusers", torch.bfloat16)
    >>> cfg.latents_dtype, cfg.timestep_policy, cfg.cfg_layout, cfg.step_rule, cfg.eta
    ('bfloat16', 'pipeline_bf16', 'sequential', 'diffusers_euler', 0.0)
    >>> apply_preset(SamplerConfig(num_steps=10), "flow-grpo", torch.bfloat16).train_timestep_policy
    't_div_1000_fp32'
    >>> check_conditions("diffusers-edit", ((52, 78),))     # one condition image: fine

A preset is a named bundle of the sampler's byte-changing choices (``Preset``): the dtype of the
latents between steps, the model timestep encoding of the rollout (and of the trainer's
recompute), the CFG execution layout, the step rule (``ops.scheduler.STEP_RULES``) and where the
noise comes from. It changes no operator: it selects the production kernels
(``cfg_combine_renorm`` in the velocity dtype, ``flow_sde_step_logp`` with the preset's rule),
so a preset run executes under the production family only (mode ``auto`` or ``off``; strict and
audit fail closed, ``rollout.check_family``).

=============  ==============================  ====================================
               ``diffusers``                   ``flow-grpo``
=============  ==============================  ====================================
reproduces     ``QwenImagePipeline.__call__``  Flow-GRPO's Qwen-Image rollout
               (diffusers 0.42.1, §3)          ``pipeline_with_logprob`` + trainer's
                                               ``compute_log_prob`` (§4, §4.1)
latents        model dtype W between steps     W between steps; x' of the SDE step
                                               in fp32, cast to W when stored
timestep       bf16(bf16(t)/1000) (bf16 W;     rollout as diffusers; recompute
               fp32 t/1000 for fp32 W)         ``t_div_1000_fp32`` (stored fp32 t/1000)
CFG            sequential (two forwards,       batched [cond; uncond], both masks;
               own masks); renorm in W         renorm in W
step           ``scheduler.step``: fp32(x) +   ``sde_step_with_logprob`` on fp32 v, x at
               W(Δσ·v), cast to W; no SDE      every step (η outside the window = 0)
noise          x0: one CPU ``torch.Generator`` x0 and every step's SDE noise from one
               per sample seeded seed + id     CPU ``torch.Generator`` seeded ``seed``, in
               (randn (1,16,H',W'), packed),   Flow-GRPO's order: randn (B,1,16,H',W')
               rounded to W                    packed, rounded to W; then randn (B,N,64)
                                               fp32 per step (every step)
LoRA           ``load_lora_weights``: peft     a peft-wrapped transformer: layers
               layers unfused, factors in W    unfused, factors FP32 (``unfused-fp32``)
               (``unfused``; ``--lora-mode
               fused`` after ``fuse_lora``)
=============  ==============================  ====================================

``diffusers-edit`` and ``diffusers-edit-plus`` are ``diffusers`` for ``QwenImageEditPipeline``
and ``QwenImageEditPlusPipeline``: the same loop (sequential CFG, renorm, Euler step, sigma table
on the N noisy tokens, noise), with the condition latents (``--condition``) joined to the noisy
tokens at every forward of both branches (``drifttool.model.conditions``). ``diffusers-edit``
takes exactly one condition image, ``diffusers-edit-plus`` one or more; ``diffusers`` and
``flow-grpo`` take none (their pipelines have no condition image): ``check_conditions``. The
Edit-2511 variant (``zero_cond_t``: condition tokens modulated at t = 0) is not reproduced.

Noise: the pipelines draw the initial latents directly in W (on the CPU the bits equal an fp32
draw rounded to W, numerics §3.2), so the preset's ``x0`` holds W values (exact in fp32). Flow-GRPO
draws its SDE noise from the global RNG without a generator; ``preset_inputs`` reproduces that
stream for a trainer that seeded the global CPU RNG with ``seed`` and passes no generator (on a
GPU the trainer draws from the device's generator: pass its noise as replay inputs instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runtime import Mode
from drifttool.sampling.config import LATENT_DTYPES, SamplerConfig
from drifttool.sampling.inputs import RolloutInputs
from drifttool.sampling.noise import draw_noise, noise_record, pack_latents
from drifttool.sampling.preset_table import (  # noqa: F401  (the table, re-exported: it needs no torch)
    PRESET_NAMES, PRESETS, Preset, check_preset_seed, get_preset)


def check_conditions(name: str, cond_grids: Sequence, *, source: str = "--condition") -> None:
    """Refuse condition images the preset's pipeline does not take (``Preset.conditions``):
    ``cond_grids`` has one entry per image (its grid, or its file: only the count matters);
    ``source`` names where they come from (``--condition`` latents, or ``--image``).

    Raises:
        DriftToolError: unknown preset; too few or too many condition images (one line).
    """
    p = get_preset(name)
    least, most = p.conditions
    k = len(cond_grids)
    if k < least or (most is not None and k > most):
        if most == 0:
            want = f"no condition image ({source} needs --preset diffusers-edit or diffusers-edit-plus)"
        else:
            images = f"{least} condition image{'s' * (least != 1)} ({source})"
            want = f"at least {images}" if most is None else f"exactly {images}"
        more = "; several take --preset diffusers-edit-plus" if most == 1 and k > 1 else ""
        raise DriftToolError(f"preset {name!r} reproduces {p.pipeline}, which takes {want}; "
                             f"the run has {k}{more}")


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in LATENT_DTYPES.items():
        if dt == dtype:
            return name
    raise DriftToolError(f"a preset keeps the latents in the model dtype; {dtype} is not one of "
                         f"{', '.join(LATENT_DTYPES)}")


def rollout_timestep_policy(model_dtype: torch.dtype) -> str:
    """The pipelines' model timestep: ``t.to(latents dtype) / 1000`` in the latents dtype, i.e.
    ``pipeline_bf16`` for bf16 latents and ``t_div_1000_fp32`` for fp32 ones (numerics §3.4)."""
    return "pipeline_bf16" if model_dtype == torch.bfloat16 else "t_div_1000_fp32"


def apply_preset(cfg: SamplerConfig, name: str, model_dtype: torch.dtype) -> SamplerConfig:
    """``cfg`` with the preset's choices for a model of dtype ``model_dtype`` (the latents dtype
    of the pipelines): latents dtype, rollout and recompute timestep policies, CFG layout, step
    rule, η = 0 without SDE, and ``preset`` = ``name``. ``num_steps``, ``cfg_scale``, ``eta``
    (with SDE), ``sde_window`` and ``image_seq_len`` are kept.

    Raises:
        DriftToolError: unknown preset, or a model dtype other than fp32/bf16.
    """
    p = get_preset(name)
    return dataclasses.replace(
        cfg, latents_dtype=_dtype_name(model_dtype), timestep_policy=rollout_timestep_policy(model_dtype),
        cfg_layout=p.cfg_layout, step_rule=p.step_rule, eta=float(cfg.eta) if p.sde else 0.0,
        train_timestep_policy=p.train_timestep_policy, preset=p.name)


def preset_settings(name: str, *, mode: Mode, model_dtype: torch.dtype,
                    asked: dict[str, Any]) -> dict[str, Any]:
    """The run settings a preset fixes (``drifttool.settings.resolve``): ``cfg_layout``,
    ``timestep_policy`` (the rollout's) and ``eta`` (0 without SDE), checked against what the run
    asked for explicitly (``asked``: those keys, ``None`` when not given).

    Raises:
        DriftToolError: unknown preset or model dtype; an explicit setting the preset contradicts.
        UnsupportedConfigError: a mode that does not run the production family (one line).
    """
    p = get_preset(name)
    if Mode(mode).family != "production":
        raise UnsupportedConfigError(
            f"preset {name!r} reproduces a production pipeline's arithmetic (bf16 latents, its "
            f"scheduler step): mode {Mode(mode).value!r} runs the strict family; use --mode auto or off")
    fixed = {"cfg_layout": p.cfg_layout, "timestep_policy": rollout_timestep_policy(model_dtype)}
    _dtype_name(model_dtype)
    for key, value in fixed.items():
        if asked.get(key) is not None and asked[key] != value:
            raise DriftToolError(f"preset {name!r} runs {key} {value!r}; the run asks for {asked[key]!r}")
    eta = asked.get("eta")
    if not p.sde:
        if eta is not None and eta != 0:
            raise DriftToolError(f"preset {name!r} has no SDE (its scheduler step is deterministic): "
                                 f"eta must be 0, the run asks for {eta!r}")
        fixed["eta"] = 0.0
    return fixed


def flowgrpo_noise(seed: int, batch: int, *, img_grid: tuple[int, int], num_steps: int,
                   channels: int = 16, dtype: torch.dtype = torch.bfloat16
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO's draws from one CPU ``torch.Generator`` seeded ``seed``, in its order
    (numerics §4.1): the initial latents ``randn(B, 1, C, 2h, 2w)`` drawn in the latents dtype
    ``dtype`` (as ``prepare_latents`` draws them), packed as the pipeline packs them, then one
    ``randn(B, h·w, 4C)`` fp32 per step, every step.

    Returns:
        ``(x0 [B, N, 4C] fp32 holding ``dtype`` values, noise [num_steps, B, N, 4C] fp32)`` on
        the CPU.
    """
    h, w = (int(a) for a in img_grid)
    g = torch.Generator().manual_seed(int(seed))
    z = torch.randn((batch, 1, channels, 2 * h, 2 * w), generator=g, dtype=dtype)
    z = z.to(torch.float32)  # exact
    x0 = torch.cat([pack_latents(z[b]) for b in range(batch)])  # [B, N, 4C]
    steps = [torch.randn((batch, h * w, 4 * channels), generator=g, dtype=torch.float32)
             for _ in range(num_steps)]
    noise = torch.stack(steps) if steps else torch.empty(0, batch, h * w, 4 * channels)
    return x0.contiguous(), noise


def _flowgrpo_record(seed: int, batch: int, img_grid: tuple[int, int], num_steps: int,
                     channels: int) -> dict[str, Any]:
    h, w = (int(a) for a in img_grid)
    n, c4 = h * w, 4 * channels
    rec = noise_record(seed, img_grid=img_grid, num_steps=num_steps, channels=channels,
                       generator="torch", derivation="offset")
    rec.update({
        "generator": "torch.Generator (mt19937), one for the batch (Flow-GRPO's global RNG order)",
        "seed_derivation": "flowgrpo-global-v1",
        "seed_formula": "torch.Generator().manual_seed(seed), shared by every sample of the batch",
        "latent_shape": [int(batch), 1, int(channels), 2 * h, 2 * w],
        "consumption_order": [
            f"x0: randn({batch}, 1, {channels}, {2 * h}, {2 * w}) in the latents dtype, each sample "
            f"packed view(C,h,2,w,2).permute(1,3,0,2,4).reshape({n},{c4}), stored as fp32",
            f"steps 0..{int(num_steps) - 1}: randn({batch}, {n}, {c4}) fp32 each, in step order "
            "(drawn at every step, as Flow-GRPO's sde_step_with_logprob does)",
        ],
    })
    return rec


def preset_inputs(name: str, inputs: RolloutInputs, record: dict[str, Any], *, seed: int,
                  num_steps: int, model_dtype: torch.dtype,
                  samples: Sequence[int] | None = None) -> tuple[RolloutInputs, dict[str, Any]]:
    """Replay inputs with the preset's noise (module table): ``inputs`` (from
    ``sampling.inputs.build_inputs``, whose prompts are kept) with x0 and the step noise redrawn
    as the preset's pipeline draws them and x0 rounded to the latents dtype; returns the inputs
    and their noise record (``sampling.noise.noise_record`` fields). ``samples``: the logical
    sample ids whose noise is drawn (default ``inputs.sample_ids``; differs when the rows carry
    other labels).

    Raises:
        DriftToolError: unknown preset or model dtype.
    """
    p = get_preset(name)
    ldt = LATENT_DTYPES[_dtype_name(model_dtype)]
    h, w = inputs.img_grid
    channels = inputs.x0.shape[-1] // 4
    if p.noise == "per_sample_offset":
        ids = list(inputs.sample_ids if samples is None else samples)
        pinned = draw_noise(seed, ids, img_grid=(h, w), num_steps=0,
                            channels=channels, generator="torch", derivation="offset")
        x0, noise, rec = pinned.x0, None, dict(pinned.record)
        rec["num_steps"] = int(num_steps)
        rec["consumption_order"] = [rec["consumption_order"][0] + ", rounded to the latents dtype",
                                    "steps: none (the pipeline's Euler step is deterministic)"]
    else:
        x0, noise = flowgrpo_noise(seed, inputs.batch, img_grid=(h, w), num_steps=num_steps,
                                   channels=channels, dtype=ldt)
        rec = _flowgrpo_record(seed, inputs.batch, (h, w), num_steps, channels)
    x0 = x0.to(ldt).to(torch.float32).to(inputs.x0.device)  # W values, exact in fp32
    if noise is not None:
        noise = noise.to(inputs.x0.device)
    return dataclasses.replace(inputs, x0=x0, noise=noise), rec
