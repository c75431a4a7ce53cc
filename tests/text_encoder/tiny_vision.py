"""Tiny random Qwen2.5-VL text encoders with a vision tower, transformers' Qwen2-VL processor built
offline, and diffusers' edit pipelines around them (their ``encode_prompt`` only).

    >>> folder = save_tiny_vision_pipeline(tmp_path, seed=0)   # text_encoder/ + tokenizer/
    >>> pipe = edit_pipeline(folder)                           # QwenImageEditPipeline (text parts)
    >>> img = random_image(60, 90, seed=1)                     # PIL RGB

Without torchvision (this environment) transformers 5.x picks ``Qwen2VLImageProcessorPil``;
``Qwen2VLProcessor`` checks every attribute's class and, with torchvision absent, refuses
``video_processor=None``: ``_Processor`` skips that one check (no video is ever passed).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.text_encoder.tiny import tokenizer, torch, transformers

VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])
"""Three blocks: 0 and 2 attend within 112-pixel windows (4 × 4 merged tokens), 1 over each image."""


class _Processor(transformers.Qwen2VLProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def image_processor(**kwargs):
    """The class transformers picks here for Qwen2-VL images (asserted by the tests)."""
    return transformers.Qwen2VLImageProcessorPil(**kwargs)


def processor(tok=None, image=None, **kwargs):
    """Qwen2-VL's processor of ``tok`` (default: the pruned tokenizer) and the image processor
    ``image`` (default: ``image_processor(**kwargs)``), without a video processor."""
    return _Processor(image_processor=image or image_processor(**kwargs), tokenizer=tok or tokenizer(),
                      video_processor=None)


def random_image(height: int, width: int, *, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)  # noise with some smooth structure
    yy, xx = np.mgrid[0:height, 0:width]
    ramp = ((yy * 3 + xx * 5) % 256).astype(np.uint8)[..., None]
    return Image.fromarray(np.where(rng.random((height, width, 1)) < 0.5, base, ramp).astype(np.uint8))


def as_tensor(img) -> "torch.Tensor":
    """A PIL RGB image as the [H, W, 3] uint8 tensor drifttool takes."""
    return torch.from_numpy(np.array(img.convert("RGB")))


def text_encoder(tok, *, seed: int = 0, dtype=torch.float32):
    """A Qwen2_5_VLForConditionalGeneration: the 32-wide text model of ``tiny.text_encoder`` and
    the three-block vision tower ``VISION``, random weights (non-trivial gains and biases)."""
    torch.manual_seed(seed)
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    cfg = transformers.Qwen2_5_VLConfig(
        **ids,
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=VISION, tie_word_embeddings=True)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def save_tiny_vision_pipeline(root, *, seed: int = 0, dtype=torch.float32):
    """``root/text_encoder`` (config.json + model.safetensors, ``visual.*`` included) and
    ``root/tokenizer``."""
    tok = tokenizer()
    text_encoder(tok, seed=seed, dtype=dtype).save_pretrained(root / "text_encoder", safe_serialization=True)
    tok.save_pretrained(root / "tokenizer")
    return root


def edit_pipeline(root, *, plus: bool = False, dtype=torch.float32):
    """diffusers' ``QwenImageEditPipeline`` (or ``...EditPlusPipeline``) holding only the text
    encoder, tokenizer and processor of ``root``."""
    diffusers = pytest.importorskip("diffusers")
    te = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        root / "text_encoder", dtype=dtype, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True)
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    return cls(scheduler=None, vae=None, text_encoder=te, tokenizer=tok, processor=processor(tok),
               transformer=None)
