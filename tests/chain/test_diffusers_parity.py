"""The chain (``drifttool run --prompt``, production family, the ``diffusers`` preset) decodes the
same image as diffusers' unmodified ``QwenImagePipeline`` called with the prompts, byte for byte:
text encoder, trajectory, VAE decode and the 8-bit conversion, on the same tiny pipeline folder
(CPU, BF16 weights, the pipeline drawing its own noise from the preset's generator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")
PIL = pytest.importorskip("PIL.Image")

from drifttool.chain import run_chain  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402
from tests.chain.tiny_pipeline import build_pipeline  # noqa: E402
from tests.diffusers_pipeline import qwen_image_scheduler  # noqa: E402

PROMPT, NEGATIVE, SEED = "a photo of a dog wearing sunglasses, oil painting", "cat", 77


def _pipeline(root, dtype):
    import transformers
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    pipe = diffusers.QwenImagePipeline(
        scheduler=qwen_image_scheduler(),
        vae=diffusers.AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype).eval(),
        text_encoder=transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            root / "text_encoder", dtype=dtype, local_files_only=True).eval(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True),
        transformer=diffusers.QwenImageTransformer2DModel.from_pretrained(
            root / "transformer", torch_dtype=dtype).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    return build_pipeline(tmp_path_factory.mktemp("pipe"), seed=3)


@pytest.mark.parametrize("negative", [NEGATIVE, None], ids=["cfg", "no-cfg"])
def test_chain_image_is_the_pipelines(tmp_path, pipeline_dir, negative):
    root = pipeline_dir
    spec = RunSpec(checkpoint=root, preset="diffusers", mode="auto", capture="L1", dtype="bfloat16",
                   seed=SEED, steps=3)
    summary = run_chain(spec, tmp_path / "run", prompts=[PROMPT],
                        negative_prompts=None if negative is None else [negative])
    (png,) = summary["images"]
    ours = np.asarray(PIL.open(png).convert("RGB"))
    with torch.no_grad():
        want = _pipeline(root, torch.bfloat16)(
            prompt=PROMPT, negative_prompt=negative, true_cfg_scale=4.0, height=ours.shape[0],
            width=ours.shape[1], num_inference_steps=3,
            generator=[torch.Generator().manual_seed(SEED)], output_type="pil").images[0]
    want = np.asarray(want)
    assert summary["cfg"] == (negative is not None)
    assert want.shape == ours.shape and want.dtype == ours.dtype == np.uint8
    assert np.array_equal(ours, want), f"{int((ours != want).sum())} of {ours.size} values differ"
    assert len(np.unique(ours)) > 8  # a real image, not a constant
