"""Capture adapter for diffusers' ``AutoencoderKLQwenImage``: its encoder's and decoder's operator
outputs recorded as drifttool's ``QwenImageVAE`` records them (``drifttool.model.vae``).

    >>> with instrument(pipe.vae, rt, "decoder"):     # rt's scope: component vae, step N, ...
    ...     pipe.vae.decode(z)                          # records every vae_* output of the decode

The table is built from the model's own structure (``taps``): a ``Tap`` per module, with the
block number drifttool gives that stage, recorded through ``drifttool.adapters.taps`` (forward
hooks, removed on exit; they only read tensors). Layout ``B....`` ([B, C, T, H, W], one record
per sample), stream ``none``, as drifttool's VAE.

=========================================  ==================  ================================
diffusers module                           RFC operator        block (drifttool's)
=========================================  ==================  ================================
decode: ``post_quant_conv``,               vae_causal_conv3d   −1
``decoder.conv_in``
``decoder.mid_block``                      (below)             0
``decoder.up_blocks.i``: residual blocks,  (below),            1 + i
then ``upsamplers.0`` output               vae_resample
``decoder.nonlinearity`` (after            vae_rms_norm,       1 + len(up_blocks)
``norm_out``), ``decoder.conv_out``        vae_causal_conv3d
encode: ``encoder.conv_in``                vae_causal_conv3d   −1
``encoder.down_blocks.i``: a residual      (below),            i
block, or a downsampler's output           vae_resample
``encoder.mid_block``                      (below)             len(down_blocks)
``encoder.nonlinearity``, ``conv_out``,    vae_rms_norm,       len(down_blocks) + 1
``quant_conv`` (the posterior's moments)   vae_causal_conv3d
residual block: ``conv_shortcut`` (a       vae_causal_conv3d   its stage's
convolution only), ``nonlinearity``        vae_rms_norm
(after ``norm1``, after ``norm2``: RMS     (twice)
norm then SiLU), ``conv1``, the block's    vae_causal_conv3d
output (``conv2`` plus the shortcut)       (conv1, conv2+res)
mid block: residual block,                 vae_mid_attention   its stage's
``attentions.0`` output, residual block    (between)
=========================================  ==================  ================================

The latent (de)normalisation and the 2×2 (un)packing happen in the pipeline, not in the VAE:
``drifttool.adapters.pipeline_stages`` records them. A decode or encode through the tiled or
sliced paths (``enable_tiling``, ``enable_slicing``) runs other calls than drifttool's and is
refused, as a config with attention in the down/up stages (``attn_scales``) is.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from drifttool.adapters.taps import Tap, tap_modules
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runtime import Runtime

LAYOUT = "B...."
PARTS = ("encoder", "decoder")
SUPPORTED_DIFFUSERS = ("0.42.",)
"""diffusers releases whose ``autoencoder_kl_qwenimage`` the table describes (0.42.1 tested)."""


def _classes():
    try:
        import diffusers
        from diffusers.models.autoencoders import autoencoder_kl_qwenimage as mod
    except ImportError as e:
        raise DriftToolError(f"the VAE capture needs diffusers installed ({e})") from None
    if not diffusers.__version__.startswith(SUPPORTED_DIFFUSERS):
        raise DriftToolError(f"diffusers {diffusers.__version__} is not supported by the VAE capture "
                             f"(supported: {', '.join(v + 'x' for v in SUPPORTED_DIFFUSERS)})")
    return mod


def _tap(path: str, op: str, block: int, note: str | None = None) -> Tap:
    return Tap(path, op, "none", LAYOUT, block=block, note=note)


def _residual(path: str, block: torch.nn.Module, number: int, mod) -> list[Tap]:
    """A residual block's taps in drifttool's call order: shortcut (a convolution only), norm1 +
    SiLU, conv1, norm2 + SiLU, conv2 + shortcut (the block's output)."""
    taps = []
    if isinstance(block.conv_shortcut, mod.QwenImageCausalConv3d):
        taps.append(_tap(f"{path}.conv_shortcut", "vae_causal_conv3d", number))
    taps += [_tap(f"{path}.nonlinearity", "vae_rms_norm", number, " (norm1/norm2 + SiLU)"),
             _tap(f"{path}.conv1", "vae_causal_conv3d", number),
             _tap(path, "vae_causal_conv3d", number, " (output: conv2 + shortcut)")]
    return taps


def _stage(path: str, layer: torch.nn.Module, number: int, mod) -> list[Tap]:
    """The taps of one numbered stage: a residual block, a resampler, a mid or up block."""
    if isinstance(layer, mod.QwenImageResidualBlock):
        return _residual(path, layer, number, mod)
    if isinstance(layer, mod.QwenImageResample):
        return [_tap(path, "vae_resample", number)]
    if isinstance(layer, mod.QwenImageMidBlock):
        if len(layer.attentions) != 1 or len(layer.resnets) != 2:
            raise UnsupportedConfigError(f"{path}: a mid block of {len(layer.resnets)} residual blocks and "
                                         f"{len(layer.attentions)} attentions (drifttool's has 2 and 1)")
        return [*_residual(f"{path}.resnets.0", layer.resnets[0], number, mod),
                _tap(f"{path}.attentions.0", "vae_mid_attention", number),
                *_residual(f"{path}.resnets.1", layer.resnets[1], number, mod)]
    if isinstance(layer, mod.QwenImageUpBlock):
        taps = [t for j, r in enumerate(layer.resnets) for t in _residual(f"{path}.resnets.{j}", r, number, mod)]
        if layer.upsamplers is not None:
            taps.append(_tap(f"{path}.upsamplers.0", "vae_resample", number))
        return taps
    raise UnsupportedConfigError(f"{path}: a {type(layer).__name__} (drifttool's VAE has residual blocks, "
                                 "resamplers, mid and up blocks only)")


def taps(vae: torch.nn.Module, part: str) -> tuple[Tap, ...]:
    """The capture table of ``vae``'s ``part`` (``"encoder"``: the encode with ``quant_conv``;
    ``"decoder"``: ``post_quant_conv`` and the decode), in drifttool's call order, with its
    block numbers (``drifttool.model.vae``).

    Raises:
        DriftToolError: diffusers missing or of an unsupported version (``SUPPORTED_DIFFUSERS``),
            ``vae`` not an ``AutoencoderKLQwenImage``.
        UnsupportedConfigError: another part; a layer drifttool's VAE does not have.
    """
    mod = _classes()
    if not isinstance(vae, mod.AutoencoderKLQwenImage):
        raise DriftToolError(f"expected a diffusers AutoencoderKLQwenImage, got {type(vae).__name__}")
    if part not in PARTS:
        raise UnsupportedConfigError(f"VAE part {part!r}: one of {PARTS}")
    if part == "encoder":
        enc = vae.encoder
        out = [_tap("encoder.conv_in", "vae_causal_conv3d", -1)]
        for i, layer in enumerate(enc.down_blocks):
            out += _stage(f"encoder.down_blocks.{i}", layer, i, mod)
        n = len(enc.down_blocks)
        out += _stage("encoder.mid_block", enc.mid_block, n, mod)
        out += [_tap("encoder.nonlinearity", "vae_rms_norm", n + 1, " (norm_out + SiLU)"),
                _tap("encoder.conv_out", "vae_causal_conv3d", n + 1),
                _tap("quant_conv", "vae_causal_conv3d", n + 1)]
        return tuple(out)
    dec = vae.decoder
    out = [_tap("post_quant_conv", "vae_causal_conv3d", -1), _tap("decoder.conv_in", "vae_causal_conv3d", -1)]
    out += _stage("decoder.mid_block", dec.mid_block, 0, mod)
    for i, up in enumerate(dec.up_blocks):
        out += _stage(f"decoder.up_blocks.{i}", up, 1 + i, mod)
    n = 1 + len(dec.up_blocks)
    out += [_tap("decoder.nonlinearity", "vae_rms_norm", n, " (norm_out + SiLU)"),
            _tap("decoder.conv_out", "vae_causal_conv3d", n)]
    return tuple(out)


def check_vae(vae: torch.nn.Module) -> None:
    """Refuse what drifttool's VAE does not run as diffusers does.

    Raises:
        UnsupportedConfigError: tiling or slicing enabled; attention in the down/up stages.
    """
    if getattr(vae, "use_tiling", False) or getattr(vae, "use_slicing", False):
        raise UnsupportedConfigError("VAE capture: the VAE has tiling or slicing enabled (another call "
                                     "sequence than drifttool's VAE; disable_tiling()/disable_slicing())")
    if vae.config.get("attn_scales"):
        raise UnsupportedConfigError(f"VAE capture: attn_scales {vae.config['attn_scales']} (drifttool's VAE "
                                     "has no attention in its down/up stages)")


@contextlib.contextmanager
def instrument(vae: torch.nn.Module, rt: Runtime, part: str) -> Iterator[None]:
    """Hook ``vae``'s ``part`` (``taps``) for the block: every module call inside records into
    ``rt`` (the caller's scope: component, step, samples). Hooks removed on exit.

    Raises:
        DriftToolError, UnsupportedConfigError: as ``taps`` and ``check_vae``; (on exit, after a
            call) a capture point that never fired.
    """
    table = taps(vae, part)
    check_vae(vae)
    with tap_modules(vae, table, rt, actual="diffusers", depth=0, require_all=True):
        yield
