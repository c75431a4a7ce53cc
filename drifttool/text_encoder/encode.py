"""Prompts (with their images, for the edit templates) to prompt embeddings, as diffusers 0.42.1's
``QwenImagePipeline.encode_prompt`` / ``QwenImageEditPipeline.encode_prompt(prompt, image=...)``
/ ``QwenImageEditPlusPipeline.encode_prompt``.

    >>> embeds, mask = encode_prompts(encoder, ["a red cube", "cat"], rt)
    >>> embeds.shape, mask        # [B, L', D]; mask [B, L'] int64, or None when no row is padded
    >>> edit = PromptEncoder.load("Qwen-Image-Edit", vision=True)
    >>> embeds, mask = encode_prompts(edit, ["make it blue"], rt, template=EDIT, images=[image])

The steps (each an operator, captured under component ``text_encoder``, phase ``rollout``,
step −1, branch ``none``):

- text-to-image: ``te_tokenize`` (traced, not captured: its padded ids are not a per-prompt
  record; the first captured record of the token ids is ``te_embed_tokens``' rows) (template,
  token ids truncated to ``max_tokens + drop``, right padding) → the language model
  (``model.TextEncoder``, positions 0…L−1 on the three mRoPE axes) → ``te_prompt_extract``
  (valid rows, the template's first ``drop`` dropped, re-padded); then, outside the operators,
  as ``encode_prompt`` does: the embeddings and mask are cut to ``max_sequence_length`` rows;
- edit templates (``EDIT``: one image per prompt; ``EDIT_PLUS``: one or more): each image
  through the image processor (``image_input.prepare_image``, captured under its prompt's
  sample); the template's ``<|image_pad|>`` of each image expanded to one token per merged
  vision token, as ``Qwen2VLProcessor`` does, and ``te_tokenize`` without truncation; the vision
  tower over every image of the call, packed (``vision.VisionTower``); the positions
  (``te_vision_rope_index``, or 0…L−1, see ``positions``); the language model with the vision
  embeddings scattered into the ``<|image_pad|>`` rows; ``te_prompt_extract`` (drop 64). No cut
  to ``max_sequence_length`` (the edit pipelines' ``encode_prompt`` ignores it);

in both, the mask becomes ``None`` when it is all ones.

Positions of prompts with images (``positions``): ``"rope_index"`` — Qwen2.5-VL's multimodal
RoPE, the vision tokens at (t, h, w) of their grid (transformers' ``get_rope_index``: what
transformers 4.x computes for ``encode_prompt``, and 5.x when given ``mm_token_type_ids``);
``"sequential"`` — 0…L−1 on every axis, what transformers 5.x computes when it is not given
``mm_token_type_ids``, which diffusers 0.42.1's ``encode_prompt`` does not pass: with
transformers 5.x that pipeline's edit prompt embeddings are these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.checkpoint_files import read_json_object
from drifttool.ops.registry import call
from drifttool.ops.specs import OPERATORS
from drifttool.runtime import Runtime
from drifttool.text_encoder.config import TextEncoderConfig
from drifttool.text_encoder.image_input import prepare_image
from drifttool.text_encoder.model import TextEncoder, text_positions
from drifttool.text_encoder.template import IMAGE_PAD, T2I, PromptTemplate
from drifttool.text_encoder.tokenizer import PromptTokenizer
from drifttool.text_encoder.vision import VisionTower
from drifttool.text_encoder.vision_config import ImageProcessorConfig, VisionConfig
from drifttool.text_encoder.vision_grid import Grid, merged_tokens
from drifttool.text_encoder.vision_weights import read_vision_weights
from drifttool.text_encoder.weights import read_weights

COMPONENT = "text_encoder"
POSITIONS = ("rope_index", "sequential")
"""How the language-model positions of prompts with images are made (module docstring)."""
_NO_TRUNCATION = 1 << 62


@dataclass(frozen=True)
class PromptEncoder:
    """A pipeline's tokenizer and text encoder.

    Attributes:
        tokenizer, model: the BPE and the language model.
        vision: the vision tower (None: text-only prompts).  processor: the image processor's
            settings (with ``vision``).  image_token_id: ``<|image_pad|>``'s id (with ``vision``).
    """

    tokenizer: PromptTokenizer
    model: TextEncoder
    vision: VisionTower | None = None
    processor: ImageProcessorConfig | None = None
    image_token_id: int | None = None

    @classmethod
    def load(cls, pipeline: str | Path, *, dtype: torch.dtype | None = None, vision: bool = False) -> "PromptEncoder":
        """Read ``pipeline/tokenizer/`` and ``pipeline/text_encoder/`` (config.json and
        safetensors; ``dtype`` None keeps the stored dtype); with ``vision``, also the vision
        tower (``visual.*``) and ``pipeline/processor/preprocessor_config.json`` (or the image
        processor's defaults), for the edit templates.

        Raises:
            CheckpointError, UnsupportedConfigError: as ``PromptTokenizer.load``,
                ``TextEncoderConfig.from_file``, ``read_weights``, ``VisionConfig.from_file`` and
                ``read_vision_weights``; a tokenizer whose ``<|image_pad|>`` is not the config's
                ``image_token_id``, a vision tower whose output width is not the language
                model's, or a processor whose patches are not the tower's.
        """
        root = Path(pipeline)
        path = root / "text_encoder" / "config.json"
        cfg = TextEncoderConfig.from_file(path)
        tok = PromptTokenizer.load(root / "tokenizer")
        model = TextEncoder(cfg, read_weights(root / "text_encoder", cfg, dtype=dtype))
        if not vision:
            return cls(tok, model)
        vcfg = VisionConfig.from_file(path)
        if vcfg.out_hidden_size != cfg.hidden_size:
            raise UnsupportedConfigError(f"{path}: the vision tower is {vcfg.out_hidden_size} wide, the language "
                                         f"model {cfg.hidden_size}")
        processor = ImageProcessorConfig.from_folder(root)
        processor.check_tower(vcfg, str(root / "processor"))
        image_id = tok.token_id(IMAGE_PAD)
        declared = read_json_object(path).get("image_token_id", image_id)
        if declared != image_id:
            raise CheckpointError(f"{path}: image_token_id {declared} is not the tokenizer's {IMAGE_PAD} ({image_id})")
        tower = VisionTower(vcfg, read_vision_weights(root / "text_encoder", vcfg, dtype=dtype))
        return cls(tok, model, tower, processor, image_id)


def _scope(rt: Runtime, samples: Sequence[int], lens: list[int] | None):
    return rt.scope(component=COMPONENT, phase="rollout", step=-1, branch="none", samples=list(samples),
                    txt_lens=lens, txt_starts=None, img_grid=None)


def encode_prompts(encoder: PromptEncoder, prompts: Sequence[str], rt: Runtime, *,
                   template: PromptTemplate = T2I, images: Sequence | None = None,
                   max_sequence_length: int = 1024, samples: Sequence[int] | None = None,
                   positions: str = "rope_index") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings and mask, as the pipeline of ``template`` returns them from
    ``encode_prompt`` (one image generated per prompt).

    Args:
        encoder: tokenizer and model (with the vision tower for the edit templates).
        prompts: B strings.  rt: the runtime (its mode picks the family; its recorder captures
            every operator).
        template: ``T2I`` (text-only prompts), ``EDIT`` or ``EDIT_PLUS``.
        images: with an edit template, per prompt its image ([H, W, 3] uint8 RGB tensor, at the
            size the pipeline hands to its processor) or a sequence of them (``EDIT_PLUS``);
            None otherwise.
        max_sequence_length: rows kept, 1..1024 (diffusers' ``__call__`` passes 512); the edit
            templates keep every row.
        samples: logical sample id of each prompt (default 0..B−1), for the records.
        positions: ``"rope_index"`` or ``"sequential"``, for prompts with images (module
            docstring).
    Returns:
        (prompt_embeds [B, L', D] in the model's dtype, mask [B, L'] int64 or None).
    Raises:
        UnsupportedConfigError: images with the t2i template or without an edit one, an encoder
            without a vision tower for an edit template, a prompt whose image placeholders are
            not its images, a bad ``max_sequence_length`` or ``positions``, or as the operators
            raise.
    """
    if not 1 <= max_sequence_length <= template.max_tokens:
        raise UnsupportedConfigError(f"max_sequence_length {max_sequence_length} must be in 1..{template.max_tokens}")
    samples = list(range(len(prompts))) if samples is None else list(samples)
    if template.vision:
        return _encode_with_images(encoder, prompts, rt, template, images, samples, positions)
    if images is not None:
        raise UnsupportedConfigError(f"the {template.name} template takes no images (an edit template does)")
    tok = encoder.tokenizer
    with _scope(rt, samples, None):  # traced; its ids are first captured as te_embed_tokens' rows
        ids, mask = call(rt, "te_tokenize", list(prompts), template.text, tok.encode, tok.pad_id,
                         template.max_tokens + template.drop, stream="txt", layout=None)
    lens = mask.sum(dim=1).tolist()
    with _scope(rt, samples, lens):
        hidden = encoder.model(ids, mask, text_positions(*ids.shape), rt)
        embeds, emb_mask = _extract(encoder, hidden, mask, template.drop, lens, rt)
    embeds, emb_mask = embeds[:, :max_sequence_length], emb_mask[:, :max_sequence_length]
    return embeds, (None if bool(emb_mask.all()) else emb_mask)


def _extract(encoder: PromptEncoder, hidden, mask, drop: int, lens: list[int], rt: Runtime):
    with rt.scope(block=encoder.model.config.layers, txt_lens=[n - drop for n in lens]):
        return call(rt, "te_prompt_extract", hidden, mask, drop, stream="txt",
                    layout=OPERATORS["te_prompt_extract"].layout)


def _per_prompt(images: Sequence | None, prompts: Sequence[str], template: PromptTemplate) -> list[list[torch.Tensor]]:
    if images is None or len(images) != len(prompts):
        raise UnsupportedConfigError(f"the {template.name} template needs the images of each of the "
                                     f"{len(prompts)} prompt(s), got {'none' if images is None else len(images)}")
    return [[i] if isinstance(i, torch.Tensor) else list(i) for i in images]


def _expand(text: str, counts: list[int]) -> str:
    """Each ``<|image_pad|>`` of ``text``, in order, repeated once per vision token of its image.

    Raises ``UnsupportedConfigError`` when the placeholders are not one per image."""
    parts = text.split(IMAGE_PAD)
    if len(parts) - 1 != len(counts):
        raise UnsupportedConfigError(f"a prompt with {len(counts)} image(s) holds {len(parts) - 1} {IMAGE_PAD} "
                                     "placeholder(s) (a prompt may not contain the token itself)")
    return parts[0] + "".join(IMAGE_PAD * n + p for n, p in zip(counts, parts[1:]))


def _encode_with_images(encoder: PromptEncoder, prompts: Sequence[str], rt: Runtime, template: PromptTemplate,
                        images: Sequence | None, samples: list[int],
                        positions: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``encode_prompts`` for an edit template (module docstring)."""
    if encoder.vision is None or encoder.processor is None or encoder.image_token_id is None:
        raise UnsupportedConfigError(f"the {template.name} template needs the vision tower "
                                     "(PromptEncoder.load(..., vision=True))")
    if positions not in POSITIONS:
        raise UnsupportedConfigError(f"prompt positions {positions!r}: one of {', '.join(POSITIONS)}")
    per_prompt = _per_prompt(images, prompts, template)
    texts = [template.format(p, len(imgs)) for p, imgs in zip(prompts, per_prompt)]
    tok, tower, m = encoder.tokenizer, encoder.vision, encoder.vision.config.spatial_merge_size
    pixels: list[torch.Tensor] = []
    grids: list[Grid] = []
    with _scope(rt, samples, None):
        with rt.parts() as part:  # a prompt's image records: the identities it has alone
            for b, imgs in enumerate(per_prompt):
                with part(samples=[samples[b]]):
                    prepared = [prepare_image(img, encoder.processor, rt, samples[b]) for img in imgs]
                pixels += [p for p, _ in prepared]
                grids += [g for _, g in prepared]
                texts[b] = _expand(texts[b], [merged_tokens(g, m) for _, g in prepared])
        ids, mask = call(rt, "te_tokenize", texts, "{}", tok.encode, tok.pad_id, _NO_TRUNCATION,
                         stream="txt", layout=None)
        vision = tower(torch.cat(pixels), grids, rt)  # [Σ tokens, D] in image order
    lens = mask.sum(dim=1).tolist()
    with _scope(rt, samples, lens):
        if positions == "rope_index":
            with rt.scope(block=-1):
                pos = call(rt, "te_vision_rope_index", ids, mask, encoder.image_token_id,
                           torch.tensor(grids, dtype=torch.int64), m, stream="txt",
                           layout=OPERATORS["te_vision_rope_index"].layout)
        else:
            pos = text_positions(*ids.shape)
        hidden = encoder.model(ids, mask, pos, rt, vision=(encoder.image_token_id, vision))
        embeds, emb_mask = _extract(encoder, hidden, mask, template.drop, lens, rt)
    return embeds, (None if bool(emb_mask.all()) else emb_mask)
