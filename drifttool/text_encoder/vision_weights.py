"""The vision tower's tensors from a Qwen2.5-VL ``text_encoder/`` folder (safetensors only).

    >>> w = read_vision_weights("Qwen-Image-Edit/text_encoder", vcfg, dtype=torch.bfloat16)
    >>> w["blocks.0.attn.qkv.weight"].shape
    torch.Size([3840, 1280])

Names are the checkpoint's own without the tower's prefix (``visual.`` as Qwen-Image ships it
and transformers 5.x saves it, or ``model.visual.``): ``patch_embed.proj.weight``,
``blocks.{i}.{norm1,norm2}.weight``, ``blocks.{i}.attn.{qkv,proj}.{weight,bias}``,
``blocks.{i}.mlp.{gate_proj,up_proj,down_proj}.{weight,bias}``, ``merger.ln_q.weight``,
``merger.mlp.{0,2}.{weight,bias}``. Only these tensors are read from the files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import locate_tensors
from drifttool.model.checkpoint_stream import stream_tensors
from drifttool.text_encoder.vision_config import VisionConfig
from drifttool.text_encoder.weights import weight_files

PREFIXES = ("visual.", "model.visual.")


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the vision tower needs, with its shape."""
    d, i, p, t = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.temporal_patch_size
    wide = d * cfg.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (d, 3, t, p, p), "merger.ln_q.weight": (d,),
              "merger.mlp.0.weight": (wide, wide), "merger.mlp.0.bias": (wide,),
              "merger.mlp.2.weight": (cfg.out_hidden_size, wide), "merger.mlp.2.bias": (cfg.out_hidden_size,)}
    for n in range(cfg.depth):
        b = f"blocks.{n}."
        shapes |= {b + "norm1.weight": (d,), b + "norm2.weight": (d,),
                   b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
                   b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                   b + "mlp.gate_proj.weight": (i, d), b + "mlp.gate_proj.bias": (i,),
                   b + "mlp.up_proj.weight": (i, d), b + "mlp.up_proj.bias": (i,),
                   b + "mlp.down_proj.weight": (d, i), b + "mlp.down_proj.bias": (d,)}
    return shapes


def read_vision_weights(folder: str | Path, cfg: VisionConfig, *, dtype: torch.dtype | None = None,
                        device: str = "cpu") -> dict[str, torch.Tensor]:
    """The vision tower's tensors (``vision_shapes``), in ``dtype`` (None: as stored).

    Raises:
        CheckpointError: unreadable files, a tensor missing, or a shape other than the config's.
    """
    want = vision_shapes(cfg)
    located = locate_tensors(weight_files(Path(folder)))
    picked: dict[str, str] = {}
    for prefix in PREFIXES:
        for name in want:
            if prefix + name in located and name not in picked:
                picked[name] = prefix + name
    missing = sorted(set(want) - set(picked))
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} vision-tower tensor(s) missing, e.g. visual.{missing[0]}")
    keys = {key: name for name, key in picked.items()}
    got: dict[str, torch.Tensor] = {}
    for key, t in stream_tensors(sorted((k, located[k]) for k in keys), device=device, dtype=dtype):
        if tuple(t.shape) != want[keys[key]]:
            raise CheckpointError(f"{folder}: {key} has shape {tuple(t.shape)}, the config says {want[keys[key]]}")
        got[keys[key]] = t
    return got
