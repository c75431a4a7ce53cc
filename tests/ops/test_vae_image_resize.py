"""``vae_image_resize`` and the pipelines' sizes (``drifttool.edit_images``): byte-equal to
diffusers 0.42.1's ``VaeImageProcessor.resize`` (the edit pipelines' processor: Lanczos) on the
same PIL image, both families, at the pipelines' areas and a shrunk one, for awkward sizes and
one already at its target; ``pipeline_size`` equals ``calculate_dimensions``; Pillow's
fixed-point resampling within 1 level of the FP64 two-pass Lanczos; bad calls fail closed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

PIL = pytest.importorskip("PIL.Image")

from drifttool.edit_images import PROMPT_IMAGE_AREA, VAE_IMAGE_AREA, pipeline_size, resize_to_area  # noqa: E402
from drifttool.errors import DriftToolError, UnsupportedConfigError  # noqa: E402
from drifttool.ops.registry import implementation  # noqa: E402
from drifttool.references import vae as ref  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402

SIZES = [(97, 61), (1000, 333), (640, 480), (1024, 1024)]
"""(W, H): odd and prime sides, a flat one, 4:3, and one already at the 1024² target."""
AREAS = [VAE_IMAGE_AREA, PROMPT_IMAGE_AREA, 96 * 128]


def _image(w: int, h: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    ramp = ((torch.arange(h)[:, None] * 3 + torch.arange(w)[None, :] * 5) % 256).to(torch.uint8)[..., None]
    return torch.where(torch.rand((h, w, 1), generator=g) < 0.5, noise, ramp.expand(h, w, 3)).contiguous()


@pytest.mark.parametrize("area", AREAS)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_the_resize_is_the_pipelines_bytes(size, area):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    img = _image(*size, seed=sum(size))
    w, h = calculate_dimensions(area, size[0] / size[1])
    assert pipeline_size(*size, area) == (w, h)
    want = np.array(VaeImageProcessor(vae_scale_factor=16).resize(PIL.fromarray(img.numpy()), h, w))
    for mode in ("strict", "auto"):
        rt = Runtime(mode=mode)
        with rt.scope(component="vae", phase="rollout", step=-1, branch="none", block=-1, samples=[0],
                      txt_lens=None, txt_starts=None, img_grid=None):
            got = resize_to_area(img, area, rt)
        assert got.dtype == torch.uint8 and got.shape == (h, w, 3) and np.array_equal(got.numpy(), want), mode


def test_pipeline_size_is_calculate_dimensions_for_any_ratio():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    g = torch.Generator().manual_seed(1)
    for w, h in torch.randint(1, 5000, (300, 2), generator=g).tolist():
        for area in AREAS:
            want = calculate_dimensions(area, w / h)[:2]
            if min(want) > 0:
                assert pipeline_size(w, h, area) == want, (w, h, area)
            else:
                with pytest.raises(DriftToolError, match="aspect ratio"):
                    pipeline_size(w, h, area)


@pytest.mark.parametrize("size,target", [((97, 61), (128, 96)), ((200, 150), (96, 64)), ((61, 97), (64, 160))])
def test_resize_against_the_fp64_lanczos(size, target):
    """Within 1 level of the exact two-pass 8-bit Lanczos (a wrong filter is off by tens)."""
    img = _image(*size, seed=4).unsqueeze(0)
    got = implementation("vae_image_resize", "strict")(img, target[1], target[0], 1)
    want = ref.vae_image_resize(img, target[1], target[0], 1)
    diff = (got.double() - want).abs()
    assert got.shape == want.shape and float(diff.max()) <= 1 and float(diff.mean()) < 0.05, float(diff.mean())
    bicubic = implementation("vae_image_resize", "strict")(img, target[1], target[0], 3)
    assert float((bicubic.double() - want).abs().max()) > 1


def test_bad_calls_fail_closed():
    fn = implementation("vae_image_resize", "production")
    with pytest.raises(UnsupportedConfigError, match="uint8"):
        fn(torch.zeros(1, 4, 4, 3), 8, 8)
    with pytest.raises(UnsupportedConfigError, match="target size"):
        fn(torch.zeros(1, 4, 4, 3, dtype=torch.uint8), 0, 8)
    with pytest.raises(UnsupportedConfigError, match="filter"):
        fn(torch.zeros(1, 4, 4, 3, dtype=torch.uint8), 8, 8, 9)
    with pytest.raises(DriftToolError, match="positive"):
        pipeline_size(4, 4, 0)
