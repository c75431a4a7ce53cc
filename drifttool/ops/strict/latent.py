"""Strict latent operators: latent_pack_unpack (pure permutation), latent_normalize
(numerics §3.2, §3.5). Both are exact, so strict and production agree byte for byte.

Backward (``torch.autograd.Function``): pack and unpack are each other's gradient (the inverse
permutation, exact, dtype kept); latent_normalize: dz = dy·(1/std) forward, dz = dy/(1/std)
inverse, one FP32 operation per element with the forward's FP32 1/std, cast once to z's dtype.
The VAE statistics mean/std are constants of the contract and get no gradient.
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict._checks import act_dtype, strict_cpu


def pack(z: torch.Tensor) -> torch.Tensor:
    """[B,C,H',W'] or [B,C,1,H',W'] → [B,(H'/2)(W'/2),4C]; channel index c·4 + dy·2 + dx."""
    if z.dim() == 5:
        if z.shape[2] != 1:
            raise UnsupportedConfigError(f"latent_pack_unpack: frame axis must be 1, got {z.shape[2]}")
        z = z[:, :, 0]
    if z.dim() != 4 or z.shape[-1] % 2 or z.shape[-2] % 2:
        raise UnsupportedConfigError(f"latent_pack_unpack: need [B,C,H',W'] with even H', W'; got {tuple(z.shape)}")
    b, c, hh, ww = z.shape
    x = z.reshape(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [B,h,w,C,2,2]
    return x.reshape(b, (hh // 2) * (ww // 2), c * 4)


def unpack(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[B,h·w,4C] → [B,C,1,2h,2w], the exact inverse of ``pack``."""
    h, w = grid
    b, n, c4 = x.shape
    if n != h * w or c4 % 4:
        raise UnsupportedConfigError(f"latent_pack_unpack: {tuple(x.shape)} does not match grid {grid}")
    z = x.reshape(b, h, w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # [B,C,h,2,w,2]
    return z.reshape(b, c4 // 4, 1, 2 * h, 2 * w)


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        ctx.in_shape = z.shape
        return pack(z).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        shape = ctx.in_shape
        return unpack(g, (shape[-2] // 2, shape[-1] // 2)).reshape(shape).contiguous()


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid):
        return unpack(x, grid).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return pack(g).contiguous(), None


@strict_cpu("latent_pack_unpack", "t", kernel="permute")
def latent_pack_unpack(t, direction: str = "pack", grid: tuple[int, int] | None = None):
    """Pack (``direction="pack"``) or unpack (``"unpack"``, needs ``grid``); bytes unchanged."""
    if direction == "pack":
        return _Pack.apply(t)
    if direction == "unpack" and grid is not None:
        return _Unpack.apply(t, tuple(grid))
    raise UnsupportedConfigError(f"latent_pack_unpack: bad direction/grid {direction!r}, {grid}")


class _Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, mean, std, inverse, dt):
        shape = (1, -1) + (1,) * (z.dim() - 2)
        m = mean.to(torch.float32).view(shape)
        std_inv = (1.0 / std.to(torch.float32)).view(shape)
        zf = z.to(torch.float32)
        y = zf / std_inv + m if inverse else (zf - m) * std_inv
        ctx.save_for_backward(std_inv)
        ctx.inverse, ctx.z_dtype = inverse, z.dtype
        return y.to(dt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (std_inv,) = ctx.saved_tensors
        gf = g.contiguous().to(torch.float32)
        dz = gf / std_inv if ctx.inverse else gf * std_inv
        return dz.to(ctx.z_dtype), None, None, None, None


@strict_cpu("latent_normalize", "z", kernel="elementwise")
def latent_normalize(z, mean, std, inverse: bool = False):
    """Forward (z − mean)·(1/std); inverse z / (1/std) + mean, per channel on axis 1, FP32
    (numerics §3.5: the pipeline divides by the reciprocal). z [B,C,...], mean/std [C]."""
    dt = act_dtype(z)
    return _Normalize.apply(z, mean, std, inverse, dt)
