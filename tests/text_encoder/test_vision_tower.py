"""The vision tower (``VisionTower``, weights read from the ``visual.*`` tensors of a saved
``text_encoder/``): production equals transformers 5.x's
``Qwen2_5_VisionTransformerPretrainedModel`` (``get_image_features``, ``sdpa``) byte for byte on
the CPU in FP32 and BF16, for several packed images with partial windows, a grid that is a whole
number of windows and a one-token image; strict gives an image the same bytes alone and packed
with others in any order, and both are close to transformers' forward in FP64."""

from __future__ import annotations

import pytest

from tests.text_encoder.tiny_vision import (
    as_tensor, image_processor, random_image, save_tiny_vision_pipeline, torch, transformers,
)

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.runtime import Runtime
from drifttool.text_encoder.image_input import prepare_image
from drifttool.text_encoder.vision import VisionTower
from drifttool.text_encoder.vision_config import ImageProcessorConfig, VisionConfig
from drifttool.text_encoder.vision_weights import read_vision_weights

SIZES = [(150, 262), (60, 90), (310, 200), (224, 224), (28, 28)]
"""Grids (patches) 10×18 (windows of 4×4 tokens, partial at the right and bottom), 4×6 (one
partial window), 22×14, 16×16 (exactly 2×2 windows), 2×2 (one token)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_vision_pipeline(tmp_path_factory.mktemp("tiny-vl"), seed=4)


@pytest.fixture(scope="module")
def images():
    return [random_image(h, w, seed=h + w) for h, w in SIZES]


def _scope(rt):
    return rt.scope(component="text_encoder", phase="rollout", step=-1, branch="none", samples=[0],
                    txt_lens=None, txt_starts=None, img_grid=None)


def _tower(folder, dtype):
    cfg = VisionConfig.from_file(folder / "text_encoder" / "config.json")
    return VisionTower(cfg, read_vision_weights(folder / "text_encoder", cfg, dtype=dtype))


def _run(tower, imgs, mode):
    rt = Runtime(mode=mode)
    with torch.no_grad(), _scope(rt):
        pixels, grids = zip(*[prepare_image(as_tensor(i), ImageProcessorConfig(), rt, 0) for i in imgs])
        return tower(torch.cat(pixels), list(grids), rt), list(grids)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _transformers(folder, imgs, dtype):
    te = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder / "text_encoder", dtype=dtype, local_files_only=True).eval()
    inputs = image_processor()(images=imgs, return_tensors="pt")
    with torch.no_grad():
        out = te.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_production_is_transformers_bytes(folder, images, dtype):
    want = _transformers(folder, images, dtype)
    got, _ = _run(_tower(folder, dtype), images, "auto")
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert _bytes(got).equal(_bytes(want))


def test_strict_image_bytes_do_not_depend_on_the_other_images(folder, images):
    tower = _tower(folder, torch.float32)
    alone = [_run(tower, [img], "strict")[0] for img in images]
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [1, 1, 3]):
        packed, grids = _run(tower, [images[i] for i in order], "strict")
        rows = [t * h * w // 4 for t, h, w in grids]
        for part, i in zip(packed.split(rows), order):
            assert _bytes(part).equal(_bytes(alone[i])), (order, i)


def test_strict_and_production_are_close_to_the_fp64_forward(folder, images):
    want = _transformers(folder, images, torch.float64)
    tower = _tower(folder, torch.float32)
    for mode in ("strict", "auto"):
        got, _ = _run(tower, images, mode)
        err = (got.double() - want).abs()  # measured: strict 2.3e-8, production 8.6e-8 (|r| ≤ 0.24)
        assert bool((err <= 2e-7 + 2e-6 * want.abs()).all()), (mode, float(err.max()))


def test_a_text_only_encoder_or_a_short_checkpoint_is_refused(tmp_path, folder):
    with pytest.raises(CheckpointError, match="vision_config"):
        VisionConfig.from_dict({"text_config": {}}, "cfg")
    with pytest.raises(UnsupportedConfigError, match="SiLU"):
        VisionConfig.from_dict({"vision_config": {**_raw(folder), "hidden_act": "gelu"}}, "cfg")
    bigger = VisionConfig.from_dict({"vision_config": {**_raw(folder), "depth": 4}}, "cfg")
    with pytest.raises(CheckpointError, match="blocks.3"):
        read_vision_weights(folder / "text_encoder", bigger)
    tower = _tower(folder, torch.float32)
    with pytest.raises(UnsupportedConfigError, match="not the patches"):
        tower(torch.zeros(5, 1176), [(1, 2, 2)], Runtime(mode="strict"))


def _raw(folder):
    import json

    return json.loads((folder / "text_encoder" / "config.json").read_text())["vision_config"]
