"""The Qwen2.5-VL text encoder of the Qwen-Image pipelines, as named operators (RFC Phase B,
``qwen25vl_text_contract``): prompts to the ``prompt_embeds`` / mask the transformer takes.

    >>> from drifttool.runtime import Runtime
    >>> from drifttool.text_encoder import PromptEncoder, encode_prompts
    >>> enc = PromptEncoder.load("Qwen-Image")                 # tokenizer/ + text_encoder/
    >>> embeds, mask = encode_prompts(enc, ["a red cube", "cat"], Runtime(mode="strict"))

Edit prompts carry their condition images (``template=EDIT`` one per prompt, ``EDIT_PLUS``
one or more; ``PromptEncoder.load(..., vision=True)`` reads the vision tower):

    >>> enc = PromptEncoder.load("Qwen-Image-Edit", vision=True)
    >>> embeds, mask = encode_prompts(enc, ["make it blue"], rt, template=EDIT, images=[img])

``Runtime(mode="strict")`` runs the strict family (batch- and padding-invariant bytes);
``mode="auto"`` the production family, byte-equal to diffusers' ``encode_prompt`` with
transformers' ``sdpa`` attention (edit prompts: see ``encode``'s ``positions``). A runtime with a recorder captures every operator under
component ``text_encoder``. Needs the ``tokenizers`` package (``pip install drifttool[text]``).

- ``template`` — the pipelines' prompt templates and their dropped prefix;
- ``tokenizer`` — ``tokenizer/`` (``tokenizer.json``, the pad token);
- ``config``, ``weights`` — ``text_encoder/`` (config.json, the language model's tensors);
- ``model`` — the language model's forward, operator by operator;
- ``vision_config``, ``vision_weights``, ``vision_grid`` — the vision tower's shape, tensors and
  geometry, and the image processor's settings;
- ``image_input``, ``vision`` — a prompt image's pixels and the vision tower, operator by operator;
- ``encode`` — ``PromptEncoder`` and ``encode_prompts``.
"""

from drifttool.text_encoder.encode import PromptEncoder, encode_prompts
from drifttool.text_encoder.model import TextEncoder, text_positions
from drifttool.text_encoder.template import EDIT, EDIT_PLUS, T2I, PromptTemplate

__all__ = ["EDIT", "EDIT_PLUS", "T2I", "PromptEncoder", "PromptTemplate", "TextEncoder", "encode_prompts",
           "text_positions"]
