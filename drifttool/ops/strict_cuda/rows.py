"""Strict CUDA row operators: latent_pack_unpack, latent_normalize, adaln_modulation,
adaln_gate_residual, qk_rmsnorm, multi_axis_rope, txt_in_rmsnorm_linear, final_adaln_out
(contract ``cuda1``; Triton kernels in ``kernels/latent.py``, ``elementwise.py`` and ``norms.py``).

Each does the strict CPU family's arithmetic (``drifttool.ops.strict``) in its order — elementwise
steps one IEEE FP32 operation each without FMA contraction, the norms' sums by the same pairwise
tree over the whole row, rstd in FP64 rounded once, SiLU in FP64 from exact operations — so these
bytes equal the CPU's. The two operators with a GEMM (``txt_in_rmsnorm_linear``,
``final_adaln_out``) call the strict CUDA GEMM (``kernels/gemm.py`` ``linear``) with an FP32 left
operand (the norm's output; ``silu32`` of temb), hence IEEE FP32 products, as the CPU computes its
GEMM in FP32; only that GEMM's K order (one sequential pass in 64-chunks) differs from the CPU's
contract-v2 segments.

Backward (``strict_cuda.row_backward``, contract ``qwenimage.<op>.grad.cuda1``) for
``adaln_modulation``, ``adaln_gate_residual``, ``qk_rmsnorm``, ``multi_axis_rope``,
``txt_in_rmsnorm_linear`` and ``final_adaln_out`` (to x and the projection's w and b; temb must not
require a gradient): each runs through a ``torch.autograd.Function`` whose forward is the
code here unchanged; the others are forward only (the family's constraint). Shapes are checked
as the CPU family checks them and fail closed in one line.
"""

from __future__ import annotations

import torch

from drifttool.capture import produced
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import Args, Constraint
from drifttool.ops.strict import act_dtype
from drifttool.ops.strict_cuda import row_backward as rb
from drifttool.ops.strict_cuda._register import strict_cuda
from drifttool.ops.strict_cuda.linear import KERNEL as GEMM_KERNEL

MAX_ROW = 16384
"""Longest normalised row a program holds (``kernels.rows.MAX_ROW``; d, Dj, Dh fit)."""



def _row_fits(name: str) -> Constraint:
    def test(args: Args) -> str | None:
        t = args[name]
        if t is not None and t.dim() and t.shape[-1] > MAX_ROW:
            return f"{name}'s last axis is {t.shape[-1]} > {MAX_ROW} (one program holds a whole row)"
        return None

    return Constraint(f"{name} rows of at most {MAX_ROW}", test, (name,))


def _gemm():
    """The strict CUDA GEMM module (``linear``; the interpreter tests put the CPU's GEMM in its place)."""
    from drifttool.ops.strict_cuda.kernels import gemm  # lazy: Triton is imported when a kernel runs
    return gemm


@strict_cuda("latent_pack_unpack", "t", kernel="triton.permute")
def latent_pack_unpack(t, direction: str = "pack", grid: tuple[int, int] | None = None):
    """Pack [B,C,H',W'] or [B,C,1,H',W'] → [B,N,4C]; unpack [B,N,4C] → [B,C,1,2h,2w] with
    ``grid=(h, w)``. A pure copy: bytes unchanged (``strict.latent``)."""
    from drifttool.ops.strict_cuda.kernels import latent  # lazy: Triton is imported when a kernel runs
    if direction == "pack":
        z = t
        if z.dim() == 5:
            if z.shape[2] != 1:
                raise UnsupportedConfigError(f"latent_pack_unpack: frame axis must be 1, got {z.shape[2]}")
            z = z[:, :, 0]
        if z.dim() != 4 or z.shape[-1] % 2 or z.shape[-2] % 2:
            raise UnsupportedConfigError(
                f"latent_pack_unpack: need [B,C,H',W'] with even H', W'; got {tuple(t.shape)}")
        return latent.pack(z)
    if direction == "unpack" and grid is not None:
        h, w = grid
        if t.dim() != 3 or t.shape[1] != h * w or t.shape[2] % 4:
            raise UnsupportedConfigError(f"latent_pack_unpack: {tuple(t.shape)} does not match grid {tuple(grid)}")
        return latent.unpack(t, (h, w))
    raise UnsupportedConfigError(f"latent_pack_unpack: bad direction/grid {direction!r}, {grid}")


@strict_cuda("latent_normalize", "z", kernel="triton.elementwise.nofma")
def latent_normalize(z, mean, std, inverse: bool = False):
    """Forward (z − mean)·(1/std), inverse z / (1/std) + mean, per channel (axis 1), FP32, one
    cast to z's dtype; z [B,C,...], mean/std [C]."""
    from drifttool.ops.strict_cuda.kernels import latent  # lazy: Triton is imported when a kernel runs
    if z.dim() < 2 or mean.numel() != z.shape[1] or std.numel() != z.shape[1]:
        raise UnsupportedConfigError(
            f"latent_normalize: mean/std of {mean.numel()}/{std.numel()} values for z {tuple(z.shape)}")
    return latent.normalize(z, mean, std, bool(inverse))


@strict_cuda("adaln_modulation", "x", "shift", "scale", kernel="triton.layernorm.pairtree",
             constraints=(_row_fits("x"),), trainable=True)
def adaln_modulation(x, shift, scale, eps: float = 1e-6):
    """LN(x)·(1 + scale) + shift; x [B,S,d], shift/scale [B,d] → [B,S,d] in x's dtype."""
    return rb.Modulation.apply(x, shift, scale, eps, _ln_modulation)


def _ln_modulation(x, shift, scale, eps):
    from drifttool.ops.strict_cuda.kernels import norms  # lazy: Triton is imported when a kernel runs
    return norms.ln_modulation(x, shift, scale, float(eps), act_dtype(x, shift, scale), digest=produced.wanted())


@strict_cuda("adaln_gate_residual", "x", "gate", "y", kernel="triton.elementwise.nofma", trainable=True)
def adaln_gate_residual(x, gate, y):
    """x + gate·y in FP32 (product rounded, then the sum), one cast; x, y [B,S,d], gate [B,d]."""
    return rb.GateResidual.apply(x, gate, y, _gate_residual)


def _gate_residual(x, gate, y):
    from drifttool.ops.strict_cuda.kernels import elementwise  # lazy: Triton is imported when a kernel runs
    return elementwise.gate_residual(x, gate, y, act_dtype(x, gate, y), digest=produced.wanted())


@strict_cuda("qk_rmsnorm", "x", "gain", kernel="triton.rmsnorm.pairtree", constraints=(_row_fits("x"),),
             trainable=True)
def qk_rmsnorm(x, gain, eps: float = 1e-6):
    """Learned-gain RMSNorm over the head dim: x [B,S,H,Dh], gain [Dh] → [B,S,H,Dh]."""
    return rb.QKNorm.apply(x, gain, eps, _qk_rmsnorm)


def _qk_rmsnorm(x, gain, eps):
    from drifttool.ops.strict_cuda.kernels import norms  # lazy: Triton is imported when a kernel runs
    return norms.rms_norm(x, gain, float(eps), act_dtype(x, gain), digest=produced.wanted())


@strict_cuda("multi_axis_rope", "x", kernel="triton.rope_interleaved.nofma", trainable=True)
def multi_axis_rope(x, freqs):
    """Rotate adjacent pairs: y0 = x0·c − x1·s, y1 = x0·s + x1·c in FP32 (separate roundings);
    x [B,S,H,Dh], freqs [S,Dh/2] complex64."""
    from drifttool.ops.strict_cuda.kernels import elementwise  # lazy: Triton is imported when a kernel runs
    if not freqs.is_complex() or tuple(freqs.shape) != (x.shape[1], x.shape[-1] // 2) or x.shape[-1] % 2:
        raise UnsupportedConfigError(
            f"multi_axis_rope: need a complex table [S, Dh/2] = {[x.shape[1], x.shape[-1] // 2]} for x "
            f"{tuple(x.shape)} (Dh even), got {freqs.dtype} {tuple(freqs.shape)}")
    return rb.Rope.apply(x, freqs, lambda x_, f_: elementwise.rope(x_, f_, digest=produced.wanted()))


@strict_cuda("txt_in_rmsnorm_linear", "e", "gain", "w", "b", kernel="triton.rmsnorm.pairtree+" + GEMM_KERNEL,
             constraints=(_row_fits("e"),), trainable=True)
def txt_in_rmsnorm_linear(e, gain, w, b, eps: float = 1e-6):
    """txt_in(RMSNorm_Dj(e)): e [B,L,Dj] → [B,L,d]. The norm's FP32 output feeds the GEMM as an
    FP32 operand (IEEE FP32 products with the weights widened exactly, no TF32), one cast at the end."""
    return rb.TxtIn.apply(e, gain, w, b, eps, _txt_in, _txt_norm)


def _txt_norm(e, gain, eps):
    from drifttool.ops.strict_cuda.kernels import norms  # lazy: Triton is imported when a kernel runs
    return norms.rms_norm(e, gain, float(eps), torch.float32)


def _txt_in(e, gain, w, b, eps):
    return _gemm().linear(_txt_norm(e, gain, eps), w, b, out_dtype=act_dtype(e, gain, w, b))


def _temb_no_grad(args: Args) -> str | None:
    t = args["temb"]
    if torch.is_grad_enabled() and t is not None and t.requires_grad:
        return ("temb requires a gradient: the strict CUDA backward of final_adaln_out stops at the "
                "projection's weights (the SiLU's derivative has no CUDA kernel; adaln_mod_projection "
                "and timestep_embed_mlp are forward only)")
    return None


@strict_cuda("final_adaln_out", "x", "temb", "w", "b", kernel="triton.layernorm.pairtree+" + GEMM_KERNEL,
             constraints=(_row_fits("x"), Constraint("temb without a gradient", _temb_no_grad, ("temb",))),
             trainable=True)
def final_adaln_out(x, temb, w, b, eps: float = 1e-6):
    """norm_out: (scale, shift) = split(SiLU(temb)·wᵀ + b), scale first; LN(x)·(1 + scale) + shift;
    x [B,N,d], temb [B,d], w [2d,d], b [2d] → [B,N,d]. SiLU FP64 from exact operations (as the
    CPU's ``silu32``, ``kernels.embed.silu32``), the GEMM with an FP32 left operand, the modulation in FP32, one cast."""
    return rb.FinalAdaLN.apply(x, temb, w, b, eps, act_dtype(x, temb, w, b), _final_emb, _final_modulation, _silu32)


def _silu32(temb):
    from drifttool.ops.strict_cuda.kernels import embed  # lazy: Triton is imported when a kernel runs
    return embed.silu32(temb)


def _final_emb(temb, w, b):
    """[B, 2d] FP32: SiLU(temb)·wᵀ + b, (scale, shift)."""
    return _gemm().linear(_silu32(temb), w, b, out_dtype=torch.float32)


def _final_modulation(x, emb, eps, dt):
    from drifttool.ops.strict_cuda.kernels import norms  # lazy: Triton is imported when a kernel runs
    d = emb.shape[-1] // 2
    return norms.ln_modulation(x, emb[:, d:], emb[:, :d], float(eps), dt)
