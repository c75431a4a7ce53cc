"""CFG combine + per-token renorm (``cfg_combine_renorm``, numerics §3.4, §5 trap 12): the strict
(FP32, pairwise-tree norms) and production (diffusers' expression) implementations.

    >>> v = call(rt, "cfg_combine_renorm", v_cond, v_uncond, 4.0, stream="img", layout="BS.")
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.constraints import require_dtype
from drifttool.ops.registry import implements
from drifttool.ops.specs import OPERATORS
from drifttool.ops.strict_math import sqrt32, tree_sum


def check_cfg_inputs(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> None:
    """The argument checks of every ``cfg_combine_renorm`` kernel.

    Raises:
        ValueError: shape mismatch, empty channel axis, non-finite or tensor scale.
    """
    if v_cond.shape != v_uncond.shape:
        raise ValueError(
            f"cfg_combine_renorm: v_cond {tuple(v_cond.shape)} and v_uncond "
            f"{tuple(v_uncond.shape)} differ"
        )
    if v_cond.dim() < 1 or v_cond.shape[-1] < 1:
        raise ValueError("cfg_combine_renorm: inputs need a non-empty channel axis")
    if isinstance(scale, torch.Tensor) or not math.isfinite(float(scale)):
        raise ValueError(f"cfg_combine_renorm: scale must be a finite python float, got {scale!r}")


def renorm_parts(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float):
    """(c, comb, ‖c‖, ‖comb‖, ratio, s) of the strict combine + renorm (FP32; c, comb [B, N, C], the
    norms and ratio [B, N], s 0-dim), in ``cfg_combine_renorm_strict``'s order. Plain torch FP32
    operations, one rounding each, and the pairwise tree: the same bytes on any device (the strict
    CUDA backward recomputes them with this function on the GPU)."""
    c = v_cond.to(torch.float32)
    u = v_uncond.to(torch.float32)
    s = torch.tensor(scale, dtype=torch.float32, device=c.device)
    comb = u + s * (c - u)  # [B, N, C]
    c_norm = sqrt32(tree_sum(c * c))  # [B, N]
    comb_norm = sqrt32(tree_sum(comb * comb))  # [B, N]
    return c, comb, c_norm, comb_norm, c_norm / comb_norm, s


def renorm_grads(gv: torch.Tensor, c, comb, c_norm, comb_norm, ratio, s) -> tuple[torch.Tensor, torch.Tensor]:
    """(dc, du) FP32 of the combine + renorm given dL/dv ``gv`` [B, N, C] and ``renorm_parts``
    (``_CFGRenorm``'s order; plain torch FP32 operations and the pairwise tree: device-independent
    bytes)."""
    g = gv.contiguous().to(torch.float32)
    t = tree_sum(g * comb)  # [B, N]
    k_comb = ((t * ratio) / comb_norm) / comb_norm
    k_c = (t / comb_norm) / c_norm
    dcomb = g * ratio.unsqueeze(-1) - comb * k_comb.unsqueeze(-1)
    dd = s * dcomb
    return dd + c * k_c.unsqueeze(-1), dcomb - dd


class _CFGRenorm(torch.autograd.Function):
    """Strict CFG combine + renorm with a fixed-order backward (all FP32, per token; the two
    channel sums are the pairwise tree over C):

    t = Σ_C g·comb; k_comb = ((t·ratio)/‖comb‖)/‖comb‖; k_c = (t/‖comb‖)/‖c‖;
    dcomb = g·ratio − comb·k_comb; dd = s·dcomb; dc = dd + c·k_c; du = dcomb − dd.
    """

    @staticmethod
    def forward(ctx, v_cond, v_uncond, scale):
        c, comb, c_norm, comb_norm, ratio, s = renorm_parts(v_cond, v_uncond, scale)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(c, comb, c_norm, comb_norm, ratio, s)
            ctx.dtypes = (v_cond.dtype, v_uncond.dtype)
        return comb * ratio.unsqueeze(-1)  # [B, N, C]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gv):
        dc, du = renorm_grads(gv, *ctx.saved_tensors)
        return dc.to(ctx.dtypes[0]), du.to(ctx.dtypes[1]), None


@implements("cfg_combine_renorm", "strict", kernel="torch.fp32.pairwise_tree_norm")
def cfg_combine_renorm_strict(
    v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float
) -> torch.Tensor:
    """CFG combine and per-token renorm, strict (numerics §3.4).

    Args:
        v_cond: [B, N, C] conditional velocity (fp32 or bf16; bf16 is upcast exactly).
        v_uncond: [B, N, C] unconditional (negative-prompt) velocity, same shape.
        scale: guidance scale s (python float; rounded once to fp32).

    Returns:
        v [B, N, C] fp32: comb = u + s·(c − u); v = comb · (‖c‖ / ‖comb‖), 2-norms per token over
        the last (channel) axis, no epsilon (‖comb‖ = 0 gives inf/NaN, propagated, not hidden).

    Arithmetic (fp32, one rounding per op, no FMA): d = c − u; comb = u + (s·d);
    ‖a‖ = sqrt32(tree_sum(a·a)) (FP64 sqrt rounded once) with the pairwise tree over the C channels; ratio = ‖c‖ / ‖comb‖;
    v = comb · ratio. Byte-invariant to batch size, batch position and token count. Backward: a
    fixed per-token order (``_CFGRenorm``), gradients cast once to the input dtypes.

    Raises:
        UnsupportedConfigError: a dtype other than fp32/bf16.
        ValueError: shape mismatch, empty channel axis, non-finite or tensor scale.
    """
    check_cfg_inputs(v_cond, v_uncond, scale)
    for what, t in (("v_cond", v_cond), ("v_uncond", v_uncond)):
        require_dtype("cfg_combine_renorm", what, t, OPERATORS["cfg_combine_renorm"].dtypes)
    return _CFGRenorm.apply(v_cond, v_uncond, float(scale))


@implements("cfg_combine_renorm", "production", device=("cpu", "cuda"), kernel="torch.native.norm")
def cfg_combine_renorm_production(
    v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float
) -> torch.Tensor:
    """CFG combine and per-token renorm as diffusers' QwenImagePipeline writes it (numerics §3.4).

    Same meaning as ``cfg_combine_renorm_strict`` but computed in the input dtype with
    ``torch.norm(dim=-1, keepdim=True)``; returns the input dtype (bf16 in a bf16 pipeline).
    """
    check_cfg_inputs(v_cond, v_uncond, scale)
    comb = v_uncond + float(scale) * (v_cond - v_uncond)
    cond_norm = torch.norm(v_cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)

