"""kohya-style LoRA files for Qwen-Image, converted as diffusers' loader converts them.

    >>> is_kohya(tensors)                                   # lora_unet_… / .lora_down / .alpha
    >>> tensors, alpha_given = from_kohya(tensors, path, top_names, block_names)

A kohya file names a module by its flattened path (``lora_unet_transformer_blocks_0_attn_to_q``,
``lora_unet_img_in``, optionally under ``diffusion_model.``), its factors ``.lora_down.weight``
``[r, in]`` / ``.lora_up.weight`` ``[out, r]`` and its ``.alpha`` (a scalar). diffusers'
``QwenImageLoraLoaderMixin.lora_state_dict`` (0.42.1) converts such a file before loading it;
``from_kohya`` is that conversion, so the factors drifttool loads carry the same bytes
(``drifttool.model.lora_formats.read_adapter`` calls it for a single file).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import torch

from drifttool.errors import CheckpointError


def is_kohya(tensors: dict[str, torch.Tensor]) -> bool:
    """True for the layouts diffusers' ``QwenImageLoraLoaderMixin.lora_state_dict`` converts:
    ``.alpha`` keys, ``lora_unet_`` / ``diffusion_model.`` prefixes, ``.lora_down`` / ``.lora_up``."""
    return any(k.endswith(".alpha") or k.startswith(("lora_unet_", "diffusion_model."))
               or ".lora_down." in k or ".lora_up." in k for k in tensors)


def _module_name(key: str, top: dict[str, str], block: dict[str, str]) -> str:
    """``lora_unet_transformer_blocks_0_img_mod_1.lora_down.weight`` →
    ``transformer_blocks.0.img_mod.1.lora_down.weight`` (``top`` / ``block``: flattened →
    dotted names); names it does not know stay as they are (reported by the loader)."""
    key = key.removeprefix("diffusion_model.").removeprefix("lora_unet_")
    flat, dot, rest = key.partition(".")
    m = re.fullmatch(r"transformer_blocks_(\d+)_(\w+)", flat)
    if flat in top:
        flat = top[flat]
    elif m and m.group(2) in block:
        flat = f"transformer_blocks.{m.group(1)}.{block[m.group(2)]}"
    return (flat + dot + rest).replace(".default.", ".")


def from_kohya(tensors: dict[str, torch.Tensor], where: Path, top_names: Iterable[str],
               block_names: Iterable[str]) -> tuple[dict[str, torch.Tensor], bool]:
    """diffusers' ``_convert_non_diffusers_qwen_lora_to_diffusers`` (0.42.1): module names
    un-flattened, ``lora_down`` / ``lora_up`` renamed ``lora_A`` / ``lora_B``, and each module's
    ``alpha`` folded into its factors: with s = alpha / r (r = ``lora_down`` rows),
    ``A ← A · s_down``, ``B ← B · s_up`` where (s_down, s_up) = (s, 1) halved/doubled while
    ``2·s_down < s_up`` (so s_down·s_up = s; each product one rounding in the file's dtype, as
    diffusers computes it). The result runs at scale 1 (α = r, diffusers' config for a file
    without metadata). ``top_names`` are the model-level module names, ``block_names`` the
    suffixes inside ``transformer_blocks.{i}``. Returns (tensors with keys
    ``<module>.lora_A.weight`` / ``.lora_B.weight``, whether every module had an ``alpha``).

    Raises:
        CheckpointError: a down/A factor without its up/B factor or the reverse, or keys left
            over (named), as diffusers refuses them.
    """
    top = {n.replace(".", "_"): n for n in top_names}
    block = {n.replace(".", "_"): n for n in block_names}
    sd = {_module_name(k, top, block): t for k, t in tensors.items()}
    out: dict[str, torch.Tensor] = {}
    alphas = []
    for k in sorted(sd):
        for down, up in ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight")):
            if not k.endswith(down):
                continue
            mod = k.removesuffix(down)
            if mod + up not in sd:
                raise CheckpointError(f"{where}: {k} has no {mod + up}")
            a, b, alpha = sd[k], sd[mod + up], sd.get(mod + ".alpha")
            s_down, s_up = 1.0, 1.0
            if alpha is not None:
                s_down = alpha.item() / a.shape[0]  # diffusers: alpha / rank
                while s_down * 2 < s_up:
                    s_down, s_up = s_down * 2, s_up / 2
            alphas.append(alpha is not None)
            out[mod + ".lora_A.weight"], out[mod + ".lora_B.weight"] = a * s_down, b * s_up
    used = {m + sfx for m in (k.removesuffix(".lora_A.weight") for k in out)
            for sfx in (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight", ".alpha")}
    left = sorted(set(sd) - used)
    if left:
        raise CheckpointError(f"{where}: keys of no LoRA factor pair ({len(left)}): {', '.join(left[:6])}")
    return out, bool(alphas) and all(alphas)
