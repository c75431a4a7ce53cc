"""The edit pipelines' condition-image resizes (diffusers 0.42.1), as a named step: each image to
about a fixed pixel area at its aspect ratio, sides multiples of 32, before the prompt encoding
and the VAE encode.

    >>> pipeline_size(97, 61, VAE_IMAGE_AREA)          # (width, height), calculate_dimensions
    (1280, 800)
    >>> vae, prompt = resize_images([image], rt, vae_area=VAE_IMAGE_AREA, prompt_area=None, sample=0)

What ``__call__`` does with its ``image`` (PIL, RGB):

- ``QwenImageEditPipeline``: ``calculate_dimensions(1024², w/h)`` and
  ``VaeImageProcessor.resize`` to that size; the resized image is both the prompt image of
  ``encode_prompt`` and the VAE's input (``preprocess`` at the same size copies it);
- ``QwenImageEditPlusPipeline``: each image resized twice from the original, to about
  ``CONDITION_IMAGE_SIZE`` = 384² (the prompt image) and ``VAE_IMAGE_SIZE`` = 1024² (the VAE's);
- both derive the output size, when not given, from the (last) image's 1024² size.

``calculate_dimensions(area, ratio)``: ``w = sqrt(area·ratio)``, ``h = w / ratio`` in doubles,
each rounded (half to even) to a multiple of 32 (``pipeline_size``, the same Python arithmetic).
The resize is the operator ``vae_image_resize`` (Pillow's fixed-point resampling, Lanczos, both
families), captured under component ``vae``, block −1, at the caller's step and sample. Tests
pass a smaller area (the pipelines' module globals, shrunk) to keep tiny models fast.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from drifttool.errors import DriftToolError
from drifttool.ops.registry import call
from drifttool.ops.specs import OPERATORS
from drifttool.ops.vae.image import LANCZOS
from drifttool.runtime import Runtime

VAE_IMAGE_AREA = 1024 * 1024
"""The VAE's condition-image area of both edit pipelines (``VAE_IMAGE_SIZE``)."""
PROMPT_IMAGE_AREA = 384 * 384
"""The edit-plus pipeline's prompt-image area (``CONDITION_IMAGE_SIZE``)."""


def pipeline_size(width: int, height: int, area: int) -> tuple[int, int]:
    """(width, height) of an image of ``width`` × ``height`` pixels resized to about ``area``
    pixels (``calculate_dimensions``: multiples of 32).

    Raises:
        DriftToolError: an area below 1, or a side that rounds to 0 pixels (an aspect ratio the
            pipelines cannot resize: Pillow refuses a zero size).
    """
    if isinstance(area, bool) or not isinstance(area, int) or area < 1:
        raise DriftToolError(f"an image area must be a positive number of pixels, got {area!r}")
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    size = round(w / 32) * 32, round(h / 32) * 32
    if min(size) < 1:
        raise DriftToolError(f"a {width}x{height} image resized to about {area} pixels has a side of 0 "
                             "(the edit pipelines cannot take that aspect ratio)")
    return size


def resize_to_area(image: torch.Tensor, area: int, rt: Runtime) -> torch.Tensor:
    """One [H, W, 3] uint8 image resized to ``pipeline_size`` as ``VaeImageProcessor.resize``
    does (``vae_image_resize``, Lanczos): [h, w, 3] uint8. The caller scopes the capture."""
    w, h = pipeline_size(image.shape[1], image.shape[0], area)
    return call(rt, "vae_image_resize", image.unsqueeze(0), h, w, LANCZOS,
                layout=OPERATORS["vae_image_resize"].layout)[0]  # [h, w, 3]


def resize_images(images: Sequence[torch.Tensor], rt: Runtime, *, vae_area: int, prompt_area: int | None,
                  sample: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Each image's VAE input and, with ``prompt_area`` (edit-plus), its prompt image, in the
    edit-plus pipeline's order (per image: the prompt image, then the VAE's), captured under
    component ``vae``, step −1, block −1, sample ``sample``.

    Returns:
        (VAE images [h, w, 3] uint8, prompt images [h', w', 3] uint8 or None).
    Raises:
        DriftToolError: as ``pipeline_size``.
    """
    vae, prompt = [], [] if prompt_area is not None else None
    with rt.scope(component="vae", phase="rollout", step=-1, branch="none", block=-1, samples=[sample],
                  txt_lens=None, txt_starts=None, img_grid=None):
        for img in images:
            if prompt is not None:
                prompt.append(resize_to_area(img, prompt_area, rt))
            vae.append(resize_to_area(img, vae_area, rt))
    return vae, prompt
