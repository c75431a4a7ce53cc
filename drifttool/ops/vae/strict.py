"""``strict`` family (device ``cpu``) of the VAE operators: FP32 inside, one cast to the
activation dtype at the output, batch- and position-invariant bytes.

    >>> y = call(Runtime(mode="strict"), "vae_causal_conv3d", x, w, b, padding=1, layout="B....")

Orders (docs/operators/vae_*.md):

* convolutions (``vae_causal_conv3d``, ``vae_resample``): each output pixel's patch is one row
  of an im2col matrix [M, K], K ordered (ci, dt, dy, dx) as the weight's flattening, the
  zero-padded taps included (their products are ±0); ``gemm`` reduces K by contract v2 (8
  segments, 64-chunks in order, the depth-3 tree) with the tiled in-chunk kernel (matmul members
  of one fixed shape, [16, c] @ [c, 128]) and adds the bias once; a residual is added after, in
  FP32. The rows are cut into blocks of whole frames and output rows, which changes no bytes
  (``gemm`` is row-invariant).
* ``vae_rms_norm``: Σx² over the channels by the pairwise ``tree_sum``, its square root in FP64
  rounded once (``sqrt32``), ``max(·, 1e-12)``, one FP32 division, ``· fp32(√C) · γ``; SiLU in
  FP64 from exact operations, rounded once (``silu32``).
* ``vae_mid_attention``: the norm above (kept FP32), Q/K/V and the projection by ``gemm`` over
  the C channels, one head per frame through the strict joint attention core (scores
  scaled fp32(1/√C), 64-key blocks in key order, fixed merge of block states; no mask), the
  residual added in FP32.
* ``vae_latent_normalize``: FP32 ``(z − mean)/std`` (two roundings); the inverse is the strict
  ``latent_normalize``'s ``z / fp32(1/std) + mean``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import dtypes
from drifttool.ops.registry import implements, spec
from drifttool.ops.strict import act_dtype, f32, out
from drifttool.ops.strict.attention_fused import joint_attention_fused
from drifttool.ops.strict.latent import latent_normalize
from drifttool.ops.strict_gemm import finish_linear, linear_partial
from drifttool.ops.strict_math import segment_spans, silu32, sqrt32, tree_sum
from drifttool.ops.vae.production import RESAMPLE_MODES, check_conv, check_frames

GEMM_KERNEL = "strict_linear.v2[seg8.k64.seq|mm16x128]"  # the tiled kernel at every size
ROW_BLOCK = 1 << 14  # output pixels per im2col block (bounds memory; bytes do not depend on it)
EPS = 1e-12  # F.normalize's floor of the channel norm


def _strict(op: str, *dtype_args: str, kernel: str):
    return implements(op, "strict", device="cpu", kernel=kernel,
                      constraints=(dtypes(spec(op).dtypes, *dtype_args),))


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Row-invariant FP32 ``x @ wᵀ + b`` by contract v2's K order with the tiled in-chunk kernel
    (fixed-shape matmul members [16, c] @ [c, 128]) whatever the weight's size — unlike
    ``strict_gemm.tiled_linear``, which takes exact products for small weights: those cost
    10–20× more at the VAE's pixel counts. x [..., K] FP32, w [N, K] FP32 → [..., N] FP32."""
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    x2 = x.reshape(lead.numel(), k)
    y = finish_linear([linear_partial(x2, w, segment_spans(k), exact=False)], b, (x2.shape[0], n), x.device)
    return y.reshape(*lead, n)


def conv_gemm(xp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
              stride: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """A valid (unpadded) 3-D convolution of the already padded FP32 ``xp`` [B,Ci,Tp,Hp,Wp] with
    w [Co,Ci,kt,kh,kw] (stride 1 over time, ``stride`` over H and W) as im2col rows through
    ``gemm``. Returns FP32 [B,Co,T',H',W']."""
    co, ci, kt, kh, kw = w.shape
    bsz, _, tp, hp, wp = xp.shape
    sh, sw = stride
    t_out, h_out, w_out = tp - kt + 1, (hp - kh) // sh + 1, (wp - kw) // sw + 1
    w2 = f32(w).reshape(co, ci * kt * kh * kw)  # K = (ci, dt, dy, dx)
    bf = f32(b)
    y = torch.empty(bsz, t_out, h_out, w_out, co, dtype=torch.float32, device=xp.device)
    rows = max(1, ROW_BLOCK // max(1, w_out))  # output rows per block
    for n in range(bsz):
        for t in range(t_out):
            for r0 in range(0, h_out, rows):
                r1 = min(h_out, r0 + rows)
                taps = [xp[n, :, t + dt, dy + r0 * sh: dy + (r1 - 1) * sh + 1: sh, dx: dx + (w_out - 1) * sw + 1: sw]
                        for dt in range(kt) for dy in range(kh) for dx in range(kw)]  # each [Ci, r, W']
                patches = torch.stack(taps, 1)  # [Ci, taps, r, W']
                patches = patches.permute(2, 3, 0, 1).reshape((r1 - r0) * w_out, -1)  # [r·W', K]
                y[n, t, r0:r1] = gemm(patches, w2, bf).view(r1 - r0, w_out, co)
    return y.permute(0, 4, 1, 2, 3)  # [B, Co, T', H', W']


@_strict("vae_causal_conv3d", "x", "w", "b", "residual", kernel="im2col+" + GEMM_KERNEL)
def vae_causal_conv3d(x, w, b, padding: int = 0, residual=None):
    """Causal 3-D convolution (zeros 2p frames in front, p around H and W), then ``+ residual``
    in FP32; one cast to x's dtype. x [B,Ci,T,H,W] → [B,Co,T,H',W']."""
    check_conv(x, w, padding)
    p = padding
    y = conv_gemm(F.pad(f32(x), (p, p, p, p, 2 * p, 0)), w, b)
    if residual is not None:
        y = y + f32(residual)
    return out(y, act_dtype(x))


def rms_norm32(xf: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """FP32 ``x / max(‖x‖₂, 1e-12) · fp32(√C) · γ`` over axis 1 of xf [B,C,...] (module
    docstring's order); gamma holds C values."""
    c = xf.shape[1]
    norm = sqrt32(tree_sum(xf * xf, dim=1)).clamp_min(EPS).unsqueeze(1)  # [B, 1, ...]
    scale = torch.tensor(math.sqrt(c), dtype=torch.float32)
    return xf / norm * scale * f32(gamma).reshape(c, *(1,) * (xf.dim() - 2))


@_strict("vae_rms_norm", "x", "gamma", kernel="tree_l2norm+silu_f64")
def vae_rms_norm(x, gamma, silu: bool = False):
    """RMS norm over the channels of x [B,C,...], then SiLU when ``silu``; one cast to x's dtype."""
    y = rms_norm32(f32(x), gamma)
    return out(silu32(y) if silu else y, act_dtype(x))


@_strict("vae_resample", "x", "w", "b", kernel="nearest_pad+im2col+" + GEMM_KERNEL)
def vae_resample(x, w, b, mode: str):
    """Per frame: ``upsample`` = nearest ×2 (index copy) and a 3×3 conv with padding 1;
    ``downsample`` = zero pad right and bottom and a 3×3 conv with stride 2. x [B,C,1,H,W]."""
    if mode not in RESAMPLE_MODES:
        raise UnsupportedConfigError(f"vae_resample: mode must be one of {RESAMPLE_MODES}, got {mode!r}")
    check_frames("vae_resample", x)
    xf = f32(x)
    w5 = w.unsqueeze(2)  # [Co, C, 1, 3, 3]
    if mode == "upsample":
        xf = xf.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
        y = conv_gemm(F.pad(xf, (1, 1, 1, 1)), w5, b)
    else:
        y = conv_gemm(F.pad(xf, (0, 1, 0, 1)), w5, b, stride=(2, 2))
    return out(y, act_dtype(x))


@_strict("vae_mid_attention", "x", "gamma", "w_qkv", "b_qkv", "w_proj", "b_proj",
         kernel="tree_l2norm+" + GEMM_KERNEL + "+strict.fused_blocked_two_pass.v2")
def vae_mid_attention(x, gamma, w_qkv, b_qkv, w_proj, b_proj):
    """x + proj(attention(qkv(rms_norm(x)))) per frame, one head of C channels over the H·W
    pixels; FP32 throughout, one cast to x's dtype. x [B,C,T,H,W]."""
    bsz, c, t, h, wd = x.shape
    xf = f32(x)
    tokens = rms_norm32(xf, gamma).permute(0, 2, 3, 4, 1).reshape(bsz * t, h * wd, c)  # [BT, HW, C]
    qkv = gemm(tokens, f32(w_qkv).reshape(3 * c, c), f32(b_qkv))  # [BT, HW, 3C]
    q, k, v = (part.unsqueeze(2) for part in qkv.chunk(3, dim=-1))  # [BT, HW, 1, C]
    a = joint_attention_fused(q.contiguous(), k.contiguous(), v.contiguous()).squeeze(2)  # [BT, HW, C]
    y = gemm(a, f32(w_proj).reshape(c, c), f32(b_proj))  # [BT, HW, C]
    y = y.view(bsz, t, h, wd, c).permute(0, 4, 1, 2, 3)  # [B, C, T, H, W]
    return out(xf + y, act_dtype(x))


@_strict("vae_latent_normalize", "z", kernel="elementwise")
def vae_latent_normalize(z, mean, std, inverse: bool = False):
    """Forward FP32 ``(z − mean) / std``; inverse ``z / fp32(1/std) + mean`` (the strict
    ``latent_normalize``'s); per channel on axis 1 of z [B,C,...], one cast to z's dtype."""
    if inverse:
        return latent_normalize(z, mean, std, inverse=True)
    c = z.shape[1]
    if mean.shape != (c,) or std.shape != (c,):
        raise UnsupportedConfigError(f"vae_latent_normalize: mean/std must be [{c}]")
    view = (1, c) + (1,) * (z.dim() - 2)
    return out((f32(z) - f32(mean).view(view)) / f32(std).view(view), act_dtype(z))
