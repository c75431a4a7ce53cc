"""The edit pipelines' condition-image resize (``vae_image_resize``): diffusers 0.42.1's
``VaeImageProcessor.resize`` on a PIL image, registered for ``strict`` and ``production`` as one
function (both give Pillow's bytes).

    >>> small = vae_image_resize(image, 64, 96)   # [1, 64, 96, 3] uint8, Pillow Lanczos

The arithmetic is Pillow's ``Image.resize((width, height), resample, reducing_gap=None)`` on
the 8-bit RGB image: separable resampling (along the width, then the height, each pass rounded
to 8 bits), with filter coefficients converted to fixed point and integer accumulation — C code
with no floating-point reduction order to choose, so the bytes depend on Pillow's version only.
An image already of the target size is copied unchanged. ``resample`` is the processor's
``resample`` setting as Pillow's filter number (``"lanczos"``, the edit pipelines', is 1).
``drifttool.edit_images`` computes the target size (``calculate_dimensions``).
"""

from __future__ import annotations

import numpy as np
import torch

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.production import DEVICES
from drifttool.ops.registry import implements

LANCZOS = 1
"""Pillow's ``Resampling.LANCZOS``: ``VaeImageProcessor``'s default ``resample`` (``"lanczos"``)."""
_FILTERS = (0, 1, 2, 3, 4, 5)  # nearest, lanczos, bilinear, bicubic, box, hamming


@implements("vae_image_resize", "strict", device="cpu", kernel="pillow.resize")
@implements("vae_image_resize", "production", device=DEVICES, kernel="pillow.resize")
def vae_image_resize(image: torch.Tensor, height: int, width: int, resample: int = LANCZOS) -> torch.Tensor:
    """One 8-bit RGB image resized as ``VaeImageProcessor.resize`` resizes a PIL image.

    Args:
        image: [1, H, W, 3] uint8 (any device; resized on the CPU).  height, width: the target
            size in pixels (``edit_images.pipeline_size``).  resample: Pillow's filter number.
    Returns:
        [1, height, width, 3] uint8 on the CPU.
    Raises:
        UnsupportedConfigError: not a [1, H, W, 3] uint8 image, a target side below 1, or an
            unknown filter.
    """
    from PIL import Image

    if image.dtype != torch.uint8 or image.dim() != 4 or image.shape[0] != 1 or image.shape[-1] != 3:
        raise UnsupportedConfigError(f"vae_image_resize: expects one [1, H, W, 3] uint8 RGB image, got "
                                     f"{list(image.shape)} {image.dtype}")
    if min(height, width) < 1:
        raise UnsupportedConfigError(f"vae_image_resize: target size {width}x{height}")
    if resample not in _FILTERS:
        raise UnsupportedConfigError(f"vae_image_resize: unknown Pillow filter {resample!r}")
    pil = Image.fromarray(np.ascontiguousarray(image[0].cpu().numpy()), mode="RGB")
    resized = np.array(pil.resize((width, height), resample=resample, reducing_gap=None))  # [h, w, 3]
    return torch.from_numpy(resized).unsqueeze(0)
