"""A tiny random Qwen-Image pipeline folder (``model_index.json``, ``transformer/``,
``text_encoder/``, ``tokenizer/``, ``vae/``, ``scheduler/``) for the chain tests, built offline in a
few seconds: drifttool's tiny transformer (``model.config.tiny``, text width 32, written by
``save_checkpoint``), the tiny Qwen2.5-VL text encoder of ``tests/text_encoder/tiny.py`` (hidden
size 32 = the transformer's ``joint_attention_dim``) and the tiny diffusers VAE of
``tests/model/test_vae.py`` (three ×2 downsamplings: 8 pixels per latent).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drifttool.model.checkpoint import save_checkpoint
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from tests.model.test_vae import TINY as TINY_VAE
from tests.text_encoder.tiny import save_tiny_pipeline

MODEL_INDEX = {
    "_class_name": "QwenImagePipeline", "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def build_pipeline(root: Path, *, seed: int = 0) -> Path:
    """Write the tiny pipeline into ``root`` (created); returns it."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    root.mkdir(parents=True, exist_ok=True)
    save_tiny_pipeline(root, seed=seed)
    with torch.no_grad():
        save_checkpoint(random_init_(MMDiT(tiny(), dtype=torch.float32), seed=seed), root / "transformer")
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLQwenImage(**TINY_VAE).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.normal_(1.0, 0.1)
    vae.save_pretrained(root / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
        shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
    ).save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return root
