"""The prompt templates of diffusers 0.42.1's Qwen-Image pipelines and how many template rows
each drops from the text encoder's output.

    >>> T2I.text.format("cat")[:22], T2I.drop
    ('<|im_start|>system\\nDes', 34)

``T2I`` is ``QwenImagePipeline.prompt_template_encode`` (``prompt_template_encode_start_idx =
34``), ``EDIT`` is ``QwenImageEditPipeline``'s (64), whose prompt starts with the condition
image's vision tokens. ``drop`` is the token count of the template's prefix up to ``user\\n``
under the Qwen2 BPE (checked in the tests), so the prompt embeddings start at the prompt's first
token and end with the 5 suffix tokens ``<|im_end|>\\n<|im_start|>assistant\\n``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PromptTemplate:
    """A chat template with one ``{}`` for the prompt.

    Attributes:
        name: ``t2i`` or ``edit``.
        text: the template (``str.format`` with the prompt).
        drop: leading rows of the encoder output dropped (the template's system prefix).
        max_tokens: ``tokenizer_max_length`` of the pipeline: token ids are truncated to
            ``max_tokens + drop``.
    """

    name: str
    text: str
    drop: int
    max_tokens: int = 1024


T2I = PromptTemplate(
    name="t2i",
    text=("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
          "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
          "<|im_end|>\n<|im_start|>assistant\n"),
    drop=34,
)

EDIT = PromptTemplate(
    name="edit",
    text=("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
          "objects, background), then explain how the user's text instruction should alter or modify the "
          "image. Generate a new image that meets the user's requirements while maintaining consistency "
          "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
          "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"),
    drop=64,
)
