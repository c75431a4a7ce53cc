"""Integer geometry of the vision tower: resized image sizes, patch positions, attention windows.

    >>> smart_resize(64, 96, factor=28, min_pixels=3136, max_pixels=1003520)
    (56, 84)
    >>> grid = (1, 4, 6)                              # (t, h, w) patches of one image
    >>> patch_positions([grid], merge=2)[:4].tolist() # (row, col) of each patch, merge-block order
    [[0, 0], [0, 1], [1, 0], [1, 1]]
    >>> order, cu = windows([grid], merge=2, window_tokens=4)

Patches are ordered as the image processor emits them (``Qwen2VLImageProcessor`` patchify): by
merged token (row-major over the ``h/m × w/m`` token grid), then the ``m × m`` patches of that
token row-major; images follow each other. The rules are transformers 5.x's
(``image_processing_qwen2_vl.smart_resize``, ``vision_utils.get_vision_position_ids``,
``get_vision_window_index``, ``get_vision_cu_seqlens``), written here as plain index arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from drifttool.errors import UnsupportedConfigError

Grid = tuple[int, int, int]
"""(t, h, w): temporal patches (1 for an image) and the patch grid of one image."""


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size (h, w): both multiples of ``factor``, about the input's aspect
    ratio, h·w within [min_pixels, max_pixels] (Python's round-half-even, then floor or ceil of
    the FP64 rescaled sides, as transformers computes it).

    Raises:
        UnsupportedConfigError: an aspect ratio above 200, or an empty image.
    """
    if min(height, width) < 1:
        raise UnsupportedConfigError(f"an image of {width}x{height} pixels cannot be resized")
    if max(height, width) / min(height, width) > 200:
        raise UnsupportedConfigError(f"image {width}x{height}: aspect ratio above 200 (the processor refuses it)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def check_grids(grids: Sequence[Grid], merge: int) -> list[Grid]:
    """The grids as int triples. Raises ``UnsupportedConfigError`` for an empty grid or sides
    that are not multiples of ``merge``."""
    out = [(int(t), int(h), int(w)) for t, h, w in grids]
    for t, h, w in out:
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise UnsupportedConfigError(f"image grid {(t, h, w)}: sides must be positive multiples of {merge}")
    return out


def merged_tokens(grid: Grid, merge: int) -> int:
    """Language-model tokens of one image: t · (h/m) · (w/m)."""
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """(row, col) of every patch, in patch order: [Σ t·h·w, 2] int64 (each frame repeats the
    image's positions)."""
    rows = []
    for t, h, w in check_grids(grids, merge):
        tok = torch.arange((h // merge) * (w // merge))
        ty, tx = tok // (w // merge), tok % (w // merge)  # [n] merged token (row, col)
        sub = torch.arange(merge * merge)
        sy, sx = sub // merge, sub % merge  # [m²] patch within the token
        r = (ty[:, None] * merge + sy[None, :]).reshape(-1)
        c = (tx[:, None] * merge + sx[None, :]).reshape(-1)
        rows.append(torch.stack([r, c], dim=-1).repeat(t, 1))
    return torch.cat(rows).to(torch.int64)


def image_seqlens(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """``cu_seqlens`` of full attention: each frame of each image is one segment of h·w patches;
    [frames + 1] int32 cumulative boundaries from 0."""
    sizes = [h * w for t, h, w in check_grids(grids, merge) for _ in range(t)]
    return torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def windows(grids: Sequence[Grid], merge: int, window_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window order of the merged tokens and the window segments.

    Each frame's ``h/m × w/m`` token grid is cut into windows of ``window_tokens`` square from
    the top-left (the last row and column of windows may be partial); windows are taken
    row-major, tokens within a window row-major.

    Returns:
        (order [Σ t·(h/m)·(w/m)] int64: the merged token at each window-order position,
        cu_window_seqlens [windows + 1] int32: window boundaries in patches, from 0).
    """
    order, sizes, base = [], [], 0
    ws = window_tokens
    for t, h, w in check_grids(grids, merge):
        gh, gw = h // merge, w // merge
        for f in range(t):
            for y0 in range(0, gh, ws):
                for x0 in range(0, gw, ws):
                    ys = torch.arange(y0, min(y0 + ws, gh))
                    xs = torch.arange(x0, min(x0 + ws, gw))
                    tok = (base + f * gh * gw + ys[:, None] * gw + xs[None, :]).reshape(-1)
                    order.append(tok)
                    sizes.append(tok.numel() * merge * merge)
        base += t * gh * gw
    cu = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return torch.cat(order).to(torch.int64), cu


def token_rows(order: torch.Tensor, merge: int) -> torch.Tensor:
    """Patch rows of a merged-token order: token k brings its m² patches k·m² … k·m² + m² − 1."""
    unit = merge * merge
    return (order[:, None] * unit + torch.arange(unit)[None, :]).reshape(-1)
