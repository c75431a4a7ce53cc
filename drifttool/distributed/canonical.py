"""Canonical collectives: tensors moved between ranks without arithmetic, in rank order.

    >>> full = gather_cat(rows, dim=1, group=sp_group, sizes=[832, 832, 768, 41])
    >>> partials = gather_list(partial, group=tp_group)     # then the fixed tree finishes them

A strict reduction over ranks is never a plain all-reduce (whose order the library chooses): every
rank gathers the partials in rank order and finishes the contract-v2 tree itself, so all ranks
hold the same bytes as one device (design.md, "Scale: devices, ranks, runtimes"). Without a group
(``None``: a dimension of size 1) each function returns its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist




def gather_cat(t: torch.Tensor, dim: int, group: Any, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in rank order (an all-gather: every rank of
    ``group`` calls it and gets the same bytes). ``sizes``: each rank's length along ``dim`` when
    they differ (each part is zero-padded to the longest for the collective and cut back).

    Raises:
        ValueError: ``sizes`` does not give this rank's length.
    """
    if group is None:
        return t
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    dim = dim % t.dim()
    t = t.contiguous()
    if sizes is None:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=dim)
    if len(sizes) != world or sizes[me] != t.shape[dim]:
        raise ValueError(f"gather_cat: sizes {list(sizes)} do not give rank {me}'s length {t.shape[dim]}")
    longest = max(sizes)
    if longest == 0:
        return t
    pad = list(t.shape)
    pad[dim] = longest - t.shape[dim]
    padded = torch.cat([t, t.new_zeros(pad)], dim=dim) if pad[dim] else t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def gather_list(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order."""
    if group is None:
        return [t]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts
