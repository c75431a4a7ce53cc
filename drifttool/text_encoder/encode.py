"""Prompts to prompt embeddings, as diffusers 0.42.1's ``QwenImagePipeline.encode_prompt``.

    >>> embeds, mask = encode_prompts(encoder, ["a red cube", "cat"], rt)
    >>> embeds.shape, mask        # [B, L', D]; mask [B, L'] int64, or None when no row is padded

The steps (each an operator, captured under component ``text_encoder``, phase ``rollout``,
step −1, branch ``none``): ``te_tokenize`` (traced, not captured: its padded ids are not a
per-prompt record; the first captured record of the token ids is ``te_embed_tokens``' rows) (template, token ids truncated to ``max_tokens +
drop``, right padding) → the language model (``model.TextEncoder``) → ``te_prompt_extract``
(valid rows, the template's first ``drop`` dropped, re-padded). Then, outside the operators, as
``encode_prompt`` does: the embeddings and mask are cut to ``max_sequence_length`` rows, and the
mask becomes ``None`` when it is all ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.ops.specs import OPERATORS
from drifttool.runtime import Runtime
from drifttool.text_encoder.config import TextEncoderConfig
from drifttool.text_encoder.model import TextEncoder, text_positions
from drifttool.text_encoder.template import T2I, PromptTemplate
from drifttool.text_encoder.tokenizer import PromptTokenizer
from drifttool.text_encoder.weights import read_weights

COMPONENT = "text_encoder"


@dataclass(frozen=True)
class PromptEncoder:
    """A pipeline's tokenizer and text encoder. Attributes: tokenizer, model."""

    tokenizer: PromptTokenizer
    model: TextEncoder

    @classmethod
    def load(cls, pipeline: str | Path, *, dtype: torch.dtype | None = None) -> "PromptEncoder":
        """Read ``pipeline/tokenizer/`` and ``pipeline/text_encoder/`` (config.json and
        safetensors; ``dtype`` None keeps the stored dtype).

        Raises:
            CheckpointError, UnsupportedConfigError: as ``PromptTokenizer.load``,
                ``TextEncoderConfig.from_file`` and ``read_weights``.
        """
        root = Path(pipeline)
        cfg = TextEncoderConfig.from_file(root / "text_encoder" / "config.json")
        return cls(PromptTokenizer.load(root / "tokenizer"),
                   TextEncoder(cfg, read_weights(root / "text_encoder", cfg, dtype=dtype)))


def _scope(rt: Runtime, samples: Sequence[int], lens: list[int] | None):
    return rt.scope(component=COMPONENT, phase="rollout", step=-1, branch="none", samples=list(samples),
                    txt_lens=lens, txt_starts=None, img_grid=None)


def encode_prompts(encoder: PromptEncoder, prompts: Sequence[str], rt: Runtime, *,
                   template: PromptTemplate = T2I, max_sequence_length: int = 1024,
                   samples: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings and mask, as ``QwenImagePipeline.encode_prompt(prompts,
    max_sequence_length=...)`` returns them (one image per prompt).

    Args:
        encoder: tokenizer and model.  prompts: B strings.  rt: the runtime (its mode picks the
            family; its recorder captures every operator).
        template: ``template.T2I`` (text-only prompts; the edit template needs the vision tokens,
            not supported yet).
        max_sequence_length: rows kept, 1..1024 (diffusers' ``__call__`` passes 512).
        samples: logical sample id of each prompt (default 0..B−1), for the records.
    Returns:
        (prompt_embeds [B, L', D] in the model's dtype, mask [B, L'] int64 or None).
    Raises:
        UnsupportedConfigError: the edit template, a bad ``max_sequence_length``, or as the
            operators raise.
    """
    if template.name != "t2i":
        raise UnsupportedConfigError("encode_prompts: only the text-to-image template is supported "
                                     "(edit prompts need the vision tower)")
    if not 1 <= max_sequence_length <= template.max_tokens:
        raise UnsupportedConfigError(f"max_sequence_length {max_sequence_length} must be in 1..{template.max_tokens}")
    samples = list(range(len(prompts))) if samples is None else list(samples)
    tok = encoder.tokenizer
    with _scope(rt, samples, None):  # traced; its ids are first captured as te_embed_tokens' rows
        ids, mask = call(rt, "te_tokenize", list(prompts), template.text, tok.encode, tok.pad_id,
                         template.max_tokens + template.drop, stream="txt", layout=None)
    lens = mask.sum(dim=1).tolist()
    with _scope(rt, samples, lens):
        hidden = encoder.model(ids, mask, text_positions(*ids.shape), rt)
        kept = [n - template.drop for n in lens]
        with rt.scope(block=encoder.model.config.layers, txt_lens=kept):
            embeds, emb_mask = call(rt, "te_prompt_extract", hidden, mask, template.drop, stream="txt",
                                    layout=OPERATORS["te_prompt_extract"].layout)
    embeds, emb_mask = embeds[:, :max_sequence_length], emb_mask[:, :max_sequence_length]
    return embeds, (None if bool(emb_mask.all()) else emb_mask)
