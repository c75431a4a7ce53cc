"""Vision-token operators whose bytes no arithmetic choice changes, one function each registered
for ``strict`` and ``production``: the mRoPE positions of prompts with vision tokens
(``te_vision_rope_index``), the vision embeddings put into the ``<|image_pad|>`` rows
(``te_vision_scatter``) and the rotation of q and k by a given cos/sin table
(``te_vision_rope``: three FP32 multiplications and an addition per element, each correctly
rounded; the families differ in the table, ``te_vision_rope_table``).

    >>> pos = te_vision_rope_index(ids, mask, image_id, grids, 2)    # [3, B, L] int64
    >>> x = te_vision_scatter(x, ids, image_id, vision)              # [B, L, D]

Sources: transformers 5.x ``Qwen2_5_VLModel.get_rope_index`` / ``get_vision_position_ids``
(with the image-token runs of ``input_ids`` as the image groups), ``masked_scatter`` of
``Qwen2_5_VLModel.forward``, ``apply_rotary_pos_emb_vision``.
"""

from __future__ import annotations

import torch

import drifttool.ops.specs  # noqa: F401  (the operators implemented here are declared there)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.text_encoder.exact import both


def _runs(flags: list[bool]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal flags: (flag, start, stop)."""
    runs, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((flags[start], start, i))
            start = i
    return runs


@both("te_vision_rope_index", kernel="rope_index.runs")
def te_vision_rope_index(ids: torch.Tensor, attention_mask: torch.Tensor | None, image_token_id: int,
                         grids: torch.Tensor, merge: int) -> torch.Tensor:
    """Multimodal RoPE positions (t, h, w) of prompts whose ``<|image_pad|>`` runs hold images.

    Per prompt, over its valid tokens (right padding): a text run of n tokens takes positions
    p … p+n−1 on all three axes; the k-th image run (images numbered across the batch in order)
    with grid (t, h, w) takes, for merged token (i, y, x) of its (t, h/m, w/m) grid, (p + i,
    p + y, p + x), then p grows by max(h, w)/m. Padding positions are 0.

    Args:
        ids: [B, L] int64.  attention_mask: [B, L] 0/1 or None (all valid).
        image_token_id: the ``<|image_pad|>`` id.  grids: [n_images, 3] int64 (t, h, w) in
            patches.  merge: the spatial merge size m.
    Returns:
        [3, B, L] int64.
    Raises:
        UnsupportedConfigError: an image run whose length is not its grid's t·(h/m)·(w/m), or
            runs and grids that do not pair up.
    """
    b, n = ids.shape
    valid = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    rows = [tuple(int(v) for v in g) for g in grids.tolist()]
    out = torch.zeros(3, b, n, dtype=torch.int64)
    k = 0
    for row in range(b):
        tokens = ids[row].cpu()[valid[row]]
        parts, p = [], 0
        for image, start, stop in _runs((tokens == image_token_id).tolist()):
            if not image:
                parts.append(torch.arange(p, p + stop - start).expand(3, -1))
                p += stop - start
                continue
            if k >= len(rows):
                raise UnsupportedConfigError(f"te_vision_rope_index: more image runs than the {len(rows)} image grids")
            t, h, w = rows[k]
            gt, gh, gw = t, h // merge, w // merge
            if stop - start != gt * gh * gw:
                raise UnsupportedConfigError(f"te_vision_rope_index: image {k} has {stop - start} tokens, its grid "
                                             f"{rows[k]} needs {gt * gh * gw}")
            ti, yi, xi = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            parts.append(torch.stack([ti, yi, xi]).reshape(3, -1) + p)
            p += max(h, w) // merge
            k += 1
        if parts:
            out[:, row, valid[row]] = torch.cat(parts, dim=1)
    if k != len(rows):
        raise UnsupportedConfigError(f"te_vision_rope_index: {len(rows)} image grids for {k} image runs")
    return out.to(ids.device)


@both("te_vision_scatter", kernel="masked_scatter")
def te_vision_scatter(x: torch.Tensor, ids: torch.Tensor, image_token_id: int, vision: torch.Tensor) -> torch.Tensor:
    """The token embeddings with the ``<|image_pad|>`` rows replaced by the vision embeddings, in
    row-major order: x [B, L, D], ids [B, L], vision [Nv, D] (cast to x's dtype) → [B, L, D].

    Raises:
        UnsupportedConfigError: Nv is not the number of ``<|image_pad|>`` tokens, or widths differ.
    """
    mask = ids == image_token_id  # [B, L]
    if int(mask.sum()) != vision.shape[0] or vision.shape[-1] != x.shape[-1]:
        raise UnsupportedConfigError(f"te_vision_scatter: {int(mask.sum())} image tokens of width {x.shape[-1]}, "
                                     f"{vision.shape[0]} vision embeddings of width {vision.shape[-1]}")
    return x.masked_scatter(mask.unsqueeze(-1).expand_as(x), vision.to(x.dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[…, D] → [−x[D/2:], x[:D/2]]."""
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


@both("te_vision_rope", kernel="rope_rotate_half.fp32")
def te_vision_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q·cos + rotate_half(q)·sin, the same for k) in FP32, each cast back to its dtype:
    q, k [N, H, Dh], cos/sin [N, Dh] (FP32) → ([N, H, Dh], [N, H, Dh])."""
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    return ((qf * c) + (rotate_half(qf) * s)).to(q.dtype), ((kf * c) + (rotate_half(kf) * s)).to(k.dtype)
