"""Canonical collectives: tensors moved between ranks without arithmetic, in rank order.

    >>> full = gather_cat(rows, dim=1, group=sp_group, sizes=[832, 832, 768, 41])
    >>> partials = gather_list(partial, group=tp_group)     # then the fixed tree finishes them
    >>> parts = all_to_all(sends, shapes, group=sp_group)   # sends[j] to rank j, parts[j] from j

A strict reduction over ranks is never a plain all-reduce (whose order the library chooses): every
rank gathers the partials in rank order and finishes the contract-v2 tree itself, so all ranks
hold the same bytes as one device (design.md, "Scale: devices, ranks, runtimes"). Without a group
(``None``: a dimension of size 1) each function returns its input.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommClock:
    """Wall time spent inside the strict collectives of this process (every rank its own):
    ``seconds`` and ``calls``; bytes received in ``nbytes``; ``capture_seconds`` and
    ``capture_nbytes`` the part spent combining the digest partials of sharded outputs for capture
    (``capturing``). Read by benchmarks to separate communication from compute
    (``benchmarks/bench_layouts.py``) and by tests to see that capture moves no tensor; reset with
    ``reset``."""

    seconds: float = 0.0
    calls: int = 0
    nbytes: int = 0
    capture_seconds: float = 0.0
    capture_nbytes: int = 0
    _capture: bool = False

    def reset(self) -> None:
        self.seconds, self.calls, self.nbytes = 0.0, 0, 0
        self.capture_seconds, self.capture_nbytes = 0.0, 0

    @contextmanager
    def timing(self, nbytes: int = 0) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.calls += 1
            self.nbytes += int(nbytes)
            if self._capture:
                self.capture_seconds += dt
                self.capture_nbytes += int(nbytes)

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Count the collectives in the block as capture's too (``capture_seconds``)."""
        self._capture = True
        try:
            yield
        finally:
            self._capture = False


COMM = CommClock()
"""This process's clock of the collectives in this module and the Ring's P2P passes."""


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
        with COMM.timing(t.numel() * t.element_size() * world):
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
    with COMM.timing(padded.numel() * padded.element_size() * world):
        dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def gather_list(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order."""
    if group is None:
        return [t]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    with COMM.timing(t.numel() * t.element_size() * len(parts)):
        dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def all_to_all(sends: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], group: Any) -> list[torch.Tensor]:
    """The exact all-to-all: ``sends[j]`` goes to rank ``j`` of ``group`` and the result's entry
    ``j`` is what rank ``j`` sent here (shape ``shapes[j]``, the dtype and device of ``sends``);
    the rank's own part is kept as it is. Point-to-point sends and receives in one batch
    (``torch.distributed.batch_isend_irecv``: gloo and NCCL), no arithmetic.

    Raises:
        ValueError: ``sends`` or ``shapes`` do not have one entry per rank.
    """
    if group is None:
        return [sends[0]]
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if len(sends) != world or len(shapes) != world:
        raise ValueError(f"all_to_all: {len(sends)} sends and {len(shapes)} shapes for {world} ranks")
    like = sends[me]
    got = [like if j == me else torch.empty(tuple(shapes[j]), dtype=like.dtype, device=like.device)
           for j in range(world)]
    ops = []
    for j in range(world):
        if j != me:
            peer = dist.get_global_rank(group, j)
            ops.append(dist.P2POp(dist.isend, sends[j].contiguous(), peer, group))
            ops.append(dist.P2POp(dist.irecv, got[j], peer, group))
    if ops:
        with COMM.timing(sum(g.numel() * g.element_size() for j, g in enumerate(got) if j != me)):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    return got


class _GatherReplicated(torch.autograd.Function):
    """``gather_list`` / ``gather_cat`` whose consumer runs replicated on every rank of the group
    (the sampler after CFG-parallel branches, ``proj_out``'s rows under SP): the gradient of this
    rank's part is its own slice of the (equal) output gradient — no arithmetic, no collective."""

    @staticmethod
    def forward(ctx, t, group, dim, sizes):
        me = dist.get_rank(group)
        ctx.at = (dim, sum(sizes[:me]), sizes[me]) if sizes is not None else None
        ctx.me = me
        if sizes is None:
            return tuple(gather_list(t, group))
        return gather_cat(t, dim, group, sizes)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.at is None:
            return grads[ctx.me], None, None, None
        dim, start, n = ctx.at
        return grads[0].narrow(dim, start, n), None, None, None


def gather_list_replicated(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """``gather_list`` for a consumer every rank of ``group`` runs the same way: differentiable,
    the backward hands this rank the gradient of its own part."""
    if group is None:
        return [t]
    return list(_GatherReplicated.apply(t, group, 0, None))


def gather_cat_replicated(t: torch.Tensor, dim: int, group: Any, sizes: Sequence[int]) -> torch.Tensor:
    """``gather_cat`` (rank order, ``sizes`` per rank) for a consumer every rank of ``group`` runs
    the same way: differentiable, the backward narrows the gradient to this rank's part."""
    if group is None:
        return t
    return _GatherReplicated.apply(t, group, dim % t.dim(), list(sizes))
