"""The production presets' table (``Preset``, ``PRESETS``) and the checks that need no torch
(``check_preset_seed``): ``drifttool.sampling.presets`` builds the sampler from them, and the
checks of a fixture's settings (``drifttool.fixture_settings``, ``drifttool.verify``) read them
without loading torch (``fixture verify``'s seal check stays torch-free: tests/cli/test_import_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from drifttool.errors import DriftToolError


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One production preset (``drifttool.sampling.presets``' table says what each reproduces).

    Attributes:
        name: CLI and manifest name.
        cfg_layout: ``config.CFG_LAYOUTS`` entry.
        step_rule: ``ops.scheduler.STEP_RULES`` entry.
        sde: whether the SDE (η, window) applies; ``False`` forces η = 0.
        train_timestep_policy: the recompute's timestep policy, or ``None`` (= the rollout's).
        noise: ``"per_sample_offset"`` (diffusers' generator list) or ``"flowgrpo_global"``.
        lora_mode: how the pipeline runs a LoRA adapter (``model.lora.LORA_MODES``), the
            default of ``--lora-mode`` under the preset.
        conditions: how many condition images the pipeline takes, ``(least, most)`` (``None``:
            no limit); ``(0, 0)`` for a pipeline without condition images.
        pipeline: the pipeline class it reproduces (messages).
    """

    name: str
    cfg_layout: str
    step_rule: str
    sde: bool
    train_timestep_policy: str | None
    noise: str
    lora_mode: str
    conditions: tuple[int, int | None] = (0, 0)
    pipeline: str = "QwenImagePipeline"


_DIFFUSERS = dict(cfg_layout="sequential", step_rule="diffusers_euler", sde=False,
                  train_timestep_policy=None, noise="per_sample_offset", lora_mode="unfused")
PRESETS: dict[str, Preset] = {
    "diffusers": Preset(name="diffusers", **_DIFFUSERS),
    "diffusers-edit": Preset(name="diffusers-edit", **_DIFFUSERS, conditions=(1, 1),
                             pipeline="QwenImageEditPipeline"),
    "diffusers-edit-plus": Preset(name="diffusers-edit-plus", **_DIFFUSERS, conditions=(1, None),
                                  pipeline="QwenImageEditPlusPipeline"),
    "flow-grpo": Preset(
        name="flow-grpo",
        cfg_layout="batched", step_rule="flow_grpo", sde=True,
        train_timestep_policy="t_div_1000_fp32", noise="flowgrpo_global", lora_mode="unfused-fp32",
        pipeline="Flow-GRPO's QwenImage pipeline_with_logprob"),
}
"""The presets by name (``manifest_schema.PRESETS`` repeats the names for the torch-free reader)."""

PRESET_NAMES = tuple(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset ``name``.

    Raises:
        DriftToolError: unknown name (one line naming the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise DriftToolError(f"unknown preset {name!r} (one of {', '.join(PRESET_NAMES)})") from None


def check_preset_seed(name: str, seed: Any, samples: Sequence[int]) -> None:
    """Refuse a seed the preset's torch generators cannot take, before any work: diffusers'
    generator list seeds sample i with ``seed + i`` (``noise.sample_seed``, derivation
    ``offset``: [0, 2^63)). Flow-GRPO's one generator takes ``manual_seed(seed)``, whose range
    ([-2^63, 2^64)) every run's seed is checked against already (``settings``).

    Raises:
        DriftToolError: unknown preset; a seed plus a sample id outside that range (one line).
    """
    p = get_preset(name)
    seed = int(seed)
    if p.noise == "per_sample_offset":
        bad = [i for i in samples if not 0 <= seed + int(i) < 1 << 63]
        if bad:
            raise DriftToolError(
                f"preset {name!r} seeds sample i's generator with seed + i (diffusers' generator "
                f"list): seed + sample id must be in [0, 2^63), got seed {seed} with sample {bad[0]}")
