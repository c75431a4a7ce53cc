"""Condition images of the edit pipelines: how their packed latents join the image stream.

    >>> x, cond = torch.zeros(2, 24, 64), torch.zeros(2, 35, 64)   # noisy 4x6, condition 5x7
    >>> x_all, grids = join_conditions(x, cond, [(5, 7)], torch.float32)
    >>> x_all.shape, grids
    (torch.Size([2, 59, 64]), ((5, 7),))

``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` (diffusers 0.42.1) hand the
transformer, at every step and for both CFG branches, ``hidden_states = cat([latents,
image_latents], dim=1)``: the noisy tokens first, then each condition image's packed tokens in
order (``image_latents`` is the per-image packed VAE latents concatenated along the tokens), with
``img_shapes = [[(1, h, w), (1, h_1, w_1), ...]] * B`` and the same timestep for every token.
The transformer runs every operator on all ``N + Nc`` image rows (``model.mmdit``); the RoPE table
puts condition image k at frame position k and moves the text positions past the largest image
(``model.rope``); the pipeline keeps ``noise_pred[:, :N]``. The condition latents never change
between steps: only the noisy rows are sampled.

The capture identity of the extra rows is the scope field ``cond_grids`` (the sampler sets it
beside ``img_grid``; ``drifttool.capture.layout`` names the rows ``("cond", k, i, j)``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from drifttool.errors import UnsupportedConfigError


def normalize_grids(cond_grids: Sequence[Sequence[int]] | None) -> tuple[tuple[int, int], ...]:
    """``cond_grids`` as a tuple of ``(h, w)`` int pairs (empty for None).

    Raises:
        UnsupportedConfigError: an entry that is not two positive ints.
    """
    out = []
    for g in cond_grids or ():
        pair = tuple(int(v) for v in g)
        if len(pair) != 2 or min(pair) < 1:
            raise UnsupportedConfigError(f"a condition image's patch grid must be (h, w) with h, w >= 1, "
                                         f"got {tuple(g)}")
        out.append(pair)
    return tuple(out)


def condition_rows(cond_grids: Sequence[Sequence[int]]) -> int:
    """Nc = Σ h_k·w_k, the condition tokens of ``cond_grids``."""
    return sum(int(h) * int(w) for h, w in cond_grids)


def join_conditions(
    x: torch.Tensor, cond: torch.Tensor | None, cond_grids: Sequence[Sequence[int]], dtype: torch.dtype
) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """The image stream ``[x | cond]`` of one forward and the normalised condition grids.

    Args:
        x: noisy packed latents ``[B, N, C]`` in the model dtype.
        cond: packed condition latents ``[B, Nc, C]`` in ``dtype`` (the model dtype W), or None.
        cond_grids: (h_k, w_k) per condition image; Σ h_k·w_k must be Nc. Empty without ``cond``.
        dtype: the model dtype W.

    Returns:
        ``(cat([x, cond], dim=1) [B, N + Nc, C], grids)``; ``(x, ())`` without ``cond``.

    Raises:
        UnsupportedConfigError: grids without ``cond`` or the reverse, a shape, dtype or device
            that does not match ``x``, or Nc ≠ Σ h_k·w_k.
    """
    grids = normalize_grids(cond_grids)
    if cond is None:
        if grids:
            raise UnsupportedConfigError(f"condition grids {grids} given without condition latents")
        return x, ()
    bad = []
    if not grids:
        bad.append("condition latents need the patch grid of each condition image (cond_grids)")
    if cond.dim() != 3 or cond.shape[0] != x.shape[0] or cond.shape[2] != x.shape[-1]:
        bad.append(f"cond must be [{x.shape[0]}, Nc, {x.shape[-1]}], got {tuple(cond.shape)}")
    elif grids and cond.shape[1] != condition_rows(grids):
        bad.append(f"cond has Nc={cond.shape[1]} tokens but the condition grids {list(grids)} "
                   f"give {condition_rows(grids)}")
    if cond.dtype != dtype:
        bad.append(f"cond ({cond.dtype}) must be in the model dtype {dtype}")
    if cond.device != x.device:
        bad.append(f"cond is on {cond.device}, x on {x.device}")
    if bad:
        raise UnsupportedConfigError("MMDiT.forward: " + "; ".join(bad))
    return torch.cat([x, cond], dim=1), grids
