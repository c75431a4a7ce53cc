"""FP64 references of the text encoder's vision operators (``te_vision_*``): the prompt image's
resampling and patches, the Qwen2.5-VL vision tower's operators, the mRoPE positions of vision
tokens and their scatter into the prompt. Written from the Qwen2.5-VL model definition
(transformers' ``modeling_qwen2_5_vl.py``), Pillow's documented resampling filters and the image
processor's steps; plain torch in FP64 with explicit loops and index arithmetic, no drifttool
import. Inputs of any float dtype are upcast; float results are FP64.

    >>> img = te_vision_resize(image, 56, 84, 3)           # [1, 56, 84, 3] float64, 8-bit values
    >>> q2, k2 = te_vision_rope(q, k, cos, sin)
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.to(F64)


def _cubic(x: float, a: float = -0.5) -> float:
    """Keys' cubic convolution kernel with a = −0.5 (Pillow's BICUBIC), support 2."""
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


def _resample_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] weights of a 1-D area-aware bicubic resampling: output pixel j is centred at
    (j + ½)·s in input coordinates (s = n_in/n_out); when shrinking the kernel is stretched by s;
    weights are normalised to sum 1 over the input pixels the support reaches."""
    s = n_in / n_out
    stretch = max(s, 1.0)
    m = torch.zeros(n_out, n_in, dtype=F64)
    for j in range(n_out):
        centre = (j + 0.5) * s
        lo, hi = max(int(centre - 2.0 * stretch + 0.5), 0), min(int(centre + 2.0 * stretch + 0.5), n_in)
        for i in range(lo, hi):
            m[j, i] = _cubic((i + 0.5 - centre) / stretch)
        m[j] /= m[j].sum()
    return m


def te_vision_resize(image, height, width, resample=3):
    """Bicubic resampling of an 8-bit [1, H, W, 3] image to [1, height, width, 3], as two
    separable passes (along the width first, then the height), each giving an 8-bit image:
    exact FP64 sums, then rounded to the nearest integer and clipped to [0, 255]; a pass whose
    size does not change is skipped. Returns FP64 holding those integers. ``resample`` must be
    3 (bicubic)."""
    assert resample == 3
    x = _d(image[0])  # [H, W, 3]

    def to8(t):
        return torch.clamp(torch.floor(t + 0.5), 0.0, 255.0)

    if x.shape[1] != width:
        x = to8(torch.einsum("wW,HWc->Hwc", _resample_matrix(x.shape[1], width), x))
    if x.shape[0] != height:
        x = to8(torch.einsum("hH,Hwc->hwc", _resample_matrix(x.shape[0], height), x))
    return x.unsqueeze(0)


def te_vision_patchify(image, mean, std, rescale_factor, patch_size, temporal_patch_size, merge_size):
    """(x·rescale − mean)/std per channel in FP64; patch n = (token row, token col, sub row,
    sub col) in merge blocks, its vector (c, t, y, x) with every frame t a copy."""
    p, t, m = patch_size, temporal_patch_size, merge_size
    x = _d(image[0])  # [H, W, 3]
    h, w = x.shape[0], x.shape[1]
    x = (x * rescale_factor - torch.tensor(mean, dtype=F64)) / torch.tensor(std, dtype=F64)
    gh, gw = h // p, w // p
    out = torch.empty(gh * gw, 3 * t * p * p, dtype=F64)
    n = 0
    for ty in range(gh // m):
        for tx in range(gw // m):
            for sy in range(m):
                for sx in range(m):
                    r0, c0 = (ty * m + sy) * p, (tx * m + sx) * p
                    block = x[r0:r0 + p, c0:c0 + p].permute(2, 0, 1)  # [3, P, P]
                    out[n] = block.unsqueeze(1).expand(3, t, p, p).reshape(-1)
                    n += 1
    return out.unsqueeze(0), torch.tensor([[1, gh, gw]], dtype=torch.int64)


def te_vision_patch_embed(pixels, w):
    """Each patch's pixels dotted with each output channel's kernel: [N, E]."""
    return _d(pixels).reshape(pixels.shape[0], -1) @ _d(w).reshape(w.shape[0], -1).T


def te_vision_rope_table(positions, head_dim, theta):
    """cos/sin of angles: frequency f_i = θ^(−4i/Dh), i < Dh/4; the row half takes row·f_i, the
    column half col·f_i, and the whole repeats once: [N, Dh] each."""
    f = torch.tensor([theta ** (-4.0 * i / head_dim) for i in range(head_dim // 4)], dtype=F64)
    pos = _d(positions)
    ang = torch.cat([pos[:, 0:1] * f, pos[:, 1:2] * f], dim=-1)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def te_vision_rmsnorm(x, gain, eps=1e-6):
    x = _d(x)
    return _d(gain) * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def te_vision_qkv(x, w, b, heads):
    y = _d(x) @ _d(w).T + _d(b)  # [N, 3·H·Dh]
    q, k, v = y.chunk(3, dim=-1)
    return q.unflatten(-1, (heads, -1)), k.unflatten(-1, (heads, -1)), v.unflatten(-1, (heads, -1))


def te_vision_rope(q, k, cos, sin):
    """x·cos + [−x₂, x₁]·sin per head."""
    c, s = _d(cos)[:, None], _d(sin)[:, None]

    def rot(x):
        x = _d(x)
        half = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

    return rot(q), rot(k)


def te_vision_attention(q, k, v, cu_seqlens):
    """softmax(q·kᵀ/√Dh)·v within each segment [cu[i], cu[i+1]), every key of the segment."""
    q, k, v = _d(q), _d(k), _d(v)
    out = torch.empty_like(q)
    cu = [int(c) for c in cu_seqlens]
    for a, b in zip(cu[:-1], cu[1:]):
        s = torch.einsum("ihd,jhd->hij", q[a:b], k[a:b]) / math.sqrt(q.shape[-1])
        out[a:b] = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v[a:b])
    return out


def te_vision_attn_out_residual(x, a, w, b):
    return _d(x) + _d(a).reshape(a.shape[0], -1) @ _d(w).T + _d(b)


def te_vision_mlp_gate_up_silu(h, w_gate, b_gate, w_up, b_up):
    h = _d(h)
    g = h @ _d(w_gate).T + _d(b_gate)
    return g / (1 + torch.exp(-g)) * (h @ _d(w_up).T + _d(b_up))


def te_vision_mlp_down_residual(x, m, w, b):
    return _d(x) + _d(m) @ _d(w).T + _d(b)


def te_vision_merger(x, gain, w1, b1, w2, b2, merge_unit, eps=1e-6):
    """RMSNorm, m² consecutive rows side by side, Linear, GELU x·Φ(x) (erf), Linear."""
    h = te_vision_rmsnorm(x, gain, eps).reshape(-1, x.shape[-1] * merge_unit)
    g = h @ _d(w1).T + _d(b1)
    g = 0.5 * g * (1 + torch.special.erf(g / math.sqrt(2.0)))
    return g @ _d(w2).T + _d(b2)


def te_vision_rope_index(ids, attention_mask, image_token_id, grids, merge):
    """Per prompt, walking its valid tokens: a text token takes (p, p, p) and p += 1; an image
    (a run of image tokens, images numbered across the batch) of grid (t, h, w) takes
    (p + i, p + y, p + x) for its merged tokens (i, y, x) row-major, then p += max(h, w)/m.
    Padding positions are 0."""
    b, n = ids.shape
    out = torch.zeros(3, b, n, dtype=torch.int64)
    image = 0
    for row in range(b):
        cols = [c for c in range(n) if attention_mask is None or int(attention_mask[row, c]) == 1]
        p, c = 0, 0
        while c < len(cols):
            if int(ids[row, cols[c]]) != image_token_id:
                out[:, row, cols[c]] = p
                p, c = p + 1, c + 1
                continue
            t, h, w = (int(v) for v in grids[image])
            for i in range(t):
                for y in range(h // merge):
                    for x in range(w // merge):
                        out[:, row, cols[c]] = torch.tensor([p + i, p + y, p + x])
                        c += 1
            p += max(h, w) // merge
            image += 1
    return out


def te_vision_scatter(x, ids, image_token_id, vision):
    """Image-token rows replaced, in row-major order, by the vision rows."""
    out, k = _d(x).clone(), 0
    for row in range(ids.shape[0]):
        for c in range(ids.shape[1]):
            if int(ids[row, c]) == image_token_id:
                out[row, c] = _d(vision[k])
                k += 1
    return out
