"""FP64 references of the VAE operators (``drifttool/ops/specs.py``, component ``vae``), written
from ``AutoencoderKLQwenImage``'s definition and the Qwen-Image pipelines' latent statistics.

    >>> from drifttool.references import vae as ref
    >>> y = ref.vae_causal_conv3d(x, w, b, padding=1)        # float64, the operator's signature

Each function takes the operator's own call signature, upcasts every floating input to float64
and returns float64: the ideal arithmetic (no intermediate rounding) that the strict and
production families are judged against (``tests/ops/test_vae_reference_accuracy.py``). Like
``ops.py``, this module imports only torch and math — never drifttool — and spells the layouts
out (the causal padding, the nearest-neighbour index map, the per-pixel patches) rather than
reusing the backends' code.
"""

from __future__ import annotations

import math

import torch


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float64)


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """Valid 3-D cross-correlation in FP64 written as a sum over the kernel taps:
    y[n, o, t, i, j] = b[o] + Σ_{c, dt, dy, dx} w[o, c, dt, dy, dx] · x[n, c, t + dt, i·sh + dy, j·sw + dx]."""
    co, ci, kt, kh, kw = w.shape
    st, sh, sw = stride
    n, _, tp, hp, wp = x.shape
    t_out, h_out, w_out = (tp - kt) // st + 1, (hp - kh) // sh + 1, (wp - kw) // sw + 1
    y = b.view(1, co, 1, 1, 1).expand(n, co, t_out, h_out, w_out).clone()
    for dt in range(kt):
        for dy in range(kh):
            for dx in range(kw):
                xs = x[:, :, dt: dt + (t_out - 1) * st + 1: st, dy: dy + (h_out - 1) * sh + 1: sh,
                       dx: dx + (w_out - 1) * sw + 1: sw]  # [N, Ci, T', H', W']
                y = y + torch.einsum("oc,ncthw->nothw", w[:, :, dt, dy, dx], xs)
    return y


def vae_causal_conv3d(x, w, b, padding: int = 0, residual=None) -> torch.Tensor:
    """Causal 3-D convolution: 2p zero frames before the first frame, p zeros on each side of H
    and W, a valid convolution, then ``+ residual``. x [B,Ci,T,H,W] → [B,Co,T,H',W']."""
    x, w, b = _f64(x), _f64(w), _f64(b)
    p = padding
    n, c, t, h, wd = x.shape
    xp = torch.zeros(n, c, t + 2 * p, h + 2 * p, wd + 2 * p, dtype=torch.float64)
    xp[:, :, 2 * p:, p: p + h, p: p + wd] = x
    y = _conv(xp, w, b, (1, 1, 1))
    return y if residual is None else y + _f64(residual)


def _rms(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    c = x.shape[1]
    norm = torch.sqrt((x * x).sum(dim=1, keepdim=True)).clamp_min(1e-12)
    return x / norm * math.sqrt(c) * gamma.reshape(c, *(1,) * (x.dim() - 2))


def vae_rms_norm(x, gamma, silu: bool = False) -> torch.Tensor:
    """x / max(‖x‖₂ over channels, 1e-12) · √C · γ, then SiLU y/(1 + e^−y) when ``silu``."""
    y = _rms(_f64(x), _f64(gamma))
    return y / (1 + torch.exp(-y)) if silu else y


def vae_resample(x, w, b, mode: str) -> torch.Tensor:
    """Per frame. ``upsample``: out[i, j] = x[⌊i/2⌋, ⌊j/2⌋] (nearest, ×2), then a 3×3 convolution
    with one zero around; ``downsample``: one zero column right and one zero row below, then a
    3×3 convolution with stride 2. x [B,C,T,H,W], w [Co,C,3,3]."""
    x, w, b = _f64(x), _f64(w), _f64(b)
    n, c, t, h, wd = x.shape
    if mode == "upsample":
        rows = torch.arange(2 * h) // 2
        cols = torch.arange(2 * wd) // 2
        up = x[:, :, :, rows][:, :, :, :, cols]  # [B, C, T, 2H, 2W]
        xp = torch.zeros(n, c, t, 2 * h + 2, 2 * wd + 2, dtype=torch.float64)
        xp[:, :, :, 1:-1, 1:-1] = up
        return _conv(xp, w.unsqueeze(2), b, (1, 1, 1))
    if mode == "downsample":
        xp = torch.zeros(n, c, t, h + 1, wd + 1, dtype=torch.float64)
        xp[:, :, :, :h, :wd] = x
        return _conv(xp, w.unsqueeze(2), b, (1, 2, 2))
    raise ValueError(f"unknown mode {mode!r}")


def vae_mid_attention(x, gamma, w_qkv, b_qkv, w_proj, b_proj) -> torch.Tensor:
    """Per frame: n = rms_norm(x); q, k, v = the three C-row blocks of W_qkv·n + b (per pixel);
    softmax(q·kᵀ/√C) over the frame's H·W pixels; out = x + W_proj·(P·v) + b_proj."""
    x = _f64(x)
    bsz, c, t, h, wd = x.shape
    tokens = _rms(x, _f64(gamma)).permute(0, 2, 3, 4, 1).reshape(bsz, t, h * wd, c)  # [B, T, N, C]
    qkv = tokens @ _f64(w_qkv).reshape(3 * c, c).T + _f64(b_qkv)
    q, k, v = qkv[..., :c], qkv[..., c: 2 * c], qkv[..., 2 * c:]
    s = q @ k.transpose(-1, -2) / math.sqrt(c)  # [B, T, N, N]
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    o = (p @ v) @ _f64(w_proj).reshape(c, c).T + _f64(b_proj)  # [B, T, N, C]
    return x + o.reshape(bsz, t, h, wd, c).permute(0, 4, 1, 2, 3)


def vae_latent_normalize(z, mean, std, inverse: bool = False) -> torch.Tensor:
    """Per channel c of z [B,C,...]: forward (z − mean_c)/std_c; inverse z·std_c + mean_c (the
    pipelines' z / (1/std) + mean, exactly)."""
    z = _f64(z)
    shape = (1, -1) + (1,) * (z.dim() - 2)
    m, s = _f64(mean).view(shape), _f64(std).view(shape)
    return z * s + m if inverse else (z - m) / s


def _lanczos(x: float) -> float:
    """The Lanczos kernel with a = 3: sinc(x)·sinc(x/3) for |x| < 3, else 0."""
    def sinc(t: float) -> float:
        return 1.0 if t == 0.0 else math.sin(math.pi * t) / (math.pi * t)
    return sinc(x) * sinc(x / 3.0) if -3.0 <= x < 3.0 else 0.0


def _lanczos_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] weights of an area-aware 1-D Lanczos resampling: output pixel j is centred at
    (j + ½)·s in input coordinates (s = n_in/n_out); when shrinking the kernel is stretched by s;
    the weights of the input pixels the support reaches are normalised to sum 1."""
    s = n_in / n_out
    stretch = max(s, 1.0)
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for j in range(n_out):
        centre = (j + 0.5) * s
        lo, hi = max(int(centre - 3.0 * stretch + 0.5), 0), min(int(centre + 3.0 * stretch + 0.5), n_in)
        for i in range(lo, hi):
            m[j, i] = _lanczos((i + 0.5 - centre) / stretch)
        m[j] /= m[j].sum()
    return m


def vae_image_resize(image, height, width, resample=1) -> torch.Tensor:
    """Lanczos resampling of an 8-bit [1, H, W, 3] image to [1, height, width, 3], two separable
    passes (along the width, then the height), each an exact FP64 sum rounded to the nearest
    integer and clipped to [0, 255]; a pass whose size does not change is skipped. Returns FP64
    holding those integers. ``resample`` must be 1 (Lanczos)."""
    assert resample == 1
    x = image[0].to(torch.float64)  # [H, W, 3]

    def to8(t):
        return torch.clamp(torch.floor(t + 0.5), 0.0, 255.0)

    if x.shape[1] != width:
        x = to8(torch.einsum("wW,HWc->Hwc", _lanczos_matrix(x.shape[1], width), x))
    if x.shape[0] != height:
        x = to8(torch.einsum("hH,Hwc->hwc", _lanczos_matrix(x.shape[0], height), x))
    return x.unsqueeze(0)


OPS = {
    "vae_causal_conv3d": vae_causal_conv3d,
    "vae_rms_norm": vae_rms_norm,
    "vae_resample": vae_resample,
    "vae_mid_attention": vae_mid_attention,
    "vae_latent_normalize": vae_latent_normalize,
}
"""Operator name → its FP64 reference (the rows of ``specs.VAE_MODEL_OPERATORS``; the image
resize's reference, ``vae_image_resize``, is checked in ``tests/ops/test_vae_image_resize.py``)."""
