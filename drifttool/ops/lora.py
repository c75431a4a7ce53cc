"""``lora_merge``: the adapted weight ``W' = W + (α/r)·(B·A)`` of a LoRA target (not an RFC row).

    >>> w2 = call(rt, "lora_merge", w, lora_A, lora_B, alpha / r, stream="img", layout=None)

Declared here with its two families; ``drifttool.model.lora`` attaches adapters to the MMDiT and
calls this operator for every adapted weight (why merged, and why traced but not captured, is
written there). Contract ``drifttool.lora_merge.v1``.

* strict (device ``cpu``): ``B·A`` by ``strict_math.tiled_linear`` (exact products, pairwise
  tree over r), then ``fp32(W) + fp32(α/r)·(B·A)``; W' stays **FP32** (the strict GEMMs accept an
  FP32 weight with bf16 activations and round once at their output boundary), so a small update
  is never lost to a bf16 rounding of the weight. With ``B = 0`` (peft's init), W' = fp32(W) and
  every output is byte-equal to the model without the adapter.
* production (devices ``cpu``, ``cuda``): peft's merge arithmetic (``LoraLayer.merge``, what
  ``merge_and_unload`` and diffusers' ``fuse_lora`` run) for FP32 factors: ``delta = (B @ A) ·
  scale`` in FP32, then ``W += delta`` in place, i.e. ``(fp32(W) + delta).to(W.dtype)``, one
  rounding in bf16; what a rollout engine serving merged weights runs.
"""

from __future__ import annotations

import torch

from drifttool.ops.constraints import dtypes
from drifttool.ops.registry import OpSpec, declare, implements
from drifttool.ops.strict_math import tiled_linear

LORA_MERGE = declare(
    OpSpec(
        name="lora_merge",
        contract="drifttool.lora_merge.v1",
        differentiable=True,
        dtypes=(torch.float32, torch.bfloat16),
        summary="adapted weight W + (alpha/r)·(B·A) of a LoRA target (not an RFC row)",
    )
)


@implements("lora_merge", "strict", device="cpu", kernel="strict_linear(B,Aᵀ)+fp32_add",
            constraints=(dtypes(LORA_MERGE.dtypes, "w", "a", "b"),))
def lora_merge_strict(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W' = fp32(W) + fp32(scale)·tree_gemm(B, Aᵀ), FP32 result (module docstring).

    Args:
        w: [out, in] base weight (fp32 or bf16).  a: [r, in] fp32.  b: [out, r] fp32.
        scale: α / r (python float, rounded once to fp32).
    """
    bt = a.to(torch.float32).t().contiguous()  # [in, r]
    delta = tiled_linear(b.to(torch.float32), bt)  # [out, in], tree over r
    s = torch.tensor(float(scale), dtype=torch.float32, device=w.device)
    return w.to(torch.float32) + s * delta


@implements("lora_merge", "production", device=("cpu", "cuda"), kernel="peft.merge(torch.matmul)")
def lora_merge_production(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's merge for FP32 factors: ``W += (B @ A) * scale`` (computed in FP32, rounded once
    to W's dtype). w [out, in], a [r, in], b [out, r] → W' [out, in] in W's dtype."""
    return (w.to(torch.float32) + (b @ a) * float(scale)).to(w.dtype)
