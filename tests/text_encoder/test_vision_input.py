"""The prompt image's preprocessing (``te_vision_resize`` + ``te_vision_patchify`` through
``prepare_image``) equals transformers 5.x's Qwen2-VL image processor byte for byte: the class
transformers picks here (``Qwen2VLImageProcessorPil``: no torchvision), through the processor
diffusers' edit pipelines call, for images that are enlarged, shrunk, kept, very flat, below
``min_pixels`` and above ``max_pixels``, and for settings read from a saved
``preprocessor_config.json`` (5.x and 4.x layouts). Both families give the same bytes; the
resampling stays within 2 levels of the exact bicubic resampling and the patches equal the FP64
reference rounded to FP32."""

from __future__ import annotations

import json

import pytest

from tests.text_encoder.tiny_vision import as_tensor, image_processor, processor, random_image, torch, transformers

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from drifttool.references import text_encoder_vision as ref
from drifttool.runtime import Runtime
from drifttool.text_encoder.image_input import prepare_image
from drifttool.text_encoder.vision_config import ImageProcessorConfig
from drifttool.text_encoder.vision_grid import smart_resize

SIZES = [(60, 90), (150, 262), (28, 28), (13, 41), (41, 2000), (1100, 1000), (56, 84)]
"""(H, W): enlarged, shrunk a little, one token, below min_pixels (ceil path), aspect 49,
above max_pixels (floor path), already a token grid (kept: Pillow copies)."""


def _ours(img, cfg, mode="auto"):
    rt = Runtime(mode=mode)
    with rt.scope(component="text_encoder", phase="rollout", step=-1, branch="none", samples=[0],
                  txt_lens=None, txt_starts=None, img_grid=None):
        return prepare_image(as_tensor(img), cfg, rt, sample=0)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(
        b.contiguous().view(torch.uint8))


def test_transformers_picks_the_pil_image_processor_here(tmp_path):
    """The contract point: a Qwen2-VL processor folder loads as the PIL backend when torchvision is
    not importable (the torchvision backend resizes with other arithmetic)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: transformers picks its torchvision image processor")
    image_processor().save_pretrained(tmp_path)
    assert type(transformers.AutoImageProcessor.from_pretrained(tmp_path)).__name__ == "Qwen2VLImageProcessorPil"


@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_pixel_values_and_grid_are_the_processors_bytes(size):
    img = random_image(*size, seed=sum(size))
    want = image_processor()(images=img, return_tensors="pt")
    for mode in ("auto", "strict"):
        pixels, grid = _ours(img, ImageProcessorConfig(), mode)
        assert _same(pixels, want["pixel_values"]), (size, mode)
        assert [list(grid)] == want["image_grid_thw"].tolist()


def test_the_edit_processor_call_gives_the_same_pixels():
    """What diffusers' edit pipeline calls: ``processor(text=..., images=..., padding=True)``."""
    imgs = [random_image(150, 262, seed=1), random_image(60, 90, seed=2)]
    text = ["<|vision_start|><|image_pad|><|vision_end|>a", "<|vision_start|><|image_pad|><|vision_end|>b"]
    want = processor()(text=text, images=imgs, padding=True, return_tensors="pt")
    got = [_ours(i, ImageProcessorConfig()) for i in imgs]
    assert _same(torch.cat([p for p, _ in got]), want["pixel_values"])
    assert [list(g) for _, g in got] == want["image_grid_thw"].tolist()


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
def test_settings_from_a_saved_processor_folder(tmp_path, layout):
    image_processor(min_pixels=20000, max_pixels=60000).save_pretrained(tmp_path / "processor")
    path = tmp_path / "processor" / "preprocessor_config.json"
    if layout == "4.x":  # as Qwen2.5-VL's own file: top-level pixel bounds, no size
        raw = json.loads(path.read_text())
        raw.pop("size")
        raw |= {"min_pixels": 20000, "max_pixels": 60000}
        path.write_text(json.dumps(raw))
    loaded = transformers.AutoImageProcessor.from_pretrained(tmp_path / "processor")
    cfg = ImageProcessorConfig.from_folder(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels) == (20000, 60000)
    for size in [(60, 90), (400, 300), (150, 262)]:
        img = random_image(*size, seed=7)
        want = loaded(images=img, return_tensors="pt")
        pixels, grid = _ours(img, cfg)
        assert _same(pixels, want["pixel_values"]) and [list(grid)] == want["image_grid_thw"].tolist(), size
    assert ImageProcessorConfig.from_folder(tmp_path / "nowhere") == ImageProcessorConfig()


def test_unsupported_settings_and_images_fail_closed():
    with pytest.raises(UnsupportedConfigError, match="do_resize"):
        ImageProcessorConfig.from_dict({"do_resize": False})
    with pytest.raises(UnsupportedConfigError, match="aspect ratio"):
        smart_resize(10, 2020, factor=28, min_pixels=3136, max_pixels=1003520)
    with pytest.raises(UnsupportedConfigError, match="uint8"):
        implementation("te_vision_resize", "production")(torch.zeros(1, 4, 4, 3), 28, 28)
    with pytest.raises(UnsupportedConfigError, match="grid"):
        implementation("te_vision_patchify", "strict")(torch.zeros(1, 30, 28, 3, dtype=torch.uint8),
                                                       (0.5,) * 3, (0.5,) * 3, 1 / 255, 14, 2, 2)


@pytest.mark.parametrize("size,target", [((60, 90), (56, 84)), ((150, 262), (140, 252)), ((30, 41), (84, 112)),
                                         ((123, 77), (56, 28))])
def test_resize_and_patches_against_the_fp64_reference(size, target):
    """Pillow's fixed-point resampling within 1 level of the exact two-pass 8-bit bicubic (a
    wrong filter is off by tens on these images); the patches equal the FP64 reference within
    the FP32 roundings of the rescale and normalize."""
    img = as_tensor(random_image(*size, seed=3)).unsqueeze(0)
    got = implementation("te_vision_resize", "strict")(img, *target, 3)
    want = ref.te_vision_resize(img, *target, 3)
    diff = (got.double() - want).abs()
    assert got.shape == want.shape and float(diff.max()) <= 1 and float(diff.mean()) < 0.01, float(diff.mean())
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    pixels, grid = implementation("te_vision_patchify", "production")(got, mean, std, 1 / 255, 14, 2, 2)
    rp, rg = ref.te_vision_patchify(got, mean, std, 1 / 255, 14, 2, 2)
    assert grid.equal(rg) and pixels.shape == rp.shape
    assert float((pixels.double() - rp).abs().max()) <= 1e-6
