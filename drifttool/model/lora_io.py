"""An attached LoRA adapter as data: its files, digest, manifest record, effective weights and gradients.

    >>> save_lora(model, "adapter/")                      # a peft folder + a diffusers file
    >>> load_lora(other_model, "adapter/")                # peft or diffusers; keys checked
    >>> lora_record(model)["digest"]                      # what the manifest's ``lora`` holds
    >>> capture_lora_grads(model, recorder, phase="train", step=3)   # role grad_weight

``drifttool.model.lora`` attaches adapters to the MMDiT and runs them in the forward; this module
is what leaves or enters the model with them: the peft/diffusers files (through
``lora_formats``), the digest and record that pin the adapter in the fingerprint and manifest,
the weights the fingerprint digests in mode ``fused``, and the gradient records of the factors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.lora import (
    attach_lora,
    check_lora_mode,
    has_lora,
    lora_mode,
    lora_modules,
    lora_parameters,
    lora_scales,
    remove_lora,
)
from drifttool.model.lora_formats import read_adapter, write_adapter
from drifttool.model.weights import weight_digest
from drifttool.ops.lora import peft_merge

# ---------------------------------------------------------------------------------------------
# digest and record


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the adapter weights under peft's key names."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in lora_parameters(model).items()}


def lora_digest(model) -> str | None:
    """``weight_digest`` of the adapter weights and of every module's scale (as an FP64 scalar
    ``<module>.lora_scale``), so a changed alpha or rank rule changes it; None without one."""
    if not has_lora(model):
        return None
    scales = {f"{n}.lora_scale": torch.tensor(s, dtype=torch.float64) for n, s in lora_scales(model).items()}
    return weight_digest({**lora_state_dict(model), **scales})


APPLY = {
    "merged": "merged by op lora_merge (drifttool.lora_merge.v1): peft merge_and_unload",
    "fused": "fused by op lora_fuse (drifttool.lora_fuse.v1): diffusers load_lora_weights + fuse_lora",
    "unfused": "unfused, op lora_delta (drifttool.lora_delta.v1) added to the base GEMM: diffusers "
               "load_lora_weights (factors in the model dtype)",
    "unfused-fp32": "unfused, the branch s*B(A(x)) added to the base GEMM before its epilogue: a "
                    "peft-wrapped transformer (factors FP32); production by op lora_delta "
                    "(drifttool.lora_delta.v1), strict inside the block GEMM operators in FP32",
}
"""The manifest's ``lora.apply`` text per mode."""


def lora_record(model) -> dict[str, Any] | None:
    """The manifest record of the adapter: its config (``AdapterConfig.record``), the scale
    (one number, or None when the patterns give modules different scales), the digest, the mode
    and the factors' dtype."""
    if not has_lora(model):
        return None
    scales = set(lora_scales(model).values())
    mode = lora_mode(model)
    factor = next(iter(lora_parameters(model).values())).dtype
    return {**model.lora_config.record(), "scale": scales.pop() if len(scales) == 1 else None,
            "digest": lora_digest(model), "key_naming": "peft/diffusers", "mode": mode,
            "factor_dtype": str(factor).removeprefix("torch."), "apply": APPLY[mode]}


def effective_weights(model) -> dict[str, torch.Tensor]:
    """The parameters the forward runs on, for the fingerprint's weight digest: the model's
    ``named_parameters``, except that in mode ``fused`` each adapted weight is the fused one
    (``ops.lora.peft_merge``, the bytes diffusers' ``fuse_lora`` leaves in the base layer), so a
    fused pipeline's capture and a fused run pin the same weights."""
    state = dict(model.named_parameters())
    if lora_mode(model) == "fused":
        with torch.no_grad():
            for name, m in lora_modules(model).items():
                state[f"{name}.weight"] = peft_merge(m.weight, m.lora_A.weight, m.lora_B.weight,
                                                     float(m.lora_scale), getattr(m, "lora_magnitude_vector", None))
    return state


# ---------------------------------------------------------------------------------------------
# save / load


def save_lora(model, path: str | Path) -> Path:
    """Write the adapter as a folder that peft (``PeftModel.from_pretrained``) and diffusers
    (``QwenImagePipeline.load_lora_weights``, ``load_lora_adapter``) both load
    (``lora_formats.write_adapter``): FP32 tensors, the model's ``AdapterConfig``.

    Raises:
        CheckpointError: the model has no adapter.
    """
    if not has_lora(model):
        raise CheckpointError("the model carries no LoRA adapter to save")
    return write_adapter(path, lora_state_dict(model), model.lora_config)


def load_lora(model, path: str | Path, *, freeze_base: bool = True,
              mode: str = "merged") -> dict[str, nn.Parameter]:
    """Load a peft, diffusers or kohya adapter (``lora_formats.read_adapter``: folder or file) into
    ``model``, attaching one first if it has none (``attach_lora`` with the file's config and
    ``mode``, so ranks and scales follow peft's rules); the factors are stored FP32 (modes
    ``merged``, ``unfused-fp32``) or rounded to the model dtype (``fused``, ``unfused``: as
    diffusers' ``load_lora_weights`` rounds them).

    Raises:
        CheckpointError, UnsupportedConfigError: as ``adapter_values``.
    """
    values = adapter_values(model, path, freeze_base=freeze_base, mode=mode)
    params = lora_parameters(model)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(values[k])
    return params


def adapter_values(model, path: str | Path, *, freeze_base: bool = True, mode: str = "merged",
                   init: bool = True) -> dict[str, torch.Tensor]:
    """The adapter at ``path`` checked against ``model`` (attached first if it has none, as
    ``load_lora``; ``init``: ``attach_lora``'s, ``False`` for a meta model whose factors are
    streamed in by ``load_checkpoint(lora=)``): ``{parameter name: CPU tensor}``, each contiguous
    in its parameter's dtype (the bytes ``load_lora`` copies in). Nothing is loaded into the
    parameters.

    Raises:
        CheckpointError: a refused config; one error listing every missing, unexpected and
            mis-shaped key, non-float / non-finite tensors, and, for a model that already has an
            adapter, modules whose scale differs (nothing is left attached then).
        UnsupportedConfigError: unknown mode, or a model whose adapter runs in another mode.
    """
    check_lora_mode(mode)
    tensors, cfg = read_adapter(path)
    fresh = not has_lora(model)
    if fresh:
        attach_lora(model, cfg, freeze_base=freeze_base, mode=mode, init=init)
    elif lora_mode(model) != mode:
        raise UnsupportedConfigError(f"the model's adapter runs in LoRA mode {lora_mode(model)!r}, not {mode!r}")
    params = lora_parameters(model)
    missing = [k for k in params if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in params)
    misshaped = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(params[k].shape)}"
                 for k in params if k in tensors and tensors[k].shape != params[k].shape]
    bad = [k for k, t in tensors.items() if k in params and (not t.is_floating_point()
                                                              or not bool(torch.isfinite(t).all()))]
    rescaled = [f"{n}: file {cfg.scale(n)} vs model {s}" for n, s in lora_scales(model).items()
                if not fresh and cfg.scale(n) != s]
    problems = [(f"missing keys ({len(missing)}): ", missing),
                (f"unexpected keys ({len(unexpected)}): ", unexpected),
                (f"mis-shaped keys ({len(misshaped)}): ", misshaped),
                (f"non-float or non-finite tensors ({len(bad)}): ", bad),
                (f"scale (alpha/r) differs from the model's ({len(rescaled)}): ", rescaled)]
    lines = [head + "; ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")
             for head, keys in problems if keys]
    if lines:
        if fresh:
            remove_lora(model)
        raise CheckpointError(f"LoRA adapter {path} does not match the model:\n  " + "\n  ".join(lines))
    return {k: tensors[k].to(device="cpu", dtype=p.dtype).contiguous() for k, p in params.items()}


def fingerprinted(model):
    """What the fingerprint's weight digest hashes (``weight_digest``): the model itself — its
    loader's pinned digest stands while no parameter changed, an adapter streamed in with it
    (``load_checkpoint(lora=)``) included — or, for a ``fused`` adapter, its effective weights
    (``effective_weights``: the fused bytes diffusers' ``fuse_lora`` leaves)."""
    return effective_weights(model) if has_lora(model) and lora_mode(model) == "fused" else model


# ---------------------------------------------------------------------------------------------
# gradients


def grad_identity(name: str, num_layers: int) -> tuple[int, str, str]:
    """(block, stream, op) of an adapter parameter's gradient record: ``op`` is the target and
    factor (``attn.to_q.lora_A``, ``img_in.lora_B``), stream img/txt by the target's stream
    (``none`` for the timestep MLP); block −1 for the embedders, ``num_layers`` for the final
    Linears (the call-site blocks of ``drifttool.model.mmdit``)."""
    op = name.removesuffix(".weight")
    if name.startswith("transformer_blocks."):
        block, op = name.removeprefix("transformer_blocks.").removesuffix(".weight").split(".", 1)
        txt = op.startswith(("attn.add_", "attn.to_add_out", "txt_mlp.", "txt_mod."))
        return int(block), "txt" if txt else "img", op
    stream = "none" if op.startswith("time_text_embed.") else "txt" if op.startswith("txt_in.") else "img"
    return (num_layers if op.startswith(("norm_out.", "proj_out.")) else -1), stream, op


def capture_lora_grads(model, recorder, *, phase: str, step: int, sigma: float = math.nan,
                       rank: int = 0) -> int:
    """Digest every adapter gradient (``p.grad``, as accumulated so far) into ``recorder`` with
    role ``grad_weight`` (one record per parameter, sample −1). Returns the number captured;
    parameters without a gradient are skipped."""
    if recorder is None or getattr(recorder, "level", "L1") == "L0":  # L0 keeps no op records
        return 0
    n = 0
    for name, p in lora_parameters(model).items():
        if p.grad is None:
            continue
        block, stream, op = grad_identity(name, len(model.transformer_blocks))
        recorder.capture_grad(phase=phase, step=step, sigma=sigma, block=block, stream=stream,
                              op=op, tensor=p.grad, rank=rank)
        n += 1
    return n
