"""Shared pieces of the edit-pipeline tests (tests/sampling/test_edit.py): unmodified
``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` from tiny components (the tiny
fixture's transformer, a random tiny VAE, Qwen-Image's scheduler; no text encoder: prompt
embeddings are passed in), run on random images, with what their transformer received.

The pipelines resize every condition image to a fixed area (1024² for the VAE) at its aspect
ratio; the tests shrink that area (``small_areas``: the module globals the pipelines read, the
pipeline code unchanged) so a run takes a second.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from tests.diffusers_pipeline import qwen_image_scheduler
from tests.sampling.preset_cases import diffusers_transformer

TINY_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                temperal_downsample=[False, True, True])
"""The research notes' tiny Qwen-Image VAE (as tests/model/test_vae.py)."""

VAE_AREA = 96 * 128
"""The condition-image area the tests give the pipelines instead of 1024²."""


@functools.lru_cache(maxsize=None)
def tiny_vae():
    """A random ``AutoencoderKLQwenImage`` (bf16, eval; gammas randomised)."""
    from diffusers import AutoencoderKLQwenImage

    g = torch.Generator().manual_seed(11)
    vae = AutoencoderKLQwenImage(**TINY_VAE).eval()
    with torch.no_grad():
        for name, p in sorted(vae.named_parameters()):
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return vae.to(torch.bfloat16)


def edit_pipeline(plus: bool):
    """An unmodified edit (or edit-plus) pipeline around the tiny fixture's bf16 transformer."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls(scheduler=qwen_image_scheduler(), vae=tiny_vae(), text_encoder=None, tokenizer=None,
               processor=None, transformer=diffusers_transformer())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def small_areas(monkeypatch) -> None:
    """Shrink the pipelines' condition-image area to ``VAE_AREA`` (module globals only)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(VAE_AREA, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", VAE_AREA)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 64 * 64)


def condition_grid(width: int, height: int) -> tuple[int, int]:
    """The patch grid (h, w) the pipelines give an image of ``width`` × ``height`` pixels: its
    ``VAE_AREA`` size (``calculate_dimensions``, multiples of 32) over 16."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    w, h = calculate_dimensions(VAE_AREA, width / height)
    return h // 16, w // 16


def random_image(g: torch.Generator, width: int, height: int):
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(np.asarray(pixels))


@dataclass
class PipelineRun:
    """What an edit pipeline computed: the latents after each step [steps, B, N, 64] bf16, the
    transformer's first call (its ``hidden_states`` [B, N + Nc, 64] and ``img_shapes``), and the
    number of transformer calls."""

    per_step: torch.Tensor
    hidden_states: torch.Tensor
    img_shapes: list
    calls: int


def run_edit_pipeline(plus: bool, images, *, prompt_embeds, prompt_mask, neg=None, neg_mask=None,
                      height: int, width: int, steps: int, latents: torch.Tensor,
                      cfg_scale: float = 4.0) -> PipelineRun:
    """The unmodified pipeline on ``images`` (PIL; a list for edit-plus) with the given prompt
    embeddings, ``latents`` as the initial noise and ``output_type="latent"``."""
    pipe = edit_pipeline(plus)
    seen: list[torch.Tensor] = []
    first: dict = {}
    calls = []

    def pre(module, args, kwargs):
        calls.append(None)
        if not first:
            first["hidden_states"] = kwargs["hidden_states"].clone()
            first["img_shapes"] = kwargs["img_shapes"]

    def on_step(p, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        return kwargs

    handle = pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        extra = {} if neg is None else dict(negative_prompt_embeds=neg,
                                            negative_prompt_embeds_mask=neg_mask)
        pipe(image=images, prompt_embeds=prompt_embeds, prompt_embeds_mask=prompt_mask,
             true_cfg_scale=cfg_scale, height=height, width=width, num_inference_steps=steps,
             latents=latents, output_type="latent", callback_on_step_end=on_step, **extra)
    finally:
        handle.remove()
    return PipelineRun(torch.stack(seen), first["hidden_states"], first["img_shapes"], len(calls))
