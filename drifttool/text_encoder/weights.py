"""The language model's tensors from a Qwen2.5-VL ``text_encoder/`` folder (safetensors only).

    >>> w = read_weights("Qwen-Image/text_encoder", dtype=torch.bfloat16)
    >>> w["layers.0.self_attn.q_proj.weight"].shape
    torch.Size([3584, 3584])

Names are the checkpoint's own without the language model's prefix (``model.`` as Qwen-Image
ships it, ``model.language_model.`` as transformers 5.x may save it): ``embed_tokens.weight``,
``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``,
``layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}``, ``layers.{i}.self_attn.o_proj.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``. The vision tower (``visual.``)
and the LM head are not read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import read_json_object
from drifttool.model.checkpoint_stream import read_tensors
from drifttool.text_encoder.config import TextEncoderConfig

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREFIXES = ("model.language_model.", "model.")


def expected_shapes(cfg: TextEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the language model needs, with its shape."""
    d, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {"embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    for n in range(cfg.layers):
        p = f"layers.{n}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d), p + "self_attn.q_proj.bias": (q,),
                   p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
                   p + "self_attn.o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (i, d),
                   p + "mlp.up_proj.weight": (i, d), p + "mlp.down_proj.weight": (d, i)}
    return shapes


def weight_files(folder: Path) -> list[Path]:
    """``model.safetensors``, or the shards ``model.safetensors.index.json`` names."""
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        shards = read_json_object(folder / INDEX).get("weight_map", {})
        return [folder / f for f in sorted(set(shards.values()))]
    raise CheckpointError(f"{folder}: neither {SINGLE} nor {INDEX} (drifttool reads safetensors only)")


def _name(key: str) -> str | None:
    for p in PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return None


def read_weights(folder: str | Path, cfg: TextEncoderConfig, *, dtype: torch.dtype | None = None,
                 device: str = "cpu") -> dict[str, torch.Tensor]:
    """The language model's tensors (``expected_shapes``), in ``dtype`` (None: as stored).

    Raises:
        CheckpointError: unreadable files, a tensor missing, or a shape other than the config's.
    """
    want = expected_shapes(cfg)
    got: dict[str, torch.Tensor] = {}
    for key, t in read_tensors(weight_files(Path(folder)), device=device, dtype=dtype):
        name = _name(key)
        if name in want and name not in got:
            if tuple(t.shape) != want[name]:
                raise CheckpointError(f"{folder}: {key} has shape {tuple(t.shape)}, the config says {want[name]}")
            got[name] = t
    missing = sorted(set(want) - set(got))
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} language-model tensor(s) missing, e.g. {missing[0]}")
    return got
