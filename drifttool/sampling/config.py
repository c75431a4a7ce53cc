"""Sampler settings: ``SamplerConfig`` (every byte-changing choice of the denoising loop) and the
values its fields take.

    >>> cfg = SamplerConfig(num_steps=10, cfg_scale=4.0, eta=1.2)
    >>> cfg.window(), cfg.in_window(8), cfg.in_window(9)   # SDE window: every step but the last
    ((0, 9), True, False)

The rollout loop that reads it is ``drifttool.sampling.rollout``; production presets that set its
fields as a real pipeline does are ``drifttool.sampling.presets``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drifttool.ops.scheduler import STEP_RULES, TIMESTEP_POLICIES

CFG_LAYOUTS = ("batched", "sequential")
"""CFG execution layouts (``manifest_schema.CFG_LAYOUTS`` repeats them; a test checks they agree)."""
LATENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes the latents may be kept in between steps (``SamplerConfig.latents_dtype``)."""
SAMPLER_BLOCK = -2
"""``block`` scope of the sampler operators (``flow_sigma_table``, ``cfg_combine_renorm``,
``flow_sde_step_logp``): outside the model. ``schema.SAMPLER_BLOCK`` repeats it for the torch-free
reader and diff (a test checks they agree)."""


@dataclass(kw_only=True)
class SamplerConfig:
    """Sampler settings (one config per concept; every byte-changing choice is here).

    Attributes:
        num_steps: N denoising steps (the sigma table has N + 1 entries).
        cfg_scale: true-CFG scale s; CFG runs when s > 1 **and** negative prompt embeddings are
            given (diffusers' rule). Default 4.0 (pipeline default and Flow-GRPO's config).
        eta: SDE noise level η inside the window (Flow-GRPO ``noise_level``; 1.2 in
            ``pickscore_qwenimage``). 0 everywhere gives the deterministic Euler sampler.
        sde_window: half-open step range [start, end) where η applies; ``None`` = (0, N − 1):
            every step but the last (Flow-GRPO with window size 0, numerics §4.1).
        timestep_policy: model timestep encoding, see ``ops.scheduler.TIMESTEP_POLICIES``;
            training recompute must use the rollout's policy.
        cfg_layout: ``"batched"`` (one forward on [cond; uncond], as Flow-GRPO) or
            ``"sequential"`` (two forwards, as diffusers).
        image_seq_len: token count used for the dynamic shift; ``None`` = h·w of the grid.
        latents_dtype: dtype of the latents between steps (``LATENT_DTYPES``): x0 is cast to
            it, and every step's x_next is cast to it before it is stored and fed on.
        step_rule: the step's arithmetic, ``ops.scheduler.STEP_RULES`` (``"sde"``: drifttool's
            default; ``"flow_grpo"``/``"diffusers_euler"``: production kernels of the presets).
        train_timestep_policy: the timestep policy of ``recompute`` when it differs from the
            rollout's (Flow-GRPO's trainer: ``"t_div_1000_fp32"``); ``None`` = the same.
        preset: the ``drifttool.sampling.presets`` name these fields were set from (recorded;
            the rollout reads the fields, not the name); ``None`` = no preset.
    """

    num_steps: int
    cfg_scale: float = 4.0
    eta: float = 1.2
    sde_window: tuple[int, int] | None = None
    timestep_policy: str = "sigma_fp32"
    cfg_layout: str = "batched"
    image_seq_len: int | None = None
    latents_dtype: str = "float32"
    step_rule: str = "sde"
    train_timestep_policy: str | None = None
    preset: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 2:
            raise ValueError(f"num_steps must be an int >= 2, got {self.num_steps!r}")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.timestep_policy not in TIMESTEP_POLICIES:
            raise ValueError(f"timestep_policy {self.timestep_policy!r} not in {TIMESTEP_POLICIES}")
        if self.cfg_layout not in CFG_LAYOUTS:
            raise ValueError(f"cfg_layout {self.cfg_layout!r} not in {CFG_LAYOUTS}")
        if self.latents_dtype not in LATENT_DTYPES:
            raise ValueError(f"latents_dtype {self.latents_dtype!r} not in {tuple(LATENT_DTYPES)}")
        if self.step_rule not in STEP_RULES:
            raise ValueError(f"step_rule {self.step_rule!r} not in {STEP_RULES}")
        if self.step_rule == "diffusers_euler" and self.eta != 0:
            raise ValueError(f"step_rule 'diffusers_euler' is deterministic: eta must be 0, got {self.eta}")
        if self.train_timestep_policy is not None and self.train_timestep_policy not in TIMESTEP_POLICIES:
            raise ValueError(f"train_timestep_policy {self.train_timestep_policy!r} not in "
                             f"{TIMESTEP_POLICIES}")
        start, end = self.window()
        if not 0 <= start <= end <= self.num_steps:
            raise ValueError(f"sde_window {self.sde_window} outside [0, {self.num_steps}]")

    def window(self) -> tuple[int, int]:
        """The resolved SDE window [start, end)."""
        if self.sde_window is None:
            return (0, self.num_steps - 1)
        return (int(self.sde_window[0]), int(self.sde_window[1]))

    def in_window(self, step: int) -> bool:
        """Whether step ``step`` is stochastic (η > 0 applies and logp_t is defined)."""
        start, end = self.window()
        return start <= step < end and self.eta > 0

    def eta_at(self, step: int) -> float:
        """η of step ``step``: ``eta`` inside the SDE window, 0 outside (deterministic Euler)."""
        return float(self.eta) if self.in_window(step) else 0.0

    @property
    def latents_torch_dtype(self) -> torch.dtype:
        """``latents_dtype`` as a torch dtype."""
        return LATENT_DTYPES[self.latents_dtype]

    def policy(self, phase: str) -> str:
        """The timestep policy of ``phase``: ``train_timestep_policy`` (if set) for a recompute,
        else ``timestep_policy``."""
        if phase != "rollout" and self.train_timestep_policy is not None:
            return self.train_timestep_policy
        return self.timestep_policy

    def noise_at_step(self, step: int) -> bool:
        """Whether a sampling step takes its pinned noise: inside the SDE window, or at every
        step under ``step_rule="flow_grpo"`` (Flow-GRPO draws one at every step)."""
        if self.step_rule == "diffusers_euler":
            return False
        return self.step_rule == "flow_grpo" or self.in_window(step)
