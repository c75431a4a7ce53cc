"""A pipeline's ``tokenizer/`` folder as drifttool reads it: the BPE of ``tokenizer.json``
(the ``tokenizers`` library) and the pad token of ``tokenizer_config.json``.

    >>> tok = PromptTokenizer.load("Qwen-Image/tokenizer")
    >>> tok.encode(["<|im_start|>user\\ncat<|im_end|>"]), tok.pad_id
    ([[151644, 872, 198, 4616, 151645]], 151643)

Token ids equal transformers' ``Qwen2Tokenizer(Fast)`` for the same folder (tested): no special
tokens are added around a text (Qwen2 adds none), added tokens such as ``<|im_start|>`` are
matched whole. Padding and truncation are the ``te_tokenize`` operator's, right-sided as
diffusers calls the tokenizer; a folder that asks for left padding is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from drifttool.errors import CheckpointError, UnsupportedConfigError


@dataclass(frozen=True)
class PromptTokenizer:
    """Attributes: bpe (``tokenizers.Tokenizer``), pad_id, source (the folder)."""

    bpe: Tokenizer
    pad_id: int
    source: Path

    @classmethod
    def load(cls, folder: str | Path) -> "PromptTokenizer":
        """Read ``folder/tokenizer.json`` and ``folder/tokenizer_config.json``.

        Raises:
            CheckpointError: a file missing or unreadable; no ``tokenizer.json`` (a folder of
                ``vocab.json`` + ``merges.txt`` only: re-save it with transformers'
                ``AutoTokenizer.from_pretrained(folder).save_pretrained(folder)``); a pad token
                the vocabulary lacks.
            UnsupportedConfigError: ``padding_side`` other than ``right``.
        """
        folder = Path(folder)
        path, cfg_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (drifttool reads the tokenizers-library file; "
                                  "re-save the folder with transformers to write it)")
        try:
            bpe = Tokenizer.from_file(str(path))
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, Exception) as e:  # tokenizers raises its own exception type
            raise CheckpointError(f"{folder}: unreadable tokenizer files ({e})") from None
        if cfg.get("padding_side", "right") != "right":
            raise UnsupportedConfigError(f"{cfg_path}: padding_side {cfg['padding_side']!r}; "
                                         "the Qwen-Image pipelines pad prompts on the right")
        pad = cfg.get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        pad_id = bpe.token_to_id(pad) if isinstance(pad, str) else None
        if pad_id is None:
            raise CheckpointError(f"{cfg_path}: pad_token {pad!r} is not in the vocabulary")
        return cls(bpe, pad_id, folder)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added, no padding, no truncation)."""
        return [e.ids for e in self.bpe.encode_batch(list(texts), add_special_tokens=False)]

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry. Raises ``CheckpointError`` when absent."""
        i = self.bpe.token_to_id(token)
        if i is None:
            raise CheckpointError(f"{self.source}: token {token!r} is not in the vocabulary")
        return i
