"""The prompt image as the vision tower takes it: ``te_vision_resize`` (the smart resize's
resampling) and ``te_vision_patchify`` (rescale, normalize, patches). One function each,
registered for ``strict`` and ``production``: their bytes are those of transformers 5.x's
``Qwen2VLImageProcessorPil`` (the image processor transformers picks without torchvision).

    >>> small = te_vision_resize(image, 56, 84, 3)          # [1, 56, 84, 3] uint8, Pillow bicubic
    >>> pixels, grid = te_vision_patchify(small, CLIP_MEAN, CLIP_STD, 1 / 255, 14, 2, 2)
    >>> pixels.shape, grid.tolist()                          # [1, N, 3·2·14·14] float32
    (torch.Size([1, 24, 1176]), [[1, 4, 6]])

The arithmetic (transformers' ``image_transforms.resize`` / ``rescale`` / ``normalize`` and the
PIL backend's ``patchify``):

1. resize: the 8-bit RGB image through ``PIL.Image.resize((w, h), resample)`` (Pillow's
   fixed-point separable resampling; an image already of that size is copied unchanged);
2. rescale: ``float64(x) · rescale_factor``, rounded once to FP32;
3. normalize: ``(x − mean) / std`` per channel in FP32 (mean and std rounded to FP32 first);
4. patchify: ``[3, H, W]`` → ``[H/(m·P), W/(m·P), m, m, 3, P, P]``, each patch repeated
   ``temporal`` times after its channel axis → rows ``[(H/P)·(W/P), 3·T·P·P]`` in patch order
   (``text_encoder.vision_grid``).

The torchvision backend (``Qwen2VLImageProcessor`` with torchvision installed) resizes with
torch's antialiased bicubic instead: other bytes, which these operators do not produce.
"""

from __future__ import annotations

import numpy as np
import torch

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.text_encoder.exact import both


@both("te_vision_resize", kernel="pillow.resize")
def te_vision_resize(image: torch.Tensor, height: int, width: int, resample: int = 3) -> torch.Tensor:
    """One 8-bit RGB image resized as the image processor resizes it.

    Args:
        image: [1, H, W, 3] uint8.  height, width: the target size (``vision_grid.smart_resize``).
        resample: Pillow's filter (3 bicubic, the processor's).
    Returns:
        [1, height, width, 3] uint8 on the CPU.
    Raises:
        UnsupportedConfigError: not a [1, H, W, 3] uint8 image, or a target size below 1.
    """
    from PIL import Image

    if image.dtype != torch.uint8 or image.dim() != 4 or image.shape[0] != 1 or image.shape[-1] != 3:
        raise UnsupportedConfigError(f"te_vision_resize: expects one [1, H, W, 3] uint8 RGB image, got "
                                     f"{list(image.shape)} {image.dtype}")
    if min(height, width) < 1:
        raise UnsupportedConfigError(f"te_vision_resize: target size {width}x{height}")
    pil = Image.fromarray(np.ascontiguousarray(image[0].cpu().numpy()), mode="RGB")
    resized = np.array(pil.resize((width, height), resample=resample))  # [h, w, 3] uint8
    return torch.from_numpy(resized).unsqueeze(0)


@both("te_vision_patchify", kernel="rescale_fp64+normalize_fp32+patchify")
def te_vision_patchify(image: torch.Tensor, mean, std, rescale_factor: float, patch_size: int,
                       temporal_patch_size: int, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of one resized image.

    Args:
        image: [1, H, W, 3] uint8, H and W multiples of patch · merge.
        mean, std: 3 floats each (R, G, B).  rescale_factor: 1/255.
        patch_size, temporal_patch_size, merge_size: P, T, m.
    Returns:
        (pixel_values [1, (H/P)·(W/P), 3·T·P·P] float32, grid [1, 3] int64 = (1, H/P, W/P)).
    Raises:
        UnsupportedConfigError: sides that are not multiples of P · m, or not an RGB uint8 image.
    """
    p, t, m = patch_size, temporal_patch_size, merge_size
    if image.dtype != torch.uint8 or image.dim() != 4 or image.shape[0] != 1 or image.shape[-1] != 3:
        raise UnsupportedConfigError(f"te_vision_patchify: expects one [1, H, W, 3] uint8 RGB image, got "
                                     f"{list(image.shape)} {image.dtype}")
    h, w = image.shape[1], image.shape[2]
    if h % (p * m) or w % (p * m) or h == 0 or w == 0:
        raise UnsupportedConfigError(f"te_vision_patchify: {w}x{h} pixels are not a grid of {p * m}-pixel tokens")
    x = image[0].permute(2, 0, 1).to(torch.float64)  # [3, H, W]
    x = (x * float(rescale_factor)).to(torch.float32)
    mu = torch.tensor([float(v) for v in mean], dtype=torch.float32).view(3, 1, 1)
    sd = torch.tensor([float(v) for v in std], dtype=torch.float32).view(3, 1, 1)
    x = (x - mu) / sd
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, P, P]
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # [gh/m, gw/m, m, m, 3, T, P, P]
    pixels = x.reshape(1, gh * gw, 3 * t * p * p)
    return pixels, torch.tensor([[1, gh, gw]], dtype=torch.int64)
