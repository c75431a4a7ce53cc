"""How an attached LoRA adapter (``drifttool.model.lora``) enters the operator calls of the MMDiT.

    >>> w = adapted_weight(module, rt, "img")          # W, or lora_merge / lora_fuse of it
    >>> call(rt, "mlp_down_gemm", h, w, module.bias, **gemm_lora(h, rt, "img", module), ...)

Merged (the default), and why: the fused RFC operators
(``qkv_bias_gemm`` returns heads, ``mlp_up_gemm_gelu`` applies GELU after the GEMM) leave no place
to add a per-token delta ``(α/r)·B·A·x`` before their epilogue. So the adapted weight
``W' = W + (α/r)·(B·A)`` is computed by the named operator ``lora_merge`` (contract
``drifttool.lora_merge.v1``, dispatched by ``registry.call`` like every operator and listed in the
operator trace as op ``lora_merge``, stream img/txt, once per target and forward) and handed to the
unchanged base operator, whose call-site identity does not change. Its output is traced but not
captured: it has no sample axis, and a trainer that micro-batches runs it once per micro-batch,
so its records would not align with the rollout's; the adapter bytes are pinned instead by the
fingerprint's weight digest and the manifest's ``lora.digest``, a differing adapter shows as the
first drift at the base operator that consumes it, and the adapter gradients are captured
(role ``grad_weight``, ``lora_io.capture_lora_grads``). Gradients reach ``lora_A``/``lora_B``
through the base operator's weight gradient: ``dA = (α/r)·Bᵀ·dW'``, ``dB = (α/r)·dW'·Aᵀ``.

Unfused, the base operator keeps W and receives the adapter branch ``lora_delta`` (``scale ·
B(A(x))`` in the factors' dtype) as its ``delta``/``deltas`` argument, added to its GEMM output
before its epilogue (GELU, the head split) exactly as peft's ``Linear.forward`` adds it. Where
the Linear's input exists only inside the operator (SiLU(temb) of ``adaln_mod_projection`` and
``final_adaln_out``, the RMSNorm of ``txt_in_rmsnorm_linear``, the sinusoid and SiLU of
``timestep_embed_mlp``), the operator receives the factors instead (``lora=``,
``lora_branches``) and adds the same branch (``ops.lora.peft_branch``) to that GEMM; these
branches are not traced as separate ``lora_delta`` calls.

Strict ``unfused-fp32`` (``gemm_lora``): the four block GEMM operators (``qkv_bias_gemm``,
``attn_out_bias_gemm``, ``mlp_up_gemm_gelu``, ``mlp_down_gemm``) receive the FP32 factors
(``lora=(A, B, s)``, one per q/k/v for ``qkv_bias_gemm``) and add ``fp32(s)·((x·Aᵀ)·Bᵀ)`` to
their FP32 GEMM output before the epilogue (``drifttool.ops.strict.lora_linear``;
docs/strict-arithmetic.md, "Unfused LoRA (strict)"). Why: merged keeps W' in FP32, so every
adapted projection runs the FP32 GEMM; unfused keeps W in its dtype (on the GPU a bf16 W runs on
tensor cores) and computes only the rank-r branch in FP32. The same math as merged, rounded
differently (within the tolerance profile of each other, not byte-equal); with B = 0 the bytes of
the model without an adapter. dA and dB are per-sample reductions like a weight gradient, and
the gradient ledger takes them as its atoms (``GradLedger.watch_factors``). An unfused adapter on
any other Linear (``img_in``, ``proj_out``, ``txt_in``, the modulation projections, the
timestep MLP, ``norm_out.linear``) is refused under strict, naming the module: those run strict
only merged. ``unfused`` (factors in the model dtype) stays production arithmetic.

Every function takes the module(s) and the call's runtime ``rt`` (its family and gradient
ledger) and returns what the call site passes on; none changes a call-site identity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from drifttool.errors import UnsupportedConfigError
from drifttool.model.lora import LORA_TARGET_MODULES, UNFUSED_MODES, check_lora_mode, has_lora, lora_mode
from drifttool.ops.registry import call


def adapted_weight(module: nn.Module, rt, stream: str) -> torch.Tensor:
    """The weight the base operator receives: ``module.weight`` (no adapter, or an unfused one),
    or ``lora_merge`` / ``lora_fuse`` of it by the adapter's mode (called by ``MMDiT`` inside
    the block scope); a DoRA module passes its magnitude vector as ``magnitude``.

    Raises:
        UnsupportedConfigError: a DoRA module under a family other than production.
    """
    a = getattr(module, "lora_A", None)
    if a is None or module.lora_mode in UNFUSED_MODES:
        return module.weight
    op = "lora_fuse" if module.lora_mode == "fused" else "lora_merge"
    m = getattr(module, "lora_magnitude_vector", None)
    if m is not None and rt.mode.family != "production":
        raise UnsupportedConfigError(f"DoRA adapters under the {rt.mode.family} family (strict arithmetic has "
                                     "no declared row norm); use --mode auto or off")
    merged = call(rt, op, module.weight, a.weight, module.lora_B.weight, float(module.lora_scale),
                  **({} if m is None else {"magnitude": m}), stream=stream, layout=None)
    if rt.grad_ledger is not None:  # strict training: gradients by the canonical reduction
        rt.grad_ledger.watch(module, merged, rt.current_scope(), stream)
    return merged


def _unfused(module: nn.Module, rt) -> bool:
    """True when ``module`` carries an adapter in an unfused mode that can run here.

    Raises:
        UnsupportedConfigError: under a TP/SP plan (the branch is not sharded), or a DoRA module
            (its branch needs the base GEMM's output without bias, which the fused RFC operators
            do not expose). CFG-parallel ranks run whole branches: allowed.
    """
    if getattr(module, "lora_A", None) is None or module.lora_mode not in UNFUSED_MODES:
        return False
    if getattr(module, "lora_magnitude_vector", None) is not None:
        raise UnsupportedConfigError(f"DoRA in LoRA mode {module.lora_mode!r}: use --lora-mode merged or fused")
    check_mode_layout(module.lora_mode, getattr(getattr(rt, "plan", None), "dims", None))
    return True


def check_mode_layout(mode: str | None, dims) -> None:
    """Refuse an adapter's LoRA ``mode`` (``model.lora.LORA_MODES``, None without an adapter) under
    the layout ``dims`` (``distributed.plan.ParallelDims`` or None: one device) from the settings
    alone: an unfused mode under TP or SP > 1 (the branch s·B(A(x)) is not sharded over the ranks'
    heads, channels or rows). CFG-parallel ranks run whole branches: allowed. The CLI calls it
    before any rank starts (``cli._layout.check_layout``), the runs when their plan is built.

    Raises:
        UnsupportedConfigError: naming the mode, the degrees and ``--lora-mode merged``.
    """
    if mode in UNFUSED_MODES and dims is not None and (dims.tp > 1 or dims.sp > 1):
        raise UnsupportedConfigError(
            f"LoRA mode {mode!r} under TP/SP (--tp {dims.tp} --sp {dims.sp}): the unfused adapter "
            "branch is not sharded over the ranks: use --tp 1 --sp 1, or run the adapter in --lora-mode "
            "merged")


def check_unfused_layout(model, dims) -> None:
    """Refuse, before a run's artifact opens, an adapter in an unfused mode under a TP/SP layout
    (``dims``: ``distributed.plan.ParallelDims`` or None), as its first call would.

    Raises:
        UnsupportedConfigError: naming the mode and ``--lora-mode merged``.
    """
    if dims is None or not has_lora(model):  # one device, or a model without an adapter (a peer)
        return
    check_mode_layout(lora_mode(model), dims)


def strict_unfused_outside(names) -> list[str]:
    """The module names among ``names`` (drifttool's, = diffusers') on which the strict family
    cannot run an unfused adapter: every Linear but the block GEMMs' (``transformer_blocks.{i}.``
    + ``LORA_TARGET_MODULES``), in the given order. ``_production_unfused`` refuses these at their
    first call; this names them before any call."""
    return [n for n in names if not (n.startswith("transformer_blocks.")
                                     and n.split(".", 2)[-1] in LORA_TARGET_MODULES)]


def _production_unfused(module: nn.Module, rt) -> bool:
    """``_unfused`` for a call site whose operator takes the branch the production way only
    (``lora_delta``, or the factors of an inner-input operator).

    Raises:
        UnsupportedConfigError: as ``_unfused``; or an unfused adapter on this module under a
            family other than production (strict runs ``unfused-fp32`` only on the block GEMMs'
            Linears, ``LORA_TARGET_MODULES``, through ``gemm_lora``), naming the module.
    """
    if not _unfused(module, rt):
        return False
    if rt.family == "production":
        return True
    raise UnsupportedConfigError(
        f"LoRA mode {module.lora_mode!r} under the {rt.family} family on {module.lora_name}: the strict "
        "family adds an unfused adapter only inside the block GEMMs (attention q/k/v/out and MLP "
        "projections); use --lora-mode merged for an adapter on this module")


def lora_delta(module: nn.Module, x: torch.Tensor, rt, stream: str) -> torch.Tensor | None:
    """The unfused adapter branch ``lora_delta(x)`` ``[B, S, out]`` of ``module`` for its input x
    ``[B, S, in]``, or None (no adapter, or a merged/fused one). Production family only.

    Raises:
        UnsupportedConfigError: as ``_production_unfused`` (TP/SP, DoRA, a strict family).
    """
    if not _production_unfused(module, rt):
        return None
    return call(rt, "lora_delta", x, module.lora_A.weight, module.lora_B.weight, float(module.lora_scale),
                stream=stream, layout=None)


def lora_deltas(x: torch.Tensor, rt, stream: str, *modules: nn.Module) -> dict[str, Any]:
    """The base operator's keyword arguments for the unfused branches of ``modules`` (all fed x):
    ``{}`` when none is unfused, ``{"delta": d}`` for one module, ``{"deltas": (dq, dk, dv)}``
    for three (``qkv_bias_gemm``)."""
    ds = tuple(lora_delta(m, x, rt, stream) for m in modules)
    if all(d is None for d in ds):
        return {}
    return {"deltas": ds} if len(ds) > 1 else {"delta": ds[0]}


def _strict_factors(module: nn.Module, rt, stream: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(lora_A [r, in], lora_B [out, r], scale)`` of an unfused ``module`` for a strict block
    GEMM, or None (no adapter, or a merged one). Under a gradient ledger (strict training) the
    factors are per-call copies whose per-sample gradients go to the ledger (``GradLedger.
    watch_factors``), as a merged weight's do.

    Raises:
        UnsupportedConfigError: as ``_unfused``; a mode outside ``STRICT_MODES``.
    """
    if not _unfused(module, rt):
        return None
    check_lora_mode(module.lora_mode, rt.family)
    a, b = module.lora_A.weight, module.lora_B.weight
    if rt.grad_ledger is not None:
        a, b = rt.grad_ledger.watch_factors(module, a, b, rt.current_scope(), stream)
    return a, b, float(module.lora_scale)


def gemm_lora(x: torch.Tensor, rt, stream: str, *modules: nn.Module) -> dict[str, Any]:
    """The adapter keywords of a block GEMM operator whose Linears ``modules`` are all fed x
    (one, or q, k, v for ``qkv_bias_gemm``): ``{}`` when none is unfused; production the
    ``lora_delta`` branches (``lora_deltas``: ``delta``/``deltas``); any other family the
    factors, ``lora=(A, B, s)`` for one module and a tuple of such entries (or None) for three
    (``ops.strict.lora_linear`` adds the branch in FP32).

    Raises:
        UnsupportedConfigError: as ``_unfused``; under a strict family a mode outside
            ``STRICT_MODES``.
    """
    if rt.family == "production":
        return lora_deltas(x, rt, stream, *modules)
    fs = tuple(_strict_factors(m, rt, stream) for m in modules)
    if all(f is None for f in fs):
        return {}
    return {"lora": fs if len(fs) > 1 else fs[0]}


def lora_branches(rt, *modules: nn.Module) -> dict[str, Any]:
    """The keyword argument ``lora`` of an operator whose Linear inputs exist only inside it
    (``adaln_mod_projection``, ``final_adaln_out``: SiLU(temb); ``txt_in_rmsnorm_linear``: the
    RMSNorm; ``timestep_embed_mlp``: the sinusoid and SiLU(linear_1)): per module ``None`` or
    its factors ``(lora_A [r, in], lora_B [out, r], scale)``, which the production operator runs
    as ``lora_delta`` runs them (``ops.lora.peft_branch``) on the Linear's input; ``{}`` when no
    module is unfused. One module gives ``lora=(A, B, s)``, several a tuple of them.

    Raises:
        UnsupportedConfigError: as ``_production_unfused`` (TP/SP, DoRA, a strict family).
    """
    fs = tuple((m.lora_A.weight, m.lora_B.weight, float(m.lora_scale)) if _production_unfused(m, rt) else None
               for m in modules)
    if all(f is None for f in fs):
        return {}
    return {"lora": fs if len(fs) > 1 else fs[0]}
