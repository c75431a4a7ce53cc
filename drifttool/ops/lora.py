"""LoRA operators (not RFC rows): the adapted weight (merged, fused) or the adapter's per-token delta (unfused).

    >>> w2 = call(rt, "lora_merge", w, lora_A, lora_B, alpha / r, stream="img", layout=None)  # merged
    >>> w2 = call(rt, "lora_fuse", w, lora_A, lora_B, alpha / r, stream="img", layout=None)   # fused
    >>> d = call(rt, "lora_delta", x, lora_A, lora_B, alpha / r, stream="img", layout=None)   # unfused

Declared here with their families; ``drifttool.model.lora`` attaches adapters to the MMDiT and
``drifttool.model.lora_calls`` calls one of them per adapted weight, by the adapter's mode (``model.lora.LORA_MODES``; why merged
by default, and why traced but not captured, is written there). The three reproduce what the
libraries run (peft 0.21.2 ``tuners/lora/layer.py`` ``Linear.merge`` / ``get_delta_weight`` /
``forward``, diffusers 0.42.1 ``loaders/peft.py`` ``fuse_lora``):

* ``lora_merge`` (contract ``drifttool.lora_merge.v1``): peft's ``merge_and_unload`` of a
  ``PeftModel`` (factors FP32, peft's ``autocast_adapter_dtype``).

  - strict (device ``cpu``): ``B·A`` by ``strict_gemm.tiled_linear`` (exact products, pairwise
    tree over r), then ``fp32(W) + fp32(α/r)·(B·A)``; W' stays **FP32** (the strict GEMMs accept
    an FP32 weight with bf16 activations and round once at their output boundary), so a small
    update is never lost to a bf16 rounding of the weight. With ``B = 0`` (peft's init),
    W' = fp32(W) and every output is byte-equal to the model without the adapter.
  - production (devices ``cpu``, ``cuda``): ``peft_merge`` below.
* ``lora_fuse`` (contract ``drifttool.lora_fuse.v1``, production only): diffusers'
  ``pipe.fuse_lora()`` after ``pipe.load_lora_weights`` — peft's ``merge`` on the factors the
  loader left in the **model dtype** (``_move_adapter_to_device_of_base_layer``): ``peft_merge``.
* ``lora_delta`` (contract ``drifttool.lora_delta.v1``, production only): peft's unmerged
  ``Linear.forward`` adapter branch ``lora_B(lora_A(dropout(x))) · scaling`` with x cast to the
  factors' dtype (``_cast_input_dtype``; dropout is the identity in eval). The base operator adds
  it to its GEMM output before its epilogue as peft does: ``(result + delta).to(result.dtype)``.
  The strict family has no ``lora_delta``: in mode ``unfused-fp32`` its block GEMM operators take
  the FP32 factors (``lora=``, checked by ``lora_factors`` below) and add the branch in FP32
  inside (``drifttool.ops.strict.lora_linear``: x·Aᵀ, then ·Bᵀ, each by contract v2, times
  fp32(s), added once to the FP32 GEMM output before the epilogue, one cast), so W keeps its
  dtype — on the GPU a bf16 W runs on tensor cores where a merged FP32 W' cannot. The production
  block GEMMs accept the same ``lora`` (``add_branch``: an audit run's fallback).

``peft_merge`` (peft's ``get_delta_weight`` + unsafe ``merge``): factors of dtype D on device d;
on the CPU with D bf16/fp16, ``delta = ((fp32(B) @ fp32(A)) · s).to(D)``, else
``delta = (B @ A) · s`` in D; then ``W += delta`` in place, i.e. ``(W + delta)`` in the promoted
dtype rounded to W's dtype. FP32 factors: delta FP32, one rounding into bf16 W. bf16 factors:
delta rounded to bf16 (on CUDA the bf16 matmul's own rounding), then a bf16 add. A DoRA adapter
(``magnitude`` m ``[out]``) merges as peft's ``DoraLinearVariant.merge_unsafe``:
``W' = (m / ‖W + delta‖_row)·(W + delta)``, rounded to W's dtype (``peft_merge``); the strict
families refuse it (``model.lora_calls.adapted_weight``), and the unfused modes too (``model.lora_calls``: peft's DoRA branch rescales the
base GEMM's output without its bias, which the fused RFC operators do not expose).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drifttool.ops.constraints import Constraint, dtypes
from drifttool.ops.declaration import OpSpec
from drifttool.ops.registry import declare, implements
from drifttool.ops.strict_gemm import tiled_linear

DEVICES = ("cpu", "cuda")
PRODUCTION_ONLY = ("lora_fuse", "lora_delta")
"""Operators with no strict implementation: dispatched only in LoRA modes that
``model.lora.check_lora_mode`` admits for the production family, so a strict run never meets
them (``setting_checks.check_mode_device`` does not require them)."""

LORA_MERGE = declare(
    OpSpec(
        name="lora_merge",
        contract="drifttool.lora_merge.v1",
        differentiable=True,
        dtypes=(torch.float32, torch.bfloat16),
        summary="adapted weight W + (alpha/r)·(B·A) of a LoRA target, peft merge_and_unload (not an RFC row)",
    )
)
LORA_FUSE = declare(
    OpSpec(
        name="lora_fuse",
        contract="drifttool.lora_fuse.v1",
        differentiable=True,
        dtypes=(torch.float32, torch.bfloat16),
        summary="adapted weight of a LoRA target as diffusers' fuse_lora computes it (not an RFC row)",
    )
)
LORA_DELTA = declare(
    OpSpec(
        name="lora_delta",
        contract="drifttool.lora_delta.v1",
        differentiable=True,
        dtypes=(torch.float32, torch.bfloat16),
        summary="unmerged LoRA branch scale·B(A(x)) of peft's Linear.forward (not an RFC row)",
    )
)


@implements("lora_merge", "strict", device="cpu", kernel="strict_linear(B,Aᵀ)+fp32_add",
            constraints=(dtypes(LORA_MERGE.dtypes, "w", "a", "b"),))
def lora_merge_strict(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W' = fp32(W) + fp32(scale)·tree_gemm(B, Aᵀ), FP32 result (module docstring). No DoRA
    (``model.lora_calls.adapted_weight`` refuses it outside the production family).

    Args:
        w: [out, in] base weight (fp32 or bf16).  a: [r, in] fp32.  b: [out, r] fp32.
        scale: α / r (python float, rounded once to fp32).
    """
    bt = a.to(torch.float32).t().contiguous()  # [in, r]
    delta = tiled_linear(b.to(torch.float32), bt)  # [out, in], tree over r
    s = torch.tensor(float(scale), dtype=torch.float32, device=w.device)
    return w.to(torch.float32) + s * delta


def peft_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's ``get_delta_weight``: factors of dtype D on device d; on the CPU with D bf16/fp16,
    ``((fp32(B) @ fp32(A)) · s).to(D)``, else ``(B @ A) · s`` in D. a [r, in], b [out, r] →
    [out, in] in D."""
    half = b.dtype in (torch.float16, torch.bfloat16)
    cast = b.device.type == "cpu" and half  # peft: "some CPUs have slow bf16/fp16 matmuls"
    wa, wb = (a.float(), b.float()) if cast else (a, b)
    delta = (wb @ wa) * float(scale)  # [out, in]
    return delta.to(b.dtype) if cast else delta


def peft_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
               magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """peft's unsafe ``merge`` (module docstring), out of place. w [out, in] (W's dtype), a [r, in],
    b [out, r] (one dtype D) → W' [out, in] in W's dtype.

    LoRA: ``W += delta`` in place, i.e. ``(W + delta)`` in the promoted dtype rounded to W's.
    DoRA (``magnitude`` [out], peft ``DoraLinearVariant.merge_unsafe``): ``V = W + delta``
    (promoted dtype), ``n = ‖V‖₂`` per output row (``torch.linalg.norm(V, dim=1)`` in V's
    dtype; peft's ``get_weight_norm`` with scaling 1), ``W' = ((m / n)·V)`` rounded to W's dtype.
    """
    delta = peft_delta(a, b, scale)
    if magnitude is None:
        return (w + delta).to(w.dtype)  # in-place ``+=``: promoted add, rounded to W's dtype
    v = w + delta  # [out, in]
    norm = torch.linalg.norm(v, dim=1).to(v.dtype)  # [out]
    return ((magnitude / norm).view(-1, 1) * v).to(w.dtype)


@implements("lora_merge", "production", device=DEVICES, kernel="peft.merge(torch.matmul)")
def lora_merge_production(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                          magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """peft's merge (``peft_merge``, DoRA with ``magnitude`` [out]) of FP32 factors: the delta
    computed in FP32, rounded once to W's dtype. w [out, in], a [r, in], b [out, r] → W'
    [out, in] in W's dtype."""
    return peft_merge(w, a, b, scale, magnitude)


@implements("lora_fuse", "production", device=DEVICES, kernel="diffusers.fuse_lora(peft.merge)")
def lora_fuse_production(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                         magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' ``fuse_lora``: peft's merge (``peft_merge``, DoRA with ``magnitude`` [out]) of
    factors held in the model dtype. w [out, in], a [r, in], b [out, r] → W' [out, in] in W's
    dtype."""
    return peft_merge(w, a, b, scale, magnitude)


def peft_branch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's adapter branch: ``F.linear(F.linear(x.to(D), A), B) * scale`` in the factors'
    dtype D. x [..., in] → [..., out] in D (the base operator adds it, ``add_delta``)."""
    xd = x if x.dtype == a.dtype else x.to(a.dtype)  # peft _cast_input_dtype
    return F.linear(F.linear(xd, a), b) * scale  # [..., r] → [..., out]; scaling a python float


@implements("lora_delta", "production", device=DEVICES, kernel="peft.Linear.forward(lora_B(lora_A(x)))")
def lora_delta_production(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's adapter branch (``peft_branch``). x [..., in] → [..., out] in the factors' dtype."""
    return peft_branch(x, a, b, scale)


def add_delta(result: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """peft's ``result = result + delta`` then ``result.to(torch_result_dtype)``; ``None`` keeps
    ``result``. Used by the production GEMM operators before their epilogue."""
    if delta is None:
        return result
    return (result + delta).to(result.dtype)


def add_branch(result: torch.Tensor, x: torch.Tensor, lora: tuple | None) -> torch.Tensor:
    """``add_delta(result, peft_branch(x, *lora))``, or ``result`` when ``lora`` is None: the
    unfused adapter of a Linear whose input x exists only inside a production operator
    (``model.lora_calls.lora_branches``). x [..., in], result [..., out]."""
    return result if lora is None else add_delta(result, peft_branch(x, *lora))


# ---------------------------------------------------------------------------------------------
# the ``lora`` keyword of the strict block GEMM operators (LoRA mode unfused-fp32)


def _factor_problem(f: object, k: int, n: int, device: str) -> str | None:
    """Why ``f`` is not one projection's factors ``(A [r, k] FP32, B [n, r] FP32, s)`` on
    ``device``, or None."""
    if not (isinstance(f, tuple) and len(f) == 3):
        return f"lora must be (A, B, scale), got {type(f).__name__}"
    a, b, s = f
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2):
        return "lora factors A and B must be 2-D tensors"
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        return f"lora factors must be float32 (LoRA mode unfused-fp32), got A {a.dtype}, B {b.dtype}"
    if a.device.type != device or b.device.type != device:
        return f"lora factors on {a.device.type}/{b.device.type}, the operator's tensors on {device}"
    if a.shape[1] != k or b.shape[0] != n or a.shape[0] != b.shape[1]:
        return (f"lora factors A {list(a.shape)}, B {list(b.shape)} do not fit a GEMM [{n}, {k}] "
                "(A [r, in], B [out, r])")
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        return f"lora scale must be a python float, got {type(s).__name__}"
    return None


def adapter_given(lora) -> bool:
    """Whether a strict block GEMM's ``lora`` keyword carries an adapter: False for ``None`` and for
    ``qkv_bias_gemm``'s ``(None, None, None)``, True for anything else (whose form
    ``lora_factors`` checks)."""
    return lora is not None and not (isinstance(lora, tuple) and len(lora) == 3 and all(e is None for e in lora))


def lora_factors(x: str, *weights: str) -> Constraint:
    """The ``lora`` keyword of a strict GEMM operator with input ``x`` [..., K] and the weights
    ``weights`` ([N, K] each): ``None``, or for one weight ``(A [r, K], B [N, r], s)`` (FP32
    factors on x's device, s a python float), for several a tuple of one such entry or ``None``
    per weight (``qkv_bias_gemm``: q, k, v), as ``model.lora_calls.lora_branches`` builds them."""

    def test(args) -> str | None:
        lora, t = args.get("lora"), args[x]
        if lora is None:
            return None
        k, dev = t.shape[-1], t.device.type
        if len(weights) == 1:
            return _factor_problem(lora, k, args[weights[0]].shape[0], dev)
        if not (isinstance(lora, tuple) and len(lora) == len(weights)
                and all(f is None or isinstance(f, tuple) for f in lora)):
            return f"lora must be a tuple of {len(weights)} entries, (A, B, scale) or None each"
        for f, w in zip(lora, weights):
            why = None if f is None else _factor_problem(f, k, args[w].shape[0], dev)
            if why is not None:
                return f"{w}: {why}"
        return None

    return Constraint(f"lora factors (A, B, s) of {', '.join(weights)}", test, ("lora", x, *weights))

