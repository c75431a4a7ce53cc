"""The LoRA adapter a diffusers transformer carries (peft layers), as drifttool records it.

    >>> pipe.load_lora_weights("adapter/"); pipe.fuse_lora()
    >>> lora_of(pipe.transformer)["mode"], lora_of(pipe.transformer)["digest"]
    ('fused', 'xxh3_128:…')
    >>> canonical_parameters(pipe.transformer)      # peft names → drifttool's
    {'transformer_blocks.0.attn.to_q.weight': …, 'transformer_blocks.0.attn.to_q.lora_A.weight': …}

peft (0.21.2) wraps each adapted ``Linear`` in a ``lora.Linear``: the base weight becomes
``<module>.base_layer.weight``, the factors ``<module>.lora_A.<adapter>.weight`` (diffusers names
its adapters ``default_0``, ``default_1``, …). ``canonical_parameters`` maps these back to the
checkpoint's and drifttool's names (``drifttool.model.lora``), so the fingerprint's weight digest
of a captured LoRA pipeline equals a ``drifttool run --lora`` of the same adapter in the same mode.

The mode (``drifttool.model.lora.LORA_MODES``) is read from the layers: merged (``fuse_lora``) →
``fused``; active and unmerged with factors in the model dtype → ``unfused`` (diffusers'
``load_lora_weights``); FP32 factors in a lower-precision model → ``unfused-fp32`` (a peft-wrapped
transformer). The record's ``digest`` is ``model.lora_io.lora_digest``'s: the factors under
drifttool's names and each module's scale (peft's ``scaling``, as ``set_adapters`` or
``fuse_lora(lora_scale=)`` leave it) as an FP64 scalar.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.model.lora_io import APPLY
from drifttool.model.lora_formats import parse_config
from drifttool.model.weights import weight_digest

_FACTOR = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")
_MAGNITUDE = re.compile(r"\.lora_magnitude_vector\.[^.]+\.weight$")


def canonical_name(name: str) -> str:
    """``a.to_q.base_layer.weight`` → ``a.to_q.weight``; ``a.to_q.lora_A.default_0.weight`` →
    ``a.to_q.lora_A.weight``; DoRA's ``a.to_q.lora_magnitude_vector.default_0.weight`` →
    ``a.to_q.lora_magnitude_vector``."""
    name = _MAGNITUDE.sub(".lora_magnitude_vector", name.replace(".base_layer.", "."))
    return _FACTOR.sub(r".\1.weight", name)


def peft_layers(transformer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{module name: peft LoRA layer}`` of every layer that holds an adapter."""
    return {n: m for n, m in transformer.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer") and len(getattr(m, "lora_A"))}


def canonical_parameters(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's parameters under drifttool's names (module docstring).

    Raises:
        UnsupportedConfigError: more than one adapter loaded (two names would collide).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in transformer.named_parameters():
        key = canonical_name(name)
        if key in out:
            raise UnsupportedConfigError(f"{key}: more than one LoRA adapter loaded; drifttool records one")
        out[key] = p
    return out


def adapter_config(transformer: torch.nn.Module, adapter: str):
    """drifttool's ``AdapterConfig`` of the transformer's peft adapter ``adapter``
    (``lora_formats.parse_config`` of its ``peft_config``).

    Raises:
        CheckpointError: a config drifttool refuses (as ``parse_config``).
    """
    raw = transformer.peft_config[adapter].to_dict()
    if isinstance(raw.get("target_modules"), (set, frozenset)):  # peft keeps a set in memory
        raw["target_modules"] = sorted(raw["target_modules"])
    return parse_config(raw, f"peft_config[{adapter!r}]")


def lora_of(transformer: torch.nn.Module) -> dict[str, Any] | None:
    """The manifest's ``lora`` record (``manifest_schema._LORA``) of the one adapter the transformer's
    peft layers hold, or None without one.

    Raises:
        UnsupportedConfigError: several adapters, an inactive or partly merged adapter, or layers
            that disagree on the mode.
    """
    layers = peft_layers(transformer)
    if not layers:
        return None
    names = {a for m in layers.values() for a in m.lora_A}
    if len(names) != 1:
        raise UnsupportedConfigError(f"LoRA adapters {sorted(names)} loaded: drifttool records one")
    (adapter,) = names
    model_dtype = next(m.base_layer.weight.dtype for m in layers.values())
    modes, tensors = set(), {}
    for n, m in layers.items():
        a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight
        if m.merged:
            modes.add("fused")
        elif getattr(m, "disable_adapters", False) or adapter not in m.active_adapters:
            raise UnsupportedConfigError(f"{n}: LoRA adapter {adapter!r} is loaded but not active")
        else:
            modes.add("unfused-fp32" if a.dtype == torch.float32 and model_dtype != torch.float32
                      else "unfused")
        tensors[f"{n}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{n}.lora_B.weight"] = b.detach().cpu().contiguous()
        if adapter in getattr(m, "lora_magnitude_vector", {}):  # DoRA
            tensors[f"{n}.lora_magnitude_vector"] = m.lora_magnitude_vector[adapter].weight.detach().cpu().contiguous()
        tensors[f"{n}.lora_scale"] = torch.tensor(float(m.scaling[adapter]), dtype=torch.float64)
    if len(modes) != 1:
        raise UnsupportedConfigError(f"LoRA layers in modes {sorted(modes)}: fuse or unfuse all of them")
    (mode,) = modes
    cfg = adapter_config(transformer, adapter)
    scales = {float(m.scaling[adapter]) for m in layers.values()}
    factor = next(iter(tensors.values())).dtype
    return {**cfg.record(), "scale": scales.pop() if len(scales) == 1 else None,
            "digest": weight_digest(tensors), "key_naming": "peft/diffusers", "mode": mode,
            "factor_dtype": str(factor).removeprefix("torch."), "apply": APPLY[mode]}
