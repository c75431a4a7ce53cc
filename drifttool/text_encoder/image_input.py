"""A prompt image as the vision tower takes it (component ``text_encoder``, stream ``img``,
block −1): the image processor of the edit pipelines (transformers' ``Qwen2VLImageProcessor``,
its PIL backend).

    >>> pixels, grid = prepare_image(image, processor_cfg, rt, sample=0)  # [N, 1176] fp32, (1, h, w)

The smart resize's target size (``vision_grid.smart_resize``: multiples of patch · merge within
the configured pixel bounds), then ``te_vision_resize`` and ``te_vision_patchify``, captured per
image under its prompt's sample.
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.ops.specs import OPERATORS
from drifttool.runtime import Runtime
from drifttool.text_encoder.vision_config import ImageProcessorConfig
from drifttool.text_encoder.vision_grid import Grid, smart_resize


def _op(rt: Runtime, name: str, *args):
    return call(rt, name, *args, stream="img", layout=OPERATORS[name].layout)


def prepare_image(image: torch.Tensor, cfg: ImageProcessorConfig, rt: Runtime, sample: int) -> tuple[torch.Tensor, Grid]:
    """``pixel_values`` and grid of one prompt image, as the image processor makes them.

    Args:
        image: [H, W, 3] uint8 RGB.  cfg: the processor's settings.  rt: the runtime.
        sample: the logical sample of the image's prompt (its records' sample).
    Returns:
        (pixels [(h/P)·(w/P), 3·T·P·P] float32 on the CPU, grid (1, h/P, w/P)).
    Raises:
        UnsupportedConfigError: an image that is not [H, W, 3] uint8, or an aspect ratio above 200.
    """
    if image.dim() != 3:
        raise UnsupportedConfigError(f"a prompt image is one [H, W, 3] uint8 tensor, got shape {list(image.shape)}")
    h, w = smart_resize(image.shape[0], image.shape[1], factor=cfg.factor, min_pixels=cfg.min_pixels,
                        max_pixels=cfg.max_pixels)
    with rt.scope(block=-1, samples=[sample], txt_lens=None, txt_starts=None):
        small = _op(rt, "te_vision_resize", image.unsqueeze(0), h, w, cfg.resample)  # [1, h, w, 3]
        pixels, grid = _op(rt, "te_vision_patchify", small, cfg.image_mean, cfg.image_std, cfg.rescale_factor,
                           cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
    return pixels[0], tuple(int(v) for v in grid[0].tolist())
