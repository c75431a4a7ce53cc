"""Qwen-Image's VAE (``AutoencoderKLQwenImage``) on drifttool's named VAE operators, for images.

    >>> vae = load_vae("Qwen-Image/vae")                        # drifttool.model.vae_checkpoint
    >>> z = vae.encode(images, rt)                               # [B,3,1,H,W] in [-1,1] → [B,16,1,H/8,W/8]
    >>> latents = vae.normalize(z, rt)                           # (z − mean)/std: the edit condition
    >>> images = vae.decode(vae.denormalize(latents, rt), rt)    # z/(1/std)+mean, decode, clamp

Every computation is a ``call(rt, "vae_…", ...)`` (``drifttool.ops.vae``): the runtime's mode picks
the strict or production family and its recorder captures each output (layout ``B....``) under
``component="vae"``. ``encode`` and ``decode`` number the VAE's stages with ``block``: encode:
−1 ``conv_in``, i the i-th entry of ``encoder.down_blocks`` (a residual block or a downsampler),
then the mid block, then the head (``norm_out``, ``conv_out``, ``quant_conv``); decode: −1
``post_quant_conv`` and ``conv_in``, 0 the mid block, 1 + i ``decoder.up_blocks[i]``, then the
head. The latent statistics run at block −1. The caller's scope tells an encode from a decode
(e.g. a step of its own: the call counters are per phase, step, branch and block, not per
component); the VAE sets only the component and the block.

Parameter names are diffusers' (``encoder.down_blocks.0.conv1.weight``, ...), so its state dict
loads by name. Images only: one frame (T = 1). The 3-D resamplers' causal time convolutions
(``time_conv``) are loaded but never run for one frame, as in diffusers (its first chunk only
fills their caches). ``encode`` returns the posterior's mode (its mean), which is what the edit
pipelines take (``retrieve_latents(..., sample_mode="argmax")``); sampling the posterior is not
implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import drifttool.ops  # noqa: F401  (every operator and built-in family, registered explicitly)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.runtime import Runtime

LAYOUT = "B...."  # [B, C, T, H, W]: one record per sample

LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


@dataclass(frozen=True, kw_only=True)
class VAEConfig:
    """``AutoencoderKLQwenImage``'s config (diffusers' defaults; ``from_diffusers_config``).

    Attributes:
        base_dim: channels of the first stage; stage i has ``base_dim · dim_mult[i]``.
        z_dim: latent channels (the encoder makes 2·z_dim: mean and log-variance).
        dim_mult, num_res_blocks: the stages and residual blocks per stage.
        temperal_downsample: per down stage, whether it also halves time (its ``time_conv``;
            idle for images). ``len`` = number of ×2 spatial steps (factor 8 for 3).
        input_channels: image channels.
        latents_mean, latents_std: the per-channel latent statistics (z_dim values each).
    """

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    input_channels: int = 3
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD

    def __post_init__(self) -> None:
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise UnsupportedConfigError(
                f"VAE config: temperal_downsample needs {len(self.dim_mult) - 1} entries, got "
                f"{list(self.temperal_downsample)}")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise UnsupportedConfigError(f"VAE config: latents_mean/latents_std need z_dim={self.z_dim} values")

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent along H and W (8 for the default)."""
        return 2 ** len(self.temperal_downsample)


def from_diffusers_config(d: dict[str, Any]) -> VAEConfig:
    """``VAEConfig`` from a diffusers ``config.json`` dict (unknown keys ignored, as diffusers).

    Raises:
        UnsupportedConfigError: attention in the down/up stages (``attn_scales``), which
            Qwen-Image's VAE does not have and drifttool does not implement, or a malformed field.
    """
    if d.get("attn_scales"):
        raise UnsupportedConfigError(f"VAE config: attn_scales {d['attn_scales']} is not supported (only [])")
    fields = {k: d[k] for k in ("base_dim", "z_dim", "num_res_blocks", "input_channels") if k in d}
    for k in ("dim_mult", "temperal_downsample", "latents_mean", "latents_std"):
        if k in d:
            fields[k] = tuple(d[k])
    try:
        return VAEConfig(**fields)
    except TypeError as e:
        raise UnsupportedConfigError(f"VAE config: {e}") from None


# ---------------------------------------------------------------------------------------------
# layers: parameters under diffusers' names, arithmetic by the named operators


class CausalConv3d(nn.Module):
    """``QwenImageCausalConv3d``: weight [Co,Ci,kt,kh,kw], bias [Co]; padding p (kt = 2p + 1)."""

    def __init__(self, ci: int, co: int, kernel: tuple[int, int, int], padding: int = 0) -> None:
        super().__init__()
        self.padding = padding
        self.weight = nn.Parameter(torch.empty(co, ci, *kernel))
        self.bias = nn.Parameter(torch.empty(co))

    def forward(self, x: torch.Tensor, rt: Runtime, residual: torch.Tensor | None = None) -> torch.Tensor:
        return call(rt, "vae_causal_conv3d", x, self.weight, self.bias, padding=self.padding,
                    residual=residual, layout=LAYOUT)


def _conv3(ci: int, co: int) -> CausalConv3d:
    return CausalConv3d(ci, co, (3, 3, 3), padding=1)


class RMSNorm(nn.Module):
    """``QwenImageRMS_norm`` without bias: gamma [C,1,1,1] (blocks) or [C,1,1] (attention)."""

    def __init__(self, dim: int, images: bool = False) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.empty(dim, *((1, 1) if images else (1, 1, 1))))

    def forward(self, x: torch.Tensor, rt: Runtime, silu: bool = False) -> torch.Tensor:
        return call(rt, "vae_rms_norm", x, self.gamma, silu=silu, layout=LAYOUT)


class ResidualBlock(nn.Module):
    """``QwenImageResidualBlock``: norm1 → SiLU → conv1 → norm2 → SiLU → conv2, plus the input
    (through the 1×1×1 ``conv_shortcut`` when the width changes)."""

    def __init__(self, ci: int, co: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = RMSNorm(ci), _conv3(ci, co)
        self.norm2, self.conv2 = RMSNorm(co), _conv3(co, co)
        self.conv_shortcut = CausalConv3d(ci, co, (1, 1, 1)) if ci != co else None

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        h = x if self.conv_shortcut is None else self.conv_shortcut(x, rt)
        x = self.conv1(self.norm1(x, rt, silu=True), rt)
        return self.conv2(self.norm2(x, rt, silu=True), rt, residual=h)


class AttentionBlock(nn.Module):
    """``QwenImageAttentionBlock``: one ``vae_mid_attention`` call."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = _ConvParams(3 * dim, dim, 1, 1)
        self.proj = _ConvParams(dim, dim, 1, 1)

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        return call(rt, "vae_mid_attention", x, self.norm.gamma, self.to_qkv.weight, self.to_qkv.bias,
                    self.proj.weight, self.proj.bias, layout=LAYOUT)


class _ConvParams(nn.Module):
    """A convolution's parameters only: weight of ``shape`` [Co, Ci, k...], bias [Co]."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))
        self.bias = nn.Parameter(torch.empty(shape[0]))


class MidBlock(nn.Module):
    """``QwenImageMidBlock``: resnet, attention, resnet."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        x = self.resnets[0](x, rt)
        return self.resnets[1](self.attentions[0](x, rt), rt)


class Resample(nn.Module):
    """``QwenImageResample`` for images: ``resample.1`` the 3×3 conv (``upsample``: C → C/2 after
    nearest ×2; ``downsample``: stride 2); ``time_conv`` (3-D modes) is loaded, idle for T = 1."""

    def __init__(self, dim: int, mode: str, temporal: bool) -> None:
        super().__init__()
        self.mode = mode
        co = dim // 2 if mode == "upsample" else dim
        self.resample = nn.Sequential(nn.Identity(), _ConvParams(co, dim, 3, 3))
        if temporal:
            self.time_conv = _ConvParams(dim * 2 if mode == "upsample" else dim, dim, 3, 1, 1)

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        conv = self.resample[1]
        return call(rt, "vae_resample", x, conv.weight, conv.bias, mode=self.mode, layout=LAYOUT)


def _head(norm: RMSNorm, conv: CausalConv3d, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
    return conv(norm(x, rt, silu=True), rt)


class Encoder(nn.Module):
    """``QwenImageEncoder3d``: conv_in, down_blocks (resnets and resamplers, one list), mid,
    norm_out + SiLU + conv_out (2·z_dim channels)."""

    def __init__(self, c: VAEConfig) -> None:
        super().__init__()
        dims = [c.base_dim * u for u in (1, *c.dim_mult)]
        self.conv_in = _conv3(c.input_channels, dims[0])
        blocks: list[nn.Module] = []
        for i, (ci, co) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(c.num_res_blocks):
                blocks.append(ResidualBlock(ci, co))
                ci = co
            if i != len(c.dim_mult) - 1:
                blocks.append(Resample(co, "downsample", c.temperal_downsample[i]))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = _conv3(dims[-1], 2 * c.z_dim)

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        x = self.conv_in(x, rt)
        for i, layer in enumerate(self.down_blocks):
            with rt.scope(block=i):
                x = layer(x, rt)
        with rt.scope(block=len(self.down_blocks)):
            x = self.mid_block(x, rt)
        with rt.scope(block=len(self.down_blocks) + 1):
            return _head(self.norm_out, self.conv_out, x, rt)


class UpBlock(nn.Module):
    """``QwenImageUpBlock``: num_res_blocks + 1 resnets, then the upsampler (all but the last)."""

    def __init__(self, ci: int, co: int, num_res_blocks: int, mode: str | None, temporal: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(ci if j == 0 else co, co) for j in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([Resample(co, mode, temporal)]) if mode else None

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, rt)
        return x if self.upsamplers is None else self.upsamplers[0](x, rt)


class Decoder(nn.Module):
    """``QwenImageDecoder3d``: conv_in, mid, up_blocks, norm_out + SiLU + conv_out (image
    channels)."""

    def __init__(self, c: VAEConfig) -> None:
        super().__init__()
        mult = c.dim_mult
        dims = [c.base_dim * u for u in (mult[-1], *mult[::-1])]
        upsample = c.temperal_downsample[::-1]
        self.conv_in = _conv3(c.z_dim, dims[0])
        self.mid_block = MidBlock(dims[0])
        ups = []
        for i, (ci, co) in enumerate(zip(dims[:-1], dims[1:])):
            last = i == len(mult) - 1
            ups.append(UpBlock(ci // 2 if i > 0 else ci, co, c.num_res_blocks,
                               None if last else "upsample", False if last else upsample[i]))
        self.up_blocks = nn.ModuleList(ups)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = _conv3(dims[-1], c.input_channels)

    def forward(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        x = self.conv_in(x, rt)
        with rt.scope(block=0):
            x = self.mid_block(x, rt)
        for i, up in enumerate(self.up_blocks):
            with rt.scope(block=1 + i):
                x = up(x, rt)
        with rt.scope(block=1 + len(self.up_blocks)):
            return _head(self.norm_out, self.conv_out, x, rt)


# ---------------------------------------------------------------------------------------------
# the model


class QwenImageVAE(nn.Module):
    """The VAE: ``encoder``, ``quant_conv``, ``post_quant_conv``, ``decoder`` (diffusers' names).

    Build with ``VAEConfig``; the parameters are uninitialised until loaded
    (``drifttool.model.vae_checkpoint.load_vae``) or set by ``random_init_``.
    """

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, (1, 1, 1))
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, (1, 1, 1))
        self.decoder = Decoder(config)

    def _images(self, x: torch.Tensor, channels: int, what: str) -> None:
        if x.dim() != 5 or x.shape[1] != channels or x.shape[2] != 1:
            raise UnsupportedConfigError(f"VAE {what}: expected [B,{channels},1,H,W] (images), got {tuple(x.shape)}")

    def encode(self, x: torch.Tensor, rt: Runtime) -> torch.Tensor:
        """The posterior's mode (mean) of images x [B,3,1,H,W] in [-1, 1] (H, W multiples of
        ``spatial_factor``): [B,z_dim,1,H/8,W/8] in x's dtype — the edit pipelines' condition
        latents before normalisation.

        Raises:
            UnsupportedConfigError: not [B,C,1,H,W] images; a strict constraint (dtype, device).
        """
        self._images(x, self.config.input_channels, "encode")
        f = self.config.spatial_factor
        if x.shape[3] % f or x.shape[4] % f:
            raise UnsupportedConfigError(f"VAE encode: H and W must be multiples of {f}, got {tuple(x.shape[3:])}")
        with rt.scope(component="vae", block=-1):
            h = self.encoder(x, rt)
            with rt.scope(block=len(self.encoder.down_blocks) + 1):
                moments = self.quant_conv(h, rt)  # [B, 2·z, 1, h, w]: mean, log-variance
        return moments[:, : self.config.z_dim]

    def decode(self, z: torch.Tensor, rt: Runtime) -> torch.Tensor:
        """Images [B,3,1,8h,8w] in [-1, 1] (clamped, an exact step) from latents z [B,z_dim,1,h,w].

        Raises:
            UnsupportedConfigError: not [B,z_dim,1,h,w]; a strict constraint (dtype, device).
        """
        self._images(z, self.config.z_dim, "decode")
        with rt.scope(component="vae", block=-1):
            x = self.decoder(self.post_quant_conv(z, rt), rt)
        return x.clamp(-1.0, 1.0)

    def _statistics(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return (torch.tensor(c.latents_mean, device=z.device), torch.tensor(c.latents_std, device=z.device))

    def normalize(self, z: torch.Tensor, rt: Runtime) -> torch.Tensor:
        """``(z − mean) / std`` with the config's statistics (the edit pipelines' condition
        latents). z [B,z_dim,1,h,w]."""
        with rt.scope(component="vae", block=-1):
            return call(rt, "vae_latent_normalize", z, *self._statistics(z), layout=LAYOUT)

    def denormalize(self, z: torch.Tensor, rt: Runtime) -> torch.Tensor:
        """``z / (1/std) + mean`` (every pipeline before its decode). z [B,z_dim,1,h,w]."""
        with rt.scope(component="vae", block=-1):
            return call(rt, "vae_latent_normalize", z, *self._statistics(z), inverse=True, layout=LAYOUT)


def random_init_(vae: QwenImageVAE, seed: int = 0, scale: float = 1.0) -> QwenImageVAE:
    """Fill every parameter from a seeded generator (tests and benchmarks): weights
    N(0, scale²/fan_in), biases N(0, 0.01), gammas 1 + N(0, 0.01). Returns ``vae``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (scale / fan_in ** 0.5))
    return vae
