"""LoRA adapters on the MMDiT, applied through a named operator, interchangeable with peft/diffusers.

    >>> add_lora(model, rank=4, alpha=8)                 # Flow-GRPO's targets, base frozen
    >>> v = model(x, txt, mask, tau, grid, rt)            # every adapted weight goes through
    ...                                                   # call(rt, "lora_merge", ...)
    >>> remove_lora(model)                                # detached again

Saving, loading, the adapter's digest and manifest record and its gradient records are
``drifttool.model.lora_io``'s.

Targets: every Linear of the model (``adaptable_modules``, diffusers' names). ``add_lora``'s
default is ``LORA_TARGET_MODULES`` (numerics §4.1, Flow-GRPO's ``pickscore_qwenimage``):
``attn.to_q/to_k/to_v/to_out.0``, ``attn.add_q_proj/add_k_proj/add_v_proj/to_add_out`` and both
streams' MLP projections ``img_mlp.net.0.proj``, ``img_mlp.net.2``, ``txt_mlp.net.0.proj``,
``txt_mlp.net.2``, in every block; a loaded adapter may also adapt the modulation projections
``img_mod.1`` / ``txt_mod.1`` (``BLOCK_MODULES``), the embedders (``INPUT_MODULES``: the timestep
MLP's ``linear_1`` / ``linear_2``, ``txt_in``, ``img_in``) and the final Linears
(``OUTPUT_MODULES``: ``norm_out.linear``, ``proj_out``), as peft's ``all-linear`` does. Each
adapted ``Linear`` gets two sub-modules, ``lora_A`` (weight ``[r, in]``) and ``lora_B`` (weight
``[out, r]``), plus, for DoRA, the parameter ``lora_magnitude_vector`` ``[out]``, so
``model.named_parameters()`` yields
exactly peft's names: ``transformer_blocks.0.attn.to_q.lora_A.weight`` … (what
``peft.get_peft_model_state_dict`` returns for a diffusers ``QwenImageTransformer2DModel`` with
``add_adapter``). Each module's scale is peft's: ``lora_alpha / r``, or ``lora_alpha / √r`` with
``use_rslora``, per module through ``rank_pattern`` / ``alpha_pattern`` (``lora_formats``, which
also lists the file layouts and the refused configs). Adapter weights are FP32 whatever the
model dtype (peft's ``autocast_adapter_dtype`` default in ``PeftModel.from_pretrained``).

How an attached adapter enters the operator calls (``lora_merge`` / ``lora_fuse`` of the weight,
or the unfused branch; why merged by default) is ``drifttool.model.lora_calls``'s.

Modes (``LORA_MODES``, ``lora_io.load_lora(mode=)``, ``drifttool run --lora-mode``): how the libraries
run a loaded adapter differs in bytes, so each is reproduced (production family; the strict
family runs ``STRICT_MODES``, ``merged`` and ``unfused-fp32``, its own way; arithmetic in
``drifttool.ops.lora``):

================  ==========================================  ================  ==================
mode              reproduces                                  factors held in   operator (trace)
================  ==========================================  ================  ==================
``merged``        peft ``PeftModel.from_pretrained`` +        FP32              ``lora_merge``
                  ``merge_and_unload``
``fused``         diffusers ``pipe.load_lora_weights`` +      model dtype       ``lora_fuse``
                  ``pipe.fuse_lora()``
``unfused``       diffusers ``pipe.load_lora_weights`` (peft  model dtype       ``lora_delta``
                  LoRA layers active, the default)
``unfused-fp32``  a peft-wrapped transformer (``get_peft_     FP32              ``lora_delta``;
                  model`` / ``PeftModel``: the factors are                      strict: none (the
                  autocast to FP32), e.g. Flow-GRPO                             block GEMMs)
================  ==========================================  ================  ==================

Unfused, the base operator keeps W and adds the adapter branch ``s·B(A(x))`` to its GEMM output
before its epilogue (production: ``lora_delta`` in the factors' dtype, as peft; strict
``unfused-fp32``: inside the four block GEMM operators, in FP32, so W keeps its dtype — on the
GPU a bf16 W runs on tensor cores where merged needs the FP32 GEMM of an FP32 W'; the same math
as merged, rounded differently; an adapter outside the block GEMMs runs strict only merged):
``model.lora_calls``, docs/strict-arithmetic.md "Unfused LoRA (strict)".

DoRA (``use_dora``) runs merged or fused, as peft merges it (``ops.lora.peft_merge``: W' =
(m / ‖W + s·B·A‖_row)·(W + s·B·A)), production family only. Unfused DoRA is refused (peft's
branch rescales the base GEMM's output without its bias, which the fused RFC operators do not
expose), and so is DoRA under the strict family (no declared strict row norm).
The operator and its implementations are declared in
``drifttool.ops.lora`` (registered by importing ``drifttool.ops``).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.lora_formats import (  # noqa: F401  (the module names, re-exported)
    ALL_LINEAR,
    BLOCK_MODULES,
    INPUT_MODULES,
    LORA_TARGET_MODULES,
    OUTPUT_MODULES,
    AdapterConfig,
)

LORA_MODES = ("merged", "fused", "unfused", "unfused-fp32")
"""How a loaded adapter runs (module docstring table)."""
UNFUSED_MODES = ("unfused", "unfused-fp32")
FP32_FACTOR_MODES = ("merged", "unfused-fp32")


STRICT_MODES = ("merged", "unfused-fp32")
"""The modes a family other than production runs (its own arithmetic for each: module docstring)."""


def check_lora_mode(mode: str, family: str | None = None) -> str:
    """``mode`` if it is one of ``LORA_MODES`` (and runs under ``family``: a family other than
    production runs ``STRICT_MODES`` only; the others are production arithmetic).

    Raises:
        UnsupportedConfigError: unknown mode, or a mode outside ``STRICT_MODES`` under a family
            other than production.
    """
    if mode not in LORA_MODES:
        raise UnsupportedConfigError(f"unknown LoRA mode {mode!r} (one of {', '.join(LORA_MODES)})")
    if family is not None and family != "production" and mode not in STRICT_MODES:
        raise UnsupportedConfigError(
            f"LoRA mode {mode!r} reproduces peft/diffusers' production arithmetic (factors in the model "
            f"dtype): the {family} family runs LoRA modes 'merged' and 'unfused-fp32'; use --mode auto or off")
    return mode


# ---------------------------------------------------------------------------------------------
# modules


class LoRAFactor(nn.Module):
    """``lora_A`` ([r, in]) or ``lora_B`` ([out, r]): a bias-free weight, as peft's ``nn.Linear``."""

    def __init__(self, out_features: int, in_features: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype, device=device))


FACTOR_NAMES = ("lora_A", "lora_B", "lora_magnitude_vector")
"""The adapter's parameter names on an adapted module (the last one for DoRA only)."""


def _module(root: nn.Module, name: str) -> nn.Module:
    m = root
    for part in name.split("."):
        m = m[part] if isinstance(m, nn.ModuleDict) else getattr(m, part)
    return m


def adaptable_modules(model) -> list[str]:
    """Every Linear's module name in forward order: ``INPUT_MODULES``, each block's
    ``BLOCK_MODULES``, ``OUTPUT_MODULES`` (diffusers' names)."""
    blocks = [f"transformer_blocks.{i}.{t}" for i in range(len(model.transformer_blocks)) for t in BLOCK_MODULES]
    return [*INPUT_MODULES, *blocks, *OUTPUT_MODULES]


def lora_modules(model) -> dict[str, nn.Module]:
    """``{module name: Linear}`` of every adapted module, in ``adaptable_modules`` order."""
    out = {}
    for name in adaptable_modules(model):
        m = _module(model, name)
        if getattr(m, "lora_A", None) is not None:
            out[name] = m
    return out


def has_lora(model) -> bool:
    return getattr(model, "lora_config", None) is not None


def attach_lora(model, cfg: AdapterConfig, *, seed: int = 0, init_b_std: float = 0.0,
                freeze_base: bool = True, mode: str = "merged", init: bool = True) -> dict[str, nn.Parameter]:
    """Attach a fresh adapter to every module ``cfg`` targets (peft's matching, ``all-linear``
    included; per-module rank and scale from ``rank_pattern`` / ``alpha_pattern`` /
    ``use_rslora``, ``lora_formats``).

    Init (deterministic, CPU fp32 generator, ``adaptable_modules`` order):
    ``lora_A`` ~ U(−1/√in, 1/√in) (peft's kaiming-uniform with a = √5 gives this bound),
    ``lora_B`` = 0 (peft's default) or N(0, init_b_std²) when ``init_b_std > 0``; with
    ``cfg.use_dora`` the magnitude vector ``[out]`` is the row norm of ``W + scale·B·A`` (peft's
    ``DoraLinearLayer.update_layer``).

    Args:
        freeze_base: set ``requires_grad=False`` on every non-adapter parameter.
        mode: one of ``LORA_MODES``; the factors are FP32 for ``merged`` / ``unfused-fp32``,
            else the adapted weight's dtype (as diffusers' loader leaves them).
        init: draw the init above (a meta model's factors are then made on the CPU); ``False``
            leaves the factors zero, for values loaded next, on the adapted weight's device (a
            meta model's on ``meta``: ``load_checkpoint(lora=)`` streams them in).

    Returns:
        The adapter parameters by peft key name.

    Raises:
        CheckpointError: an adapter already attached; ``cfg`` selects a module that is not one
            of the model's Linears (named), or no module at all.
        UnsupportedConfigError: DoRA in an unfused mode (its branch needs the base GEMM's
            output without bias, which the fused RFC operators do not expose).
    """
    if has_lora(model):
        raise CheckpointError("the model already carries a LoRA adapter")
    check_lora_mode(mode)
    if cfg.use_dora and mode in UNFUSED_MODES:
        raise UnsupportedConfigError(f"DoRA in LoRA mode {mode!r}: use --lora-mode merged or fused")
    adaptable = adaptable_modules(model)
    linears = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
               and m.weight.dim() == 2 and n.rsplit(".", 1)[-1] not in FACTOR_NAMES]
    unsupported = [n for n in linears if n not in adaptable and cfg.targets(n)]
    chosen = [n for n in adaptable if cfg.targets(n)]
    if unsupported or not chosen:
        raise CheckpointError(f"unsupported LoRA target_modules {cfg.target_modules!r}: "
                              + (f"selects {', '.join(unsupported[:6])} (not a Linear of the MMDiT)"
                                 if unsupported else "selects no module of the MMDiT"))
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    for name in chosen:
        m = model.get_submodule(name)
        rank, _ = cfg.rank_alpha(name)
        out_f, in_f = m.weight.shape
        dev = m.weight.device if m.weight.device.type != "meta" or not init else "cpu"
        fdt = torch.float32 if mode in FP32_FACTOR_MODES else m.weight.dtype
        m.lora_A = LoRAFactor(rank, in_f, dtype=fdt, device=dev)
        m.lora_B = LoRAFactor(out_f, rank, dtype=fdt, device=dev)
        bound = 1.0 / math.sqrt(in_f)
        with torch.no_grad():
            if init:
                m.lora_A.weight.copy_((torch.rand(rank, in_f, generator=g) * 2 - 1) * bound)
            if init and init_b_std > 0:
                m.lora_B.weight.copy_(torch.randn(out_f, rank, generator=g) * init_b_std)
        m.lora_scale = cfg.scale(name)
        m.lora_mode = mode
        m.lora_name = name
        if cfg.use_dora:
            m.lora_magnitude_vector = nn.Parameter(torch.zeros(out_f, dtype=fdt, device=dev))
            if init and m.weight.device.type != "meta":
                with torch.no_grad():
                    w = m.weight.to(fdt) + m.lora_scale * (m.lora_B.weight @ m.lora_A.weight)
                    m.lora_magnitude_vector.copy_(torch.linalg.norm(w, dim=1))
    model.lora_config = cfg
    if freeze_base:
        for name, p in model.named_parameters():
            p.requires_grad_(is_adapter_parameter(name))
    return lora_parameters(model)


def is_adapter_parameter(name: str) -> bool:
    """True for ``….lora_A.weight``, ``….lora_B.weight`` and ``….lora_magnitude_vector``."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith(".lora_magnitude_vector")


def add_lora(
    model,
    *,
    rank: int,
    alpha: float,
    targets: Iterable[str] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    init_b_std: float = 0.0,
    freeze_base: bool = True,
    mode: str = "merged",
) -> dict[str, nn.Parameter]:
    """Attach a fresh adapter (rank ``rank``, scale α/r, or α/√r with ``use_rslora``) to
    ``targets`` (default all of ``LORA_TARGET_MODULES``; also ``img_mod.1`` / ``txt_mod.1`` and
    the model-level ``INPUT_MODULES`` / ``OUTPUT_MODULES``) of every block, running in LoRA mode
    ``mode``; init as ``attach_lora``.

    Raises:
        CheckpointError: rank < 1, non-finite alpha, an unknown target, or an adapter already
            attached.
        UnsupportedConfigError: an unknown mode.
    """
    targets = tuple(LORA_TARGET_MODULES if targets is None else targets)
    known = (*BLOCK_MODULES, *INPUT_MODULES, *OUTPUT_MODULES)
    bad = sorted(set(targets) - set(known))
    why = ([f"rank must be >= 1, got {rank}"] * (int(rank) < 1)
           + [f"alpha must be a finite number, got {alpha}"] * (not math.isfinite(float(alpha)))
           + [f"unknown targets {bad} (known: {', '.join(known)})"] * bool(bad)
           + ["no target modules"] * (not targets))
    if why:
        raise CheckpointError("bad LoRA config: " + "; ".join(why))
    cfg = AdapterConfig(r=int(rank), lora_alpha=float(alpha), target_modules=tuple(sorted(targets)),
                        use_rslora=bool(use_rslora))
    return attach_lora(model, cfg, seed=seed, init_b_std=init_b_std, freeze_base=freeze_base, mode=mode)


def lora_parameters(model) -> dict[str, nn.Parameter]:
    """Adapter parameters by peft key name (``….lora_A.weight`` / ``….lora_B.weight`` /
    ``….lora_magnitude_vector``)."""
    return {n: p for n, p in model.named_parameters() if is_adapter_parameter(n)}


def base_parameters(model) -> dict[str, nn.Parameter]:
    """Every parameter that is not an adapter parameter."""
    return {n: p for n, p in model.named_parameters() if not is_adapter_parameter(n)}


def lora_scales(model) -> dict[str, float]:
    """``{module: scale}`` of every adapted module (the ``scale`` ``lora_merge`` receives)."""
    return {n: float(m.lora_scale) for n, m in lora_modules(model).items()}


def lora_mode(model) -> str | None:
    """The adapter's mode (``LORA_MODES``), or None without one."""
    mods = lora_modules(model)
    return next(iter(mods.values())).lora_mode if mods else None


def remove_lora(model) -> None:
    """Detach every adapter (the base parameters keep their ``requires_grad``)."""
    for m in lora_modules(model).values():
        del m.lora_A, m.lora_B, m.lora_scale, m.lora_mode, m.lora_name
        if getattr(m, "lora_magnitude_vector", None) is not None:
            del m.lora_magnitude_vector
    model.lora_config = None
