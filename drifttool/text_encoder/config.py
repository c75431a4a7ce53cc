"""The language model's shape, read from a Qwen2.5-VL ``config.json``.

    >>> cfg = TextEncoderConfig.from_file("Qwen-Image/text_encoder/config.json")
    >>> cfg.hidden_size, cfg.layers, cfg.heads, cfg.kv_heads, cfg.mrope_section
    (3584, 28, 28, 4, (16, 24, 24))

Both layouts of that file are read: transformers 5.x's (the language model's fields under
``text_config``, RoPE under ``rope_parameters``) and 4.x's as Qwen-Image ships it (top-level
fields, ``rope_theta`` and ``rope_scaling.mrope_section``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.checkpoint_files import read_json_object


@dataclass(frozen=True, kw_only=True)
class TextEncoderConfig:
    """The Qwen2.5-VL language model (``Qwen2_5_VLTextModel``) drifttool runs.

    Attributes:
        vocab_size, hidden_size, intermediate_size: widths.
        layers: decoder layers.  heads, kv_heads: query and K/V heads (GQA); head_dim =
            hidden_size / heads.
        rms_norm_eps: every RMSNorm's epsilon.
        rope_theta: RoPE base.  mrope_section: frequencies per position axis (t, h, w); sums to
            head_dim / 2.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "TextEncoderConfig":
        """Raises ``CheckpointError`` for a missing field and ``UnsupportedConfigError`` for an
        architecture drifttool does not run (another activation or RoPE type, sliding window,
        heads that do not divide)."""
        text = raw.get("text_config") or raw
        rope = text.get("rope_parameters") or raw.get("rope_parameters") \
            or {**(text.get("rope_scaling") or raw.get("rope_scaling") or {}),
                "rope_theta": text.get("rope_theta", raw.get("rope_theta"))}
        try:
            cfg = cls(vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
                      intermediate_size=int(text["intermediate_size"]),
                      layers=int(text["num_hidden_layers"]), heads=int(text["num_attention_heads"]),
                      kv_heads=int(text["num_key_value_heads"]), rms_norm_eps=float(text["rms_norm_eps"]),
                      rope_theta=float(rope["rope_theta"]),
                      mrope_section=tuple(int(n) for n in rope["mrope_section"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: not a Qwen2.5-VL text config ({e!r} missing or invalid)") from None
        if text.get("hidden_act", "silu") != "silu" or rope.get("rope_type", rope.get("type", "default")) \
                not in ("default", "mrope") or text.get("use_sliding_window"):
            raise UnsupportedConfigError(f"{source}: drifttool runs Qwen2.5-VL's SiLU MLP with default "
                                         "mRoPE and full attention only")
        if cfg.hidden_size % cfg.heads or cfg.heads % cfg.kv_heads or len(cfg.mrope_section) != 3 \
                or sum(cfg.mrope_section) * 2 != cfg.head_dim:
            raise UnsupportedConfigError(f"{source}: heads {cfg.heads}/{cfg.kv_heads}, width {cfg.hidden_size} "
                                         f"and mrope_section {cfg.mrope_section} do not fit together")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "TextEncoderConfig":
        return cls.from_dict(read_json_object(Path(path)), str(path))
