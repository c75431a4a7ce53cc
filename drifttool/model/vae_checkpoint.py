"""Load a diffusers ``AutoencoderKLQwenImage`` folder into drifttool's ``QwenImageVAE``.

    >>> vae = load_vae("Qwen-Image")            # a pipeline folder → its vae/; or a vae folder
    >>> vae = load_vae("tiny/vae", dtype=torch.bfloat16)

A VAE folder holds ``config.json`` and ``diffusion_pytorch_model.safetensors`` (or a sharded
index), as ``AutoencoderKLQwenImage.save_pretrained`` writes; a pipeline folder
(``model_index.json`` naming an ``AutoencoderKLQwenImage`` ``vae``) loads from its ``vae/``. The
files are read by ``drifttool.model.checkpoint_files`` (safetensors only, never pickle).
"""

from __future__ import annotations

from pathlib import Path

import torch

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import (
    CONFIG_NAME, component_folder, read_json_object, read_shapes, weight_files,
)
from drifttool.model.checkpoint_stream import read_tensors
from drifttool.model.vae import QwenImageVAE, VAEConfig, from_diffusers_config

VAE_SUBFOLDER = "vae"
VAE_CLASS = "AutoencoderKLQwenImage"


def vae_folder(path: str | Path) -> Path:
    """The folder holding the VAE's ``config.json``: ``path`` itself or a pipeline's ``vae/``.

    Raises:
        CheckpointError: not a directory; neither kind of folder; a pipeline whose ``vae``
            component is missing or of another class.
    """
    return component_folder(path, VAE_SUBFOLDER, VAE_CLASS, "VAE")


def vae_config(path: str | Path) -> VAEConfig:
    """The ``VAEConfig`` of a VAE folder or a pipeline's ``vae/``, no weight read.

    Raises:
        CheckpointError: as ``vae_folder``; an unreadable ``config.json``.
        UnsupportedConfigError: a config drifttool does not implement (``from_diffusers_config``).
    """
    return from_diffusers_config(read_json_object(vae_folder(path) / CONFIG_NAME))


def load_vae(path: str | Path, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> QwenImageVAE:
    """Load a VAE folder (or a pipeline folder's ``vae/``) into a ``QwenImageVAE`` in ``dtype``.

    The config is checked against the safetensors headers before any tensor is read.

    Raises:
        CheckpointError: missing/unreadable files; missing, unexpected or mis-shaped tensors
            (listed in one error); non-float tensors.
        UnsupportedConfigError: a config drifttool does not implement (``from_diffusers_config``).
    """
    folder = vae_folder(path)
    config = vae_config(folder)
    files = weight_files(folder)
    with torch.device("meta"):
        vae = QwenImageVAE(config)
    want = {k: tuple(p.shape) for k, p in vae.named_parameters()}
    stored = read_shapes(files)
    missing = sorted(set(want) - set(stored))
    extra = sorted(set(stored) - set(want))
    shaped = sorted(f"{k}: {stored[k]} (expected {want[k]})" for k in set(want) & set(stored) if stored[k] != want[k])
    if missing or extra or shaped:
        parts = [f"{what} ({len(items)}): {', '.join(items[:8])}{' …' if len(items) > 8 else ''}"
                 for what, items in (("missing", missing), ("unexpected", extra), ("mis-shaped", shaped)) if items]
        raise CheckpointError(f"{folder}: the weights do not fit config.json: " + "; ".join(parts))
    state = {}
    for name, t in read_tensors(files, device=device):
        if not t.is_floating_point():
            raise CheckpointError(f"{folder}: non-float tensor {name}: {t.dtype}")
        state[name] = t.to(dtype)
    vae.load_state_dict(state, strict=True, assign=True)
    return vae.eval()
