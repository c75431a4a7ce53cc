"""``production`` family of the VAE operators: ``AutoencoderKLQwenImage``'s own torch calls and
cast points (diffusers 0.42.1, ``models/autoencoders/autoencoder_kl_qwenimage.py``) and the edit
pipelines' latent normalisation, so a VAE built from them equals diffusers' byte for byte.

    >>> y = call(Runtime(mode="auto"), "vae_causal_conv3d", x, w, b, padding=1, layout="B....")
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.production import DEVICES
from drifttool.ops.production import latent_normalize as _latent_normalize
from drifttool.ops.registry import implements

_HALF = (torch.float16, torch.bfloat16)
RESAMPLE_MODES = ("upsample", "downsample")


def _production(op: str, *, kernel: str):
    return implements(op, "production", device=DEVICES, kernel=kernel)


def check_conv(x: torch.Tensor, w: torch.Tensor, padding: int) -> None:
    """The geometry both families accept: x [B,Ci,T,H,W], w [Co,Ci,kt,kh,kw] with every kernel
    extent at most 2·padding + 1 (the output keeps T; H and W shrink by k − 1 − 2p).

    Raises:
        UnsupportedConfigError: other ranks, channel counts or padding.
    """
    if x.dim() != 5 or w.dim() != 5 or w.shape[1] != x.shape[1]:
        raise UnsupportedConfigError(
            f"vae_causal_conv3d: x [B,Ci,T,H,W] and w [Co,Ci,kt,kh,kw] with equal Ci, got "
            f"{tuple(x.shape)} and {tuple(w.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0 or w.shape[2] != 2 * padding + 1:
        raise UnsupportedConfigError(
            f"vae_causal_conv3d: padding must be an int p >= 0 with kt = 2p + 1, got {padding!r} for {tuple(w.shape)}")


def check_frames(op: str, x: torch.Tensor) -> None:
    """Images only: x [B,C,1,H,W].

    Raises:
        UnsupportedConfigError: another rank or more than one frame.
    """
    if x.dim() != 5 or x.shape[2] != 1:
        raise UnsupportedConfigError(f"{op}: expected images [B,C,1,H,W], got {tuple(x.shape)}")


@_production("vae_causal_conv3d", kernel="torch.conv3d")
def vae_causal_conv3d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, padding: int = 0,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """``QwenImageCausalConv3d`` without a cache: zeros 2p frames in front, p around H and W,
    ``F.conv3d`` with the bias, then ``+ residual`` (a residual block's shortcut). [B,Co,T,H',W']."""
    check_conv(x, w, padding)
    p = padding
    y = F.conv3d(F.pad(x, (p, p, p, p, 2 * p, 0)), w, b)
    return y if residual is None else y + residual


def rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``QwenImageRMS_norm`` (no bias): ``F.normalize`` over the channels (axis 1; FP32 for
    half inputs, cast back), then ``· √C · gamma + 0.0``."""
    normalized = F.normalize(x.float() if x.dtype in _HALF else x, dim=1).to(x.dtype)
    return normalized * x.shape[1] ** 0.5 * gamma + 0.0


@_production("vae_rms_norm", kernel="torch.normalize")
def vae_rms_norm(x: torch.Tensor, gamma: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """RMS norm over the channels of x [B,C,...] (gamma C values, broadcast as [C,1,..]), then
    SiLU when ``silu`` (a residual block's and a head's ``nonlinearity``)."""
    y = rms_norm(x, gamma.reshape(-1, *(1,) * (x.dim() - 2)))
    return F.silu(y) if silu else y


@_production("vae_resample", kernel="torch.interpolate_pad+conv2d")
def vae_resample(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """``QwenImageResample`` on images: frames folded into the batch; ``upsample``:
    nearest-exact ×2 (in FP32, cast back) and a 3×3 conv with padding 1 (C → C/2 in the model);
    ``downsample``: zero pad right and bottom, a 3×3 conv with stride 2. [B,Co,1,H',W']."""
    if mode not in RESAMPLE_MODES:
        raise UnsupportedConfigError(f"vae_resample: mode must be one of {RESAMPLE_MODES}, got {mode!r}")
    check_frames("vae_resample", x)
    bsz, c, t, h, wd = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(bsz * t, c, h, wd)
    if mode == "upsample":
        x = F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)
        x = F.conv2d(x, w, b, padding=1)
    else:
        x = F.conv2d(F.pad(x, (0, 1, 0, 1)), w, b, stride=2)
    return x.view(bsz, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


@_production("vae_mid_attention", kernel="torch.sdpa")
def vae_mid_attention(x: torch.Tensor, gamma: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor,
                      w_proj: torch.Tensor, b_proj: torch.Tensor) -> torch.Tensor:
    """``QwenImageAttentionBlock``: per frame, RMS norm, 1×1 conv to q, k, v (one head of C
    channels over the H·W pixels), SDPA, 1×1 projection, plus the input. [B,C,T,H,W]."""
    identity = x
    bsz, c, t, h, wd = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(bsz * t, c, h, wd)
    x = rms_norm(x, gamma.reshape(-1, 1, 1))
    qkv = F.conv2d(x, w_qkv, b_qkv)  # [BT, 3C, H, W]
    qkv = qkv.reshape(bsz * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()  # [BT, 1, HW, 3C]
    q, k, v = qkv.chunk(3, dim=-1)
    x = F.scaled_dot_product_attention(q, k, v)  # [BT, 1, HW, C]
    x = x.squeeze(1).permute(0, 2, 1).reshape(bsz * t, c, h, wd)
    x = F.conv2d(x, w_proj, b_proj)
    x = x.view(bsz, t, c, h, wd).permute(0, 2, 1, 3, 4)
    return x + identity


@_production("vae_latent_normalize", kernel="torch.elementwise")
def vae_latent_normalize(z: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                         inverse: bool = False) -> torch.Tensor:
    """The pipelines' per-channel latent statistics, ``mean``/``std`` [C] cast to z's dtype:
    forward ``(z − mean) / std`` (the edit pipelines' ``_encode_vae_image``); inverse
    ``z / (1/std) + mean`` (every pipeline's decode; ``latent_normalize``'s inverse). z [B,C,...]."""
    if inverse:
        return _latent_normalize(z, mean, std, inverse=True)
    c = z.shape[1]
    if mean.shape != (c,) or std.shape != (c,):
        raise UnsupportedConfigError(f"vae_latent_normalize: mean/std must be [{c}]")
    view = (1, c) + (1,) * (z.dim() - 2)
    return (z - mean.view(view).to(z.device, z.dtype)) / std.view(view).to(z.device, z.dtype)
