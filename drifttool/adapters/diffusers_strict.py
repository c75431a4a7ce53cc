"""Strict binding of an unmodified diffusers ``QwenImageTransformer2DModel``: inside the block, its
forward is drifttool's strict MMDiT on the transformer's own parameters.

    >>> pipe = QwenImagePipeline.from_pretrained(folder)
    >>> with bind_strict(pipe.transformer) as bound:     # Runtime(mode="strict") unless given
    ...     latents = pipe(prompt_embeds=pe, ..., output_type="latent").images
    >>> bound.rt.trace[0]["family"], bound.model            # what ran, and the model it ran
    ('strict', MMDiT(...))
    >>> bound.lora_mode, bound.lora_fallback                # a peft-wrapped bf16 transformer's adapter
    ('unfused-fp32', None)

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
transformer has it (binding never unfreezes a frozen weight). A peft LoRA adapter
(``load_lora_adapter``, ``load_lora_weights``, ``peft.inject_adapter_in_model`` or ``PeftModel``;
one adapter, active) becomes drifttool's adapter with the *same* factor ``Parameter`` objects and
each layer's ``scaling`` as its scale: a backward through the bound transformer accumulates into
peft's ``lora_A``/``lora_B`` ``.grad``, with the family's gradient arithmetic. A fused adapter
(``fuse_lora``) is already in the base weights and binds as plain weights (``bound.lora_mode``
None).

The LoRA mode it binds in (``bound.lora_mode``; ``lora_mode=`` overrides, one of
``model.lora.LORA_MODES``). Under the strict family, by default, the mode its layers are in
(``peft_lora.lora_of``) when strict runs it, else ``merged``:

- ``unfused-fp32`` — FP32 factors beside a lower-precision W (a peft-wrapped transformer, what
  Flow-GRPO trains): W stays in its dtype and the four block GEMMs (``qkv_bias_gemm``,
  ``attn_out_bias_gemm``, ``mlp_up_gemm_gelu``, ``mlp_down_gemm``) add fp32(s)·((x·Aᵀ)·Bᵀ) in FP32
  before their epilogue (docs/strict-arithmetic.md, "Unfused LoRA (strict)"; on the GPU a bf16 W
  stays on tensor cores). Strict adds an unfused adapter only there, so an adapter that also
  targets another Linear (``img_in``, ``txt_in``, ``proj_out``, ``norm_out.linear``, the
  modulation projections, the timestep MLP; ``lora_calls.strict_unfused_outside``) binds
  ``merged``.
- ``merged`` — every other case (factors in the model dtype, an FP32 model, an adapter outside the
  block GEMMs): W' = fp32(W) + s·(B·A) by ``lora_merge``, kept FP32, so each adapted projection
  runs the FP32 GEMM. A default that is not the layers' own mode is recorded, with why, in
  ``bound.lora_fallback``.

An explicit ``lora_mode`` that strict does not run (``fused``, ``unfused``), ``unfused-fp32`` with
factors that are not FP32 or with an adapter outside the block GEMMs is refused in one line. Under
the production family the default is the layers' own mode, as diffusers runs it.

Arguments drifttool's model does not take are refused in one line: ``guidance``,
``controlnet_block_samples``, ``additional_t_cond``, ``attention_kwargs``. With condition images
(the edit pipelines' ``img_shapes``) the output holds the noisy rows only — the rows the
pipelines read (``noise_pred[:, :latents.size(1)]``).

Byte claims (tests/adapters/test_diffusers_strict.py): the bound transformer's output equals
drifttool's strict MMDiT loaded from the same folder, bf16 and FP32, batch 1 and 3, masked
prompts; with a peft adapter (FP32 in merged; bf16 W with FP32 factors in unfused-fp32, batch 1 and
3), output and every LoRA gradient equal drifttool's own model with the adapter loaded by drifttool
in the same mode.
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
from drifttool.model.lora import STRICT_MODES, attach_lora, check_lora_mode, lora_modules
from drifttool.model.lora_calls import strict_unfused_outside
from drifttool.model.mmdit import MMDiT
from drifttool.runtime import Mode, Runtime

REFUSED = ("guidance", "controlnet_block_samples", "additional_t_cond", "attention_kwargs")
"""Forward arguments drifttool's MMDiT does not take: a call that sets one is refused."""


@dataclass
class Bound:
    """What ``bind_strict`` yields. Attributes: model (drifttool's ``MMDiT`` on the
    transformer's parameters), rt (the runtime every call runs under), calls (forwards run),
    lora_mode (the LoRA mode the adapter is bound in, ``LORA_MODES``; None without an unfused peft
    adapter), lora_fallback (None, or one line: why the default mode is not the layers' own)."""

    model: MMDiT
    rt: Runtime
    calls: int = 0
    lora_mode: str | None = None
    lora_fallback: str | None = None


def strict_model_of(transformer: torch.nn.Module, family: str = "strict",
                    lora_mode: str | None = None) -> MMDiT:
    """drifttool's ``MMDiT`` on ``transformer``'s own parameter tensors (module docstring), with a
    peft adapter's factors as its LoRA factors, in ``lora_mode`` or the default mode for ``family``
    (module docstring; ``drifttool.model.lora.lora_mode(model)`` reads it back).

    Raises:
        DriftToolError: not a QwenImage transformer (its parameters do not match the config's model).
        UnsupportedConfigError: several or inactive peft adapters, or layers in different modes;
            a ``lora_mode`` unknown or refused (module docstring).
    """
    return _strict_model(transformer, family, lora_mode)[0]


def _strict_model(transformer: torch.nn.Module, family: str,
                  lora_mode: str | None) -> tuple[MMDiT, str | None, str | None]:
    """(model, LoRA mode bound or None, fallback line or None) of ``strict_model_of``."""
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
    if lora_mode is not None:
        check_lora_mode(lora_mode)
    if lora is None or lora["mode"] == "fused":
        return model, None, None
    mode, fallback = _lora_mode(transformer, lora["mode"], family, lora_mode)
    _bind_adapter(model, transformer, mode)
    return model, mode, fallback


def _lora_mode(transformer: torch.nn.Module, own: str, family: str,
               requested: str | None) -> tuple[str, str | None]:
    """(mode, fallback) for the transformer's peft adapter, whose layers run ``own`` (``lora_of``,
    not fused): ``requested`` when given and runnable, else the default (module docstring);
    fallback is one line saying why the default is not ``own``, or None.

    Raises:
        UnsupportedConfigError: ``requested`` a mode the family does not run (strict: ``merged``,
            ``unfused-fp32``), or ``unfused-fp32`` with factors that are not all FP32 or (strict)
            an adapter outside the block GEMMs; each names the mode and what to pass instead.
    """
    layers = peft_layers(transformer)
    strict = family != "production"
    dtypes = sorted({str(f[a].weight.dtype).removeprefix("torch.") for m in layers.values()
                     for f in (m.lora_A, m.lora_B) for a in f})
    outside = strict_unfused_outside(layers) if strict else []
    why_not = None  # why unfused-fp32 cannot run here
    if dtypes != ["float32"]:
        why_not = f"its factors are {'/'.join(dtypes)}, not float32"
    elif outside:
        why_not = (f"it also targets {', '.join(outside[:3])}{' …' * (len(outside) > 3)} ({len(outside)} "
                   "modules outside the block GEMMs, where the strict family adds no unfused adapter)")
    if requested is not None:
        if strict and requested not in STRICT_MODES:
            raise UnsupportedConfigError(
                f"bind_strict: LoRA mode {requested!r} is production arithmetic; the {family} family binds "
                "lora_mode='merged' or 'unfused-fp32' (or bind under Runtime(mode='auto'))")
        if requested == "unfused-fp32" and why_not:
            raise UnsupportedConfigError(f"bind_strict: LoRA mode 'unfused-fp32' for peft's adapter: {why_not}; "
                                         "pass lora_mode='merged'")
        return requested, None
    if not strict or (own in STRICT_MODES and not why_not):
        return own, None
    if own not in STRICT_MODES:
        return "merged", (f"peft's layers run LoRA mode {own!r} (factors in the model dtype), which the "
                          f"{family} family does not run: bound 'merged'")
    return "merged", f"peft's layers run LoRA mode {own!r} but {why_not}: bound 'merged'"


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
def bind_strict(transformer: torch.nn.Module, rt: Runtime | None = None, *,
                lora_mode: str | None = None) -> Iterator[Bound]:
    """Inside the block, every forward of ``transformer`` is drifttool's MMDiT under ``rt``
    (default ``Runtime(mode="strict")``) on the transformer's parameters, a peft adapter bound in
    ``lora_mode`` (default: module docstring; ``bound.lora_mode``, ``bound.lora_fallback`` say
    what was bound). Afterwards the transformer's forward and hooks are as before, also after an
    error.

    Raises:
        DriftToolError, UnsupportedConfigError: as ``strict_model_of``; in a call, an argument of
            ``REFUSED`` set, or ``img_shapes`` drifttool cannot name (``image_grids_of``).
    """
    rt = rt or Runtime(mode=Mode.STRICT)
    model, mode, fallback = _strict_model(transformer, rt.family, lora_mode)
    bound = Bound(model=model, rt=rt, lora_mode=mode, lora_fallback=fallback)

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
