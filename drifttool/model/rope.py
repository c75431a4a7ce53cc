"""Three-axis RoPE tables of the Qwen-Image MMDiT (diffusers ``QwenEmbedRope``, numerics §2.2).

    >>> img, txt = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    >>> img.shape, img.dtype, txt.shape
    (torch.Size([24, 8]), torch.complex64, torch.Size([7, 8]))

Per axis of size D_a: ``inv_a[i] = 1 / 10000^(fp32(2i) / D_a)`` (fp32); position p rotates by
``e^{i·fp32(p)·inv_a[i]}`` (complex64 via ``torch.polar``). A token's table row is the
concatenation ``[frame axis (D_0/2) | row axis (D_1/2) | column axis (D_2/2)]``.

Positions (scale_rope=True):

- image token n = i·w + j of an h×w patch grid: (0, i − ⌈h/2⌉, j − ⌈w/2⌉);
- text token k: (p, p, p) with p = max(⌊h/2⌋, ⌊w/2⌋) + k, over the *padded* length L.

Tables are computed on the CPU (as diffusers does, at construction) and then moved to the device,
so every device sees the same bytes. Results are cached by (grid, L, axes, theta, device); callers
must not modify them in place.
"""

from __future__ import annotations

import functools

import torch


def rope_inv_freqs(axis_dim: int, theta: float = 10000) -> torch.Tensor:
    """Inverse frequencies of one axis: ``1 / theta^(fp32(2i) / axis_dim)``, fp32 ``[axis_dim/2]``.

    Raises:
        ValueError: ``axis_dim`` is odd.
    """
    if axis_dim % 2:
        raise ValueError(f"RoPE axis size must be even, got {axis_dim}")
    exponents = torch.arange(0, axis_dim, 2).to(torch.float32).div(axis_dim)  # [axis_dim/2]
    return 1.0 / torch.pow(theta, exponents)


def image_positions(h: int, w: int) -> torch.Tensor:
    """Integer positions (frame, row, column) of the h·w image tokens, row-major: int64 ``[h·w, 3]``."""
    rows = torch.arange(h) - (h - h // 2)  # i − ⌈h/2⌉
    cols = torch.arange(w) - (w - w // 2)  # j − ⌈w/2⌉
    pos = torch.zeros(h, w, 3, dtype=torch.int64)
    pos[:, :, 1] = rows[:, None]
    pos[:, :, 2] = cols[None, :]
    return pos.reshape(h * w, 3)  # [N, 3]


def text_positions(h: int, w: int, txt_len: int) -> torch.Tensor:
    """Positions of the text tokens: (p, p, p), p = max(⌊h/2⌋, ⌊w/2⌋) + k; int64 ``[L, 3]``."""
    p = max(h // 2, w // 2) + torch.arange(txt_len, dtype=torch.int64)  # [L]
    return p[:, None].expand(txt_len, 3).clone()  # [L, 3]


def rope_table(positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000) -> torch.Tensor:
    """Complex rotations for integer ``positions [S, 3]``: complex64 ``[S, sum(axes_dims)/2]``.

    Each entry is ``polar(1, fp32(p_a) · inv_a[i])`` with the fp32 product of §2.2 (the same
    product ``torch.outer`` forms in diffusers), axes concatenated in order.
    """
    parts = []
    for a, dim in enumerate(axes_dims):
        angles = positions[:, a].to(torch.float32)[:, None] * rope_inv_freqs(dim, theta)[None, :]  # [S, dim/2]
        parts.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(parts, dim=1)  # [S, Dh/2]


@functools.lru_cache(maxsize=64)
def _cached_tables(
    h: int, w: int, txt_len: int, axes_dims: tuple[int, ...], theta: float, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    img = rope_table(image_positions(h, w), axes_dims, theta)  # [N, Dh/2]
    txt = rope_table(text_positions(h, w, txt_len), axes_dims, theta)  # [L, Dh/2]
    return img.to(device), txt.to(device)


def rope_tables(
    img_grid: tuple[int, int],
    txt_len: int,
    *,
    axes_dims: tuple[int, ...] = (16, 56, 56),
    theta: float = 10000,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and text RoPE tables for one forward (numerics §2.2).

    Args:
        img_grid: (h, w) patch grid; N = h·w.
        txt_len: padded text length L (RoPE ignores the mask, as diffusers 0.42.1 does).
        axes_dims: per-axis sizes (frame, row, column), each even.
        theta: RoPE base.
        device: where the tables are placed (computed on the CPU first).

    Returns:
        ``(img [N, Dh/2], txt [L, Dh/2])``, complex64, cached (do not modify in place).
    """
    h, w = (int(v) for v in img_grid)
    return _cached_tables(h, w, int(txt_len), tuple(int(a) for a in axes_dims), theta, str(torch.device(device)))
