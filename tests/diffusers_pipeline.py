"""A real, unmodified diffusers ``QwenImagePipeline`` from tiny components, for tests.

    pipe = tiny_pipeline(transformer)             # any QwenImageTransformer2DModel
    out = pipe(prompt_embeds=pe, prompt_embeds_mask=m, height=64, width=96,
               num_inference_steps=4, output_type="latent", generator=g)

The scheduler is Qwen-Image's own ``FlowMatchEulerDiscreteScheduler`` configuration
(``scheduler/scheduler_config.json`` of the Qwen-Image checkpoint; numerics §3.3: dynamic
exponential shift with mu from 0.5 at 256 tokens to 0.9 at 8192, terminal sigma 0.02). The text
encoder, tokenizer and VAE are ``None``: prompt embeddings are passed directly and
``output_type="latent"`` skips decoding, so the pipeline never calls them
(``vae_scale_factor`` is then diffusers' default 8, as Qwen-Image's VAE has).

``chain_pipeline()`` is the whole pipeline of a folder (by default the shipped
``fixtures/tiny-t2i-chain``: tokenizer, text encoder, transformer, VAE and that scheduler's
config), loaded with ``from_pretrained`` as a user loads it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

CHAIN_FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-t2i-chain"

QWEN_IMAGE_SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192,
    max_shift=0.9, num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
    stochastic_sampling=False, time_shift_type="exponential", use_beta_sigmas=False,
    use_dynamic_shifting=True, use_exponential_sigmas=False, use_karras_sigmas=False,
)


def qwen_image_scheduler():
    """Qwen-Image's ``FlowMatchEulerDiscreteScheduler`` (configuration above)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)


def tiny_pipeline(transformer: torch.nn.Module):
    """An unmodified ``QwenImagePipeline`` around ``transformer`` (no text encoder, tokenizer or
    VAE: pass ``prompt_embeds``/``prompt_embeds_mask`` and ``output_type="latent"``)."""
    from diffusers import QwenImagePipeline
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    pipe = QwenImagePipeline(scheduler=qwen_image_scheduler(), vae=None, text_encoder=None,
                             tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def chain_pipeline(folder: Path = CHAIN_FOLDER, dtype: torch.dtype = torch.bfloat16):
    """``QwenImagePipeline.from_pretrained(folder)``, its scheduler the folder's. The folder's
    ``text_encoder/`` holds the language model only (drifttool reads no vision
    tower): its config's default vision tower (32 blocks, never run for text prompts) is made one
    block deep so that loading takes a second instead of a minute; the language model is the
    folder's."""
    import transformers
    from diffusers import QwenImagePipeline
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    cfg = transformers.AutoConfig.from_pretrained(folder / "text_encoder", local_files_only=True)
    cfg.vision_config = type(cfg.vision_config)(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                out_hidden_size=cfg.text_config.hidden_size,
                                                fullatt_block_indexes=[0])
    te = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder / "text_encoder", config=cfg, dtype=dtype, local_files_only=True).eval()
    pipe = QwenImagePipeline.from_pretrained(folder, text_encoder=te, dtype=dtype, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe
