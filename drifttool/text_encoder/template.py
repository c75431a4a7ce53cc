"""The prompt templates of diffusers 0.42.1's Qwen-Image pipelines and how many template rows
each drops from the text encoder's output.

    >>> T2I.text.format("cat")[:22], T2I.drop
    ('<|im_start|>system\\nDes', 34)
    >>> EDIT_PLUS.format("swap them", images=2).count("<|image_pad|>"), EDIT_PLUS.drop
    (2, 64)

``T2I`` is ``QwenImagePipeline.prompt_template_encode`` (``prompt_template_encode_start_idx =
34``), ``EDIT`` is ``QwenImageEditPipeline``'s (64), whose prompt starts with the condition
image's vision tokens, ``EDIT_PLUS`` is ``QwenImageEditPlusPipeline``'s (64), whose prompt is
preceded by ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` for each of its images.
``drop`` is the token count of the template's prefix up to ``user\\n`` under the Qwen2 BPE
(checked in the tests), so the prompt embeddings start at the prompt's first token (an edit
prompt's: at ``<|vision_start|>`` or ``Picture``) and end with the 5 suffix tokens
``<|im_end|>\\n<|im_start|>assistant\\n``. The edit pipelines neither truncate the token ids nor
cut the embeddings to ``max_sequence_length``.
"""

from __future__ import annotations

from dataclasses import dataclass

from drifttool.errors import UnsupportedConfigError

IMAGE_PAD = "<|image_pad|>"
"""The placeholder the processor expands to one token per merged vision token."""


@dataclass(frozen=True, kw_only=True)
class PromptTemplate:
    """A chat template with one ``{}`` for the prompt.

    Attributes:
        name: ``t2i``, ``edit`` or ``edit-plus``.
        text: the template (``str.format`` with the prompt).
        drop: leading rows of the encoder output dropped (the template's system prefix).
        max_tokens: ``tokenizer_max_length`` of the pipeline: token ids are truncated to
            ``max_tokens + drop`` and the embeddings cut to ``max_sequence_length`` (t2i only).
        image_prefix: put before the prompt once per image, with the image's number from 1
            (edit-plus); ``None`` when the template holds its image placeholder itself (edit) or
            takes no image (t2i).
    """

    name: str
    text: str
    drop: int
    max_tokens: int = 1024
    image_prefix: str | None = None

    @property
    def vision(self) -> bool:
        """Whether the template's prompts carry images (their tokens from the vision tower)."""
        return self.image_prefix is not None or IMAGE_PAD in self.text

    def format(self, prompt: str, images: int = 0) -> str:
        """The templated text of ``prompt`` with ``images`` images (their ``<|image_pad|>``
        placeholders not yet expanded).

        Raises:
            UnsupportedConfigError: a number of images the template does not take (t2i none, edit
                one, edit-plus one or more).
        """
        if self.image_prefix is not None:
            if images < 1:
                raise UnsupportedConfigError(f"the {self.name} template takes one or more images per prompt")
            return self.text.format("".join(self.image_prefix.format(k) for k in range(1, images + 1)) + prompt)
        want = self.text.count(IMAGE_PAD)
        if images != want:
            raise UnsupportedConfigError(f"the {self.name} template takes {want} image(s) per prompt, got {images}")
        return self.text.format(prompt)


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

EDIT_PLUS = PromptTemplate(
    name="edit-plus",
    text=("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
          "objects, background), then explain how the user's text instruction should alter or modify the "
          "image. Generate a new image that meets the user's requirements while maintaining consistency "
          "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
          "<|im_start|>assistant\n"),
    drop=64,
    image_prefix="Picture {}: <|vision_start|><|image_pad|><|vision_end|>",
)
