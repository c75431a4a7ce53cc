"""Strict binding of an unmodified diffusers ``QwenImageTransformer2DModel``: inside the block, its
forward is drifttool's strict MMDiT on the transformer's own parameters.

    >>> pipe = QwenImagePipeline.from_pretrained(folder)
    >>> with bind_strict(pipe.transformer) as bound:     # Runtime(mode="strict") unless given
    ...     latents = pipe(prompt_embeds=pe, ..., output_type="latent").images
    >>> bound.rt.trace[0]["family"], bound.model            # what ran, and the model it ran
    ('strict', MMDiT(...))

What is bound, and why there. diffusers' blocks compute the modulation, the gated residuals and
RoPE inline, in tensor expressions that no module hook can replace, so binding operator by
operator would leave those in diffusers' arithmetic. drifttool binds at the transformer's
forward instead, through diffusers' own extension point for model hooks (``HookRegistry``,
``pipeline_hooks.transformer_tap``): each call — the pipeline's, a trainer's — runs
``MMDiT.forward`` under the binding's runtime, every operator dispatched to the runtime's family
(strict: the CPU's contract v2 or the CUDA family on a GPU) and recorded in its operator trace
(``rt.trace``: the family and kernel that actually ran). Everything around the transformer —
the pipeline, its scheduler, its text encoder, other hooks — is diffusers' own and unchanged.

The parameters are the transformer's tensors, not copies (``MMDiT`` built on the meta device and
each parameter assigned; the names are the same in both), so in-place weight updates are seen,
the device and dtype are the transformer's, and each parameter's ``requires_grad`` stays as the
transformer has it (binding never unfreezes a frozen weight). A peft LoRA adapter (``load_lora_adapter``,
``load_lora_weights`` or ``peft.inject_adapter_in_model``; one adapter, active) becomes drifttool's
adapter — in LoRA mode ``merged`` under the strict family (W' = fp32(W) + s·(B·A) by
``lora_merge``: the strict family's own LoRA arithmetic), in the mode its layers are in under the
production family (``peft_lora.lora_of``) — with the *same* factor
``Parameter`` objects and each layer's ``scaling`` as its scale: a backward through the bound
transformer accumulates into peft's ``lora_A``/``lora_B`` ``.grad``, with the strict family's
gradient arithmetic. A fused adapter (``fuse_lora``) is already in the base weights and binds as
plain weights.

Arguments drifttool's model does not take are refused in one line: ``guidance``,
``controlnet_block_samples``, ``additional_t_cond``, ``attention_kwargs``. With condition images
(the edit pipelines' ``img_shapes``) the output holds the noisy rows only — the rows the
pipelines read (``noise_pred[:, :latents.size(1)]``).

Byte claims (tests/adapters/test_diffusers_strict.py): the bound transformer's output equals
drifttool's strict MMDiT loaded from the same folder, bf16 and FP32, batch 1 and 3, masked
prompts; with a peft adapter, output and every LoRA gradient equal drifttool's own model with the
adapter loaded by drifttool in the same mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from drifttool.adapters.peft_lora import adapter_config, canonical_parameters, lora_of, peft_layers
from drifttool.adapters.pipeline_hooks import transformer_tap
from drifttool.adapters.pipeline_scope import image_grids_of
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.model.config import from_diffusers_config
from drifttool.model.lora import attach_lora, lora_modules
from drifttool.model.mmdit import MMDiT
from drifttool.runtime import Mode, Runtime

REFUSED = ("guidance", "controlnet_block_samples", "additional_t_cond", "attention_kwargs")
"""Forward arguments drifttool's MMDiT does not take: a call that sets one is refused."""


@dataclass
class Bound:
    """What ``bind_strict`` yields. Attributes: model (drifttool's ``MMDiT`` on the
    transformer's parameters), rt (the runtime every call runs under), calls (forwards run)."""

    model: MMDiT
    rt: Runtime
    calls: int = 0


def strict_model_of(transformer: torch.nn.Module, family: str = "strict") -> MMDiT:
    """drifttool's ``MMDiT`` on ``transformer``'s own parameter tensors (module docstring), with a
    peft adapter's factors as its LoRA factors: in LoRA mode ``merged`` under the strict family
    (its own merge, ``lora_merge``), else in the mode peft's layers are in.

    Raises:
        DriftToolError: not a QwenImage transformer (its parameters do not match the config's model).
        UnsupportedConfigError: several or inactive peft adapters, or layers in different modes.
    """
    cfg = from_diffusers_config(dict(transformer.config))
    dtype = next(transformer.parameters()).dtype
    with torch.device("meta"):
        model = MMDiT(cfg, dtype=dtype)
    params = canonical_parameters(transformer)
    base = {k: v for k, v in params.items() if ".lora_" not in k}
    lora = lora_of(transformer)
    for name, p in model.named_parameters():  # load_state_dict(assign=True) sets each assigned
        if name in base:                      # Parameter's requires_grad to the model's: keep the
            p.requires_grad_(base[name].requires_grad)  # transformer's (frozen stays frozen)
    try:
        model.load_state_dict(base, strict=True, assign=True)
    except RuntimeError as e:
        raise DriftToolError(f"{type(transformer).__name__}: its parameters are not a QwenImage "
                             f"transformer's ({str(e).splitlines()[0]})") from None
    if lora is not None and lora["mode"] != "fused":
        _bind_adapter(model, transformer, "merged" if family == "strict" else lora["mode"])
    return model


def _bind_adapter(model: MMDiT, transformer: torch.nn.Module, mode: str) -> None:
    """Attach drifttool's adapter in ``mode`` and make its factors peft's Parameters."""
    peft = peft_layers(transformer)
    (adapter,) = {a for m in peft.values() for a in m.lora_A}  # lora_of checked: one adapter
    attach_lora(model, adapter_config(transformer, adapter), freeze_base=False, mode=mode)
    mods = lora_modules(model)
    if set(mods) != set(peft):
        raise UnsupportedConfigError(f"peft adapter {adapter!r} targets {len(peft)} modules, drifttool's "
                                     f"reading of its config {len(mods)}: bind a transformer without it")
    for name, m in mods.items():
        layer = peft[name]
        m.lora_A.weight = layer.lora_A[adapter].weight  # the same Parameter: gradients land in peft's
        m.lora_B.weight = layer.lora_B[adapter].weight
        m.lora_scale = float(layer.scaling[adapter])


@contextlib.contextmanager
def bind_strict(transformer: torch.nn.Module, rt: Runtime | None = None) -> Iterator[Bound]:
    """Inside the block, every forward of ``transformer`` is drifttool's MMDiT under ``rt``
    (default ``Runtime(mode="strict")``) on the transformer's parameters (module docstring).
    Afterwards the transformer's forward and hooks are as before, also after an error.

    Raises:
        DriftToolError, UnsupportedConfigError: as ``strict_model_of``; in a call, an argument of
            ``REFUSED`` set, or ``img_shapes`` drifttool cannot name (``image_grids_of``).
    """
    rt = rt or Runtime(mode=Mode.STRICT)
    bound = Bound(model=strict_model_of(transformer, rt.mode.family), rt=rt)

    def on_forward(context: str | None, args: dict[str, Any], run) -> Any:
        for name in REFUSED:
            if args.get(name) is not None:
                raise UnsupportedConfigError(f"bind_strict: the transformer was called with {name}=..., "
                                             "which drifttool's MMDiT does not take")
        hs, txt = args["hidden_states"], args["encoder_hidden_states"]  # [B, N(+Nc), C], [B, L, D]
        mask = args.get("encoder_hidden_states_mask")
        grid, cond_grids = image_grids_of(args.get("img_shapes"))
        n = grid[0] * grid[1]
        v = bound.model(hs[:, :n], txt, None if mask is None else mask.bool(), args["timestep"], grid,
                        bound.rt, cond=hs[:, n:] if cond_grids else None, cond_grids=cond_grids)
        bound.calls += 1
        if not args.get("return_dict", True):
            return (v,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=v)

    with transformer_tap(transformer, on_forward):
        yield bound
