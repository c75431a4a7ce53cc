"""A tiny random Qwen2.5-VL text encoder and the pruned Qwen2 tokenizer, saved as a diffusers
pipeline's ``text_encoder/`` and ``tokenizer/`` folders (built with transformers, offline, in about
a second), and diffusers' ``QwenImagePipeline`` around them for its ``encode_prompt``.

    >>> folder = save_tiny_pipeline(tmp_path, seed=0)     # text_encoder/ + tokenizer/
    >>> pipe = diffusers_pipeline(folder)                 # QwenImagePipeline (text parts only)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "fixtures" / "tokenizer-qwen2-tiny"

PROMPTS = ["a red cube on a table", "cat", "a photo of a dog wearing sunglasses, oil painting"]
"""Prompts the pruned tokenizer segments as the full Qwen2 BPE does (6, 1 and 10 tokens: 11, 6
and 15 embedding rows)."""


def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)


def text_encoder(tok, *, seed: int = 0, dtype=torch.float32, layers: int = 2):
    """A Qwen2_5_VLForConditionalGeneration with a 32-wide text model (2 heads of 16, one K/V
    head: GQA), a one-block vision tower, random weights from ``seed``."""
    torch.manual_seed(seed)
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    cfg = transformers.Qwen2_5_VLConfig(
        **ids,
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[0]),
        tie_word_embeddings=True)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains and biases
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def save_tiny_pipeline(root: Path, *, seed: int = 0, dtype=torch.float32) -> Path:
    """``root/text_encoder`` (config.json + model.safetensors) and ``root/tokenizer``."""
    tok = tokenizer()
    text_encoder(tok, seed=seed, dtype=dtype).save_pretrained(root / "text_encoder", safe_serialization=True)
    tok.save_pretrained(root / "tokenizer")
    return root


def diffusers_pipeline(root: Path, dtype=torch.float32):
    """diffusers' ``QwenImagePipeline`` holding only the text encoder and tokenizer of ``root``."""
    diffusers = pytest.importorskip("diffusers")
    te = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        root / "text_encoder", dtype=dtype, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True)
    return diffusers.QwenImagePipeline(scheduler=None, vae=None, text_encoder=te, tokenizer=tok, transformer=None)
