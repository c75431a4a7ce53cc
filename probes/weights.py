"""Checkpoint transforms: mistakes of a checkpoint mapper, applied to a copy of the baseline's weights.

    >>> state = swap_stream_qkv(load_state("fixtures/tiny-t2i/transformer"))
    >>> write_checkpoint(state, config, "runs/probe/transformer")    # the probe runs on this copy

``swap_stream_qkv`` is the RFC's "stream weights" factor (``qwenimage_checkpoint_mapper``: both
stream weight maps): a mapper that loads the image stream's Q/K/V projections
(``attn.to_q/to_k/to_v``) into the text stream (``attn.add_q_proj/add_k_proj/add_v_proj``) and
the other way round. Every other tensor is unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.checkpoint_files import CONFIG_NAME, WEIGHTS_NAME

_QKV_SWAP = {"to_q": "add_q_proj", "to_k": "add_k_proj", "to_v": "add_v_proj"}
_QKV_SWAP.update({v: k for k, v in _QKV_SWAP.items()})
_ATTN = re.compile(r"^(transformer_blocks\.\d+\.attn\.)([a-z_]+)(\.(?:weight|bias))$")


def swap_stream_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Image-stream and text-stream Q/K/V projections exchanged in every block."""
    out = {}
    for name, t in state.items():
        m = _ATTN.match(name)
        if m and m.group(2) in _QKV_SWAP:
            out[f"{m.group(1)}{_QKV_SWAP[m.group(2)]}{m.group(3)}"] = t
        else:
            out[name] = t
    return out


def load_state(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a diffusers-format transformer folder, under the checkpoint's names
    (loaded through the checkpoint mapper, so a bad folder fails as it would for a run)."""
    return {k: v.detach() for k, v in load_checkpoint(folder, dtype=dtype).state_dict().items()}


def write_checkpoint(state: dict[str, torch.Tensor], config: dict, folder: str | Path) -> Path:
    """Write ``state`` and ``config`` as a single-file diffusers-format folder; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS_NAME))
    return folder


def transformed_checkpoint(source: str | Path, transform, folder: str | Path,
                           dtype: torch.dtype | None = None) -> Path:
    """Copy the checkpoint at ``source`` (cast to ``dtype``) through ``transform`` into ``folder``."""
    source = Path(source)
    config = json.loads((source / CONFIG_NAME).read_text())
    return write_checkpoint(transform(load_state(source, dtype)), config, folder)
