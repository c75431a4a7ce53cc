"""Text-encoder operators whose bytes no arithmetic choice changes: prompt template and token
ids (``te_tokenize``), the embedding lookup (``te_embed_tokens``) and the extraction of the
prompt rows (``te_prompt_extract``). One function each, registered for ``strict`` and
``production`` on every device: both families give the same bytes.

    >>> ids, mask = te_tokenize(["cat"], T2I_TEMPLATE, encode, pad_id=151643, max_length=1058)
    >>> emb, emb_mask = te_prompt_extract(hidden, mask, drop=34)

The rules are diffusers 0.42.1's ``QwenImagePipeline._get_qwen_prompt_embeds``: the prompt is
put into the template with ``str.format``; the tokenizer is called with ``padding=True,
truncation=True, max_length=1024 + drop`` (right side, pad to the longest); the last hidden
states' valid rows are kept (``attention_mask == 1``), the first ``drop`` of each dropped, and
the rest right-padded with zeros to the longest, with a 0/1 int64 mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implements

_DEVICES = ("cpu", "cuda")


def both(op: str, kernel: str):
    """Register ``fn`` for the strict family on the CPU and the production family everywhere."""

    def deco(fn):
        implements(op, "strict", device="cpu", kernel=kernel)(fn)
        implements(op, "production", device=_DEVICES, kernel=kernel)(fn)
        return fn

    return deco


@both("te_tokenize", kernel="template_format+bpe+pad_right")
def te_tokenize(prompts: Sequence[str], template: str, encode: Callable[[list[str]], list[list[int]]],
                pad_id: int, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of ``template.format(p)`` for each prompt, truncated on the right to
    ``max_length`` and right-padded with ``pad_id`` to the longest.

    Args:
        prompts: B strings.  template: with one ``{}``.  encode: texts → token id lists (a BPE
            tokenizer with its added tokens, no special tokens added around the text).
        pad_id: the tokenizer's pad token id.  max_length: ≥ 1.
    Returns:
        (input_ids [B, L] int64, attention_mask [B, L] int64, 1 valid / 0 padding), on the CPU.
    Raises:
        UnsupportedConfigError: no prompt, a prompt that is not a string, ``max_length`` < 1.
    """
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise UnsupportedConfigError("te_tokenize: give one or more prompt strings")
    if max_length < 1:
        raise UnsupportedConfigError(f"te_tokenize: max_length {max_length} < 1")
    rows = [ids[:max_length] for ids in encode([template.format(p) for p in prompts])]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[b, : len(r)] = 1
    return ids, mask


@both("te_embed_tokens", kernel="gather")
def te_embed_tokens(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[ids]``: ids [B, L] int64, table [V, D] → [B, L, D] (the table's dtype).

    Raises:
        UnsupportedConfigError: an id outside [0, V).
    """
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise UnsupportedConfigError(f"te_embed_tokens: token ids must lie in [0, {table.shape[0]})")
    return torch.nn.functional.embedding(ids, table)


@both("te_prompt_extract", kernel="select_valid+drop+pad_right")
def te_prompt_extract(hidden: torch.Tensor, attention_mask: torch.Tensor,
                      drop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows of the last hidden states, as diffusers' ``_get_qwen_prompt_embeds``.

    Args:
        hidden: [B, L, D].  attention_mask: [B, L] 0/1 (any integer or bool dtype).
        drop: template rows dropped from the front of each prompt's valid rows (34 t2i, 64 edit).
    Returns:
        (prompt_embeds [B, L', D] in hidden's dtype, mask [B, L'] int64) with L' the longest kept
        length; rows past a prompt's kept length are zeros (mask 0).
    Raises:
        UnsupportedConfigError: a prompt with no valid row left after the drop (an empty prompt
            cannot be attended by the transformer).
    """
    valid = attention_mask.bool()
    lengths = valid.sum(dim=1).tolist()
    parts = [e[drop:] for e in torch.split(hidden[valid], lengths, dim=0)]
    if min(p.shape[0] for p in parts) < 1:
        raise UnsupportedConfigError(f"te_prompt_extract: a prompt has no row after the first {drop}")
    width = max(p.shape[0] for p in parts)
    embeds = torch.stack([torch.cat([p, p.new_zeros(width - p.shape[0], p.shape[1])]) for p in parts])
    mask = torch.stack([torch.cat([torch.ones(p.shape[0], dtype=torch.long, device=p.device),
                                   torch.zeros(width - p.shape[0], dtype=torch.long, device=p.device)])
                        for p in parts])
    return embeds, mask
