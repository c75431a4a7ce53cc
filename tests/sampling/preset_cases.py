"""Shared pieces of the preset parity tests (CPU: tests/sampling/test_presets.py; GPU:
tests/gpu/test_presets_cuda.py): the two models on one set of tiny weights, fresh random cases,
the real pipeline's per-step latents, and drifttool's preset rollout of the same inputs.

A ``Case`` is one pipeline call: batch, CFG on/off, image size in pixels, each prompt's valid
length (right-padded to the longest, pads filled with random garbage: a masked pad must not
matter), and the negative prompt's lengths (CFG on).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage
from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.inputs import RolloutInputs
from drifttool.sampling.presets import apply_preset
from drifttool.sampling.rollout import Trajectory, rollout
from drifttool.sampling.step import sampler_model
from tests.diffusers_pipeline import tiny_pipeline


@dataclass(frozen=True)
class Case:
    batch: int
    cfg: bool
    height: int  # pixels (multiple of 16)
    width: int
    lens: tuple[int, ...]  # valid prompt tokens per row
    neg_lens: tuple[int, ...] = ()  # valid negative-prompt tokens per row (CFG on)
    steps: int = 5

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // 16, self.width // 16

    def __str__(self) -> str:
        return (f"B{self.batch}-{'cfg' if self.cfg else 'nocfg'}-{self.height}x{self.width}-"
                f"L{'.'.join(map(str, self.lens))}")


@functools.lru_cache(maxsize=None)
def diffusers_transformer(device: str = "cpu"):
    """The tiny fixture's transformer, loaded by diffusers (bf16), unmodified."""
    from diffusers import QwenImageTransformer2DModel

    fx = load_fixture("tiny-t2i")
    tr = QwenImageTransformer2DModel.from_pretrained(str(fx.model_dir), torch_dtype=torch.bfloat16)
    return tr.eval().to(device)


@functools.lru_cache(maxsize=None)
def drifttool_mmdit(device: str = "cpu"):
    """drifttool's own MMDiT on the same weights (bf16), run by the production family."""
    return load_checkpoint(load_fixture("tiny-t2i").model_dir, dtype=torch.bfloat16, device=device)


def models(device: str = "cpu") -> dict[str, torch.nn.Module]:
    """The two models a preset run may drive: the diffusers transformer behind drifttool's model
    call (capture adapter) and drifttool's own production MMDiT."""
    return {"diffusers-adapter": DiffusersQwenImage(diffusers_transformer(device)),
            "drifttool-mmdit": drifttool_mmdit(device)}


def _prompts(g: torch.Generator, lens: tuple[int, ...], width: int, D: int, device: str):
    """[B, width, D] bf16 random prompts (pads random too) and their [B, width] bool masks."""
    txt = torch.randn(len(lens), width, D, generator=g).to(torch.bfloat16).to(device)
    mask = torch.stack([torch.arange(width) < n for n in lens]).to(device)
    return txt, mask


def make_inputs(case: Case, seed: int, *, device: str = "cpu", D: int = 32,
                common_length: bool = False) -> RolloutInputs:
    """Fresh random inputs: x0 [B, N, 64] holding bf16 values (as the pipeline draws them),
    prompts right-padded to their longest row; ``common_length`` pads the negative prompt to the
    prompts' length too (Flow-GRPO encodes both in one batch)."""
    g = torch.Generator().manual_seed(seed)
    h, w = case.grid
    width = max(case.lens + (case.neg_lens if common_length else ()))
    txt, mask = _prompts(g, case.lens, width, D, device)
    neg = neg_mask = None
    if case.cfg:
        nwidth = width if common_length else max(case.neg_lens) + 2
        neg, neg_mask = _prompts(g, case.neg_lens, nwidth, D, device)
    x0 = torch.randn(case.batch, h * w, 64, generator=g).to(torch.bfloat16).to(torch.float32)
    return RolloutInputs(sample_ids=list(range(case.batch)), x0=x0.to(device), txt=txt,
                         img_grid=(h, w), txt_mask=None if bool(mask.all()) else mask,
                         neg_txt=neg, neg_mask=None if neg_mask is None or bool(neg_mask.all()) else neg_mask)


def full_mask(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones(t.shape[:2], dtype=torch.bool, device=t.device) if mask is None else mask


def run_pipeline(case: Case, inputs: RolloutInputs, *, cfg_scale: float = 4.0, device: str = "cpu"):
    """The unmodified ``QwenImagePipeline`` on ``inputs`` (``latents=x0``): returns (the latents
    after each step [steps, B, N, 64] bf16 from ``callback_on_step_end``, the output latents,
    the scheduler's sigmas after the run)."""
    pipe = tiny_pipeline(diffusers_transformer(device))
    seen: list[torch.Tensor] = []

    def on_step(p, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        return kwargs

    neg = {}
    if case.cfg:
        neg = dict(negative_prompt_embeds=inputs.neg_txt,
                   negative_prompt_embeds_mask=full_mask(inputs.neg_txt, inputs.neg_mask).long())
    out = pipe(prompt_embeds=inputs.txt, prompt_embeds_mask=full_mask(inputs.txt, inputs.txt_mask).long(),
               true_cfg_scale=cfg_scale, height=case.height, width=case.width,
               num_inference_steps=case.steps, latents=inputs.x0.clone(), output_type="latent",
               callback_on_step_end=on_step, **neg).images
    return torch.stack(seen), out, pipe.scheduler.sigmas.clone()


def preset_rollout(model, inputs: RolloutInputs, case: Case, preset: str, *, cfg_scale: float = 4.0,
                   eta: float = 1.2, window: tuple[int, int] | None = None,
                   mode: str = "auto") -> tuple[Trajectory, SamplerConfig]:
    """drifttool's rollout of ``inputs`` under ``preset`` (production family)."""
    cfg = apply_preset(SamplerConfig(num_steps=case.steps, cfg_scale=cfg_scale, eta=eta,
                                     sde_window=window), preset, torch.bfloat16)
    return rollout(sampler_model(model), inputs, cfg, Runtime(mode=mode)), cfg
