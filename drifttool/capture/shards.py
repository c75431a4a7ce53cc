"""Digest v2 of a sharded operator output from its ranks' partials: no tensor moves for capture.

    >>> place = {1: AxisShard(size=4096, pieces=((0, 1024, 2048),))}   # SP rank 2 of 4: rows
    >>> parts, payload = shard_payload(site, out_shard, "BS.", place, keep_rows=False)
    >>> total = reduce_payloads(torch.stack(gather_list(payload, group)),   # tiny, rank order
    ...                         payload_widths(parts, keep_rows=False))
    >>> pending = combine_payloads(parts, total, torch.bfloat16, keep_rows=False)
    >>> rec.capture_digested(site, list(zip(parts, pending)))   # on the owning rank

A rank under a TP/SP layout holds a block of an operator output: some rows of the sequence axis
(SP) and some heads or channels (TP). ``Placement`` says where its block sits in the logical
(unsharded) output, axis by axis, as pieces ``(local start, length, logical start)``; a piece
list may leave logical positions to other ranks (the text rows every SP rank repeats are owned
by SP rank 0 only), but across the ranks of a layout every logical element is held by exactly
one piece.

Digest v2 (``capture.digest``) is a sum of per-element terms keyed by global indices, so each
rank digests its own block into a *payload*, one per logical sample's canonical part, and the
payloads of every rank add up to the digest of the logical part (``combine_payloads``):

=========  ===============================================================================
word 0     ``V`` without header, over this rank's elements (mod p): ``Σ_r A[r]T_rank[r] + …``
words 1-4  fp64 bits of Σx², max, min, count of NaN/±inf over this rank's elements
words 5-   (``keep_rows``, L2) the row digests ``T`` of every logical row, 0 where this rank
           holds none of the row (so payloads of equal length on every rank add mod p)
=========  ===============================================================================

``V``, ``T``, the count, max and min combine exactly; Σx² adds in rank order, so the record's
``l2`` (an fp64 summary, never compared for identity: ``diff.consistency``) may differ from one
device's in the last bits. The payload layout is ``PendingDigest.vec``'s, so the combined
payload is read back with the rest of the step (``digest.materialize``). On a CUDA device the
blocks are digested by the generic device path, not the Triton row kernel (which keys columns
from 0).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from drifttool import digestcore as core
from drifttool.capture.digest import (PendingDigest, _halves, _level2, _row_sums, _stats_vec,
                                      dtype_name)
from drifttool.capture.layout import RowMap, TAGS, _segments, _take, cond_grids_of

_STATS = 4


@dataclass(frozen=True)
class AxisShard:
    """How one axis of a rank's block sits in the logical output.

    Attributes:
        size: the logical output's length along the axis.
        pieces: ``(local start, length, logical start)``: local positions
            ``[local start, local start + length)`` are logical ``[logical start, …)``. Local
            positions in no piece are not this rank's to digest (another rank owns them).
    """

    size: int
    pieces: tuple[tuple[int, int, int], ...]

    def shifted(self, offset: int, size: int) -> "AxisShard":
        """This placement inside a larger axis of ``size`` where this axis starts at ``offset``
        (an SP shard of heads inside a TP rank's heads)."""
        return AxisShard(size, tuple((a, n, g + offset) for a, n, g in self.pieces))


Placement = dict[int, AxisShard]
"""Output axis -> its ``AxisShard``; axes not named are held whole."""


@dataclass(frozen=True)
class LogicalPart:
    """One logical sample's canonical part of the unsharded output (what ``layout.Part`` would
    describe on one device): ``sample``, canonical ``shape``, ``row_axis`` and ``rows``."""

    sample: int
    shape: tuple[int, ...]
    row_axis: int | None
    rows: RowMap | None


def logical_shape(shape: tuple[int, ...], placement: Placement) -> tuple[int, ...]:
    """The unsharded output's shape: ``shape`` with each placed axis at its logical size."""
    return tuple(placement[a].size if a in placement else n for a, n in enumerate(shape))


def logical_parts(site: dict[str, Any], shape: tuple[int, ...], layout: str) -> list[LogicalPart]:
    """The canonical parts ``layout.canonicalize`` cuts from an output of logical ``shape``:
    their samples, shapes and row maps, from the shape alone (no tensor, not even a meta one:
    meta kernels would import torch's symbolic-shape stack on the first call).

    Raises:
        ValueError: as ``canonicalize``.
    """
    if len(layout) != len(shape) or not set(layout) <= TAGS or layout.count("B") > 1:
        raise ValueError(f"layout {layout!r} does not fit a {len(shape)}-axis tensor (tags BSK.)")
    stream = site.get("stream", "none")
    grid = site.get("img_grid")
    grid = None if grid is None else (int(grid[0]), int(grid[1]))
    samples, txt_lens, txt_starts = site.get("samples"), site.get("txt_lens"), site.get("txt_starts")
    bax = layout.find("B")
    nb = shape[bax] if bax >= 0 else 1
    if bax >= 0:
        for name, seq in (("samples", samples), ("txt_lens", txt_lens), ("txt_starts", txt_starts)):
            if seq is not None and len(seq) != nb:
                raise ValueError(f"site[{name!r}] has {len(seq)} entries for batch size {nb}")
    tags = [t for i, t in enumerate(layout) if i != bax]
    sizes = [n for i, n in enumerate(shape) if i != bax]
    row_axis = tags.index("S") if "S" in tags else None
    parts = []
    for b in range(nb):
        txt_len = None if bax < 0 or txt_lens is None else int(txt_lens[b])
        t0 = 0 if bax < 0 or txt_starts is None else int(txt_starts[b])
        dims, rowmap = [], None
        for axis, (tag, n) in enumerate(zip(tags, sizes)):
            if tag in "SK":
                segs, m = _segments(tag, stream, n, txt_len, grid, t0, cond_grids_of(site))
                n = sum(max(0, z - a) for a, z in segs)
                rowmap = m if axis == row_axis else rowmap
            dims.append(n)
        sample = -1 if bax < 0 else (int(samples[b]) if samples is not None else b)
        parts.append(LogicalPart(sample, tuple(dims), row_axis, rowmap))
    return parts


def _axis_runs(tag: str, stream: str, shard: AxisShard, txt_len, grid,
               txt_start: int) -> list[tuple[int, int, int]]:
    """``(local start, length, canonical start)`` of this rank's positions along one placed axis
    of a batch row: S/K axes keep their canonical segments (text rows, image rows), others all."""
    pieces, size = shard.pieces, shard.size
    if tag in "SK":
        segs, _ = _segments(tag, stream, size, txt_len, grid, txt_start)
    else:
        segs = [(0, size)]
    runs, base = [], 0
    for s0, s1 in segs:
        for a, n, g in pieces:
            lo, hi = max(s0, g), min(s1, g + n)
            if hi > lo:
                runs.append((a + lo - g, hi - lo, base + lo - s0))
        base += s1 - s0
    return runs


def _block_payload(block: torch.Tensor, row_axis: int | None, row_offset: int, col_offset: int,
                   n_rows: int, keep_rows: bool) -> torch.Tensor:
    """The payload (module docstring) of one contiguous block of a canonical part."""
    wpe = core.words_per_element(dtype_name(block.dtype))
    rows = _row_sums(_halves(block, row_axis), col_offset * wpe)
    v = _level2(rows, row_offset).reshape(1)
    out = [v, _stats_vec(block).view(torch.int64)]
    if keep_rows:
        full = torch.zeros(n_rows, dtype=torch.int64, device=rows.device)
        full[row_offset:row_offset + rows.shape[1]] = rows[0].to(full.device)
        out.append(full)
    return torch.cat([t.to(rows.device) for t in out])


def _identity(n: int, device: torch.device) -> torch.Tensor:
    """The payload of no elements: V 0, Σx² 0, max −inf, min +inf, count 0, rows 0."""
    stats = torch.tensor([0.0, -math.inf, math.inf, 0.0], dtype=torch.float64, device=device)
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=device), stats.view(torch.int64),
                      torch.zeros(n, dtype=torch.int64, device=device)])


def payload_widths(parts: list[LogicalPart], keep_rows: bool) -> list[int]:
    """Each part's payload length in ``shard_payload``'s concatenation."""
    return [1 + _STATS + (p.shape[p.row_axis] if keep_rows and p.row_axis is not None else 0)
            for p in parts]


def reduce_payloads(payloads: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Combine concatenated payloads ``int64 [ranks, Σ widths]`` (one row per rank, or per
    block of one rank) into one ``[Σ widths]``: ``V`` and the row digests add mod p, Σx² and
    the count add (in row order), max and min of the maxima and minima. ``widths``: each
    part's payload length (``payload_widths``)."""
    if payloads.shape[0] == 1 or not widths:
        return payloads[0] if payloads.shape[0] == 1 else payloads.new_zeros(0)
    total = core.modsum(payloads, 0)
    dev = payloads.device
    starts = torch.tensor([0, *itertools.accumulate(widths)][:-1], dtype=torch.int64, device=dev)
    idx = (starts[:, None] + 1 + torch.arange(_STATS, device=dev)).reshape(-1)
    st = payloads[:, idx].reshape(payloads.shape[0], -1, _STATS).contiguous().view(torch.float64)
    stats = torch.stack([st[..., 0].sum(0), st[..., 1].amax(0), st[..., 2].amin(0),
                         st[..., 3].sum(0)], -1)
    total[idx] = stats.view(torch.int64).reshape(-1)
    return total


def shard_payload(site: dict[str, Any], tensor: torch.Tensor, layout: str, placement: Placement,
                  keep_rows: bool) -> tuple[list[LogicalPart], torch.Tensor]:
    """This rank's payload for each canonical part of the logical output.

    Args:
        site: the call's ``Runtime.site`` (stream, samples, text rows and grid of the logical
            output).
        tensor: this rank's block of the output (``len(layout)`` axes).
        layout: the output's axis tags (``capture.layout``); the batch axis is never placed.
        placement: where ``tensor`` sits in the logical output.
        keep_rows: carry the L2 row digests.

    Returns:
        The logical parts and ``int64 [Σ L_part]`` (their payloads concatenated, on the
        tensor's device): the same length on every rank of the layout.

    Raises:
        ValueError: the layout does not fit, the batch axis is placed, or a block's elements are
            not one contiguous column range of a canonical row (two placed axes besides rows).
    """
    if len(layout) != tensor.dim() or not set(layout) <= TAGS or layout.count("B") > 1:
        raise ValueError(f"layout {layout!r} does not fit a {tensor.dim()}-axis tensor (tags BSK.)")
    bax = layout.find("B")
    if bax in placement:
        raise ValueError("the batch axis of a capture cannot be sharded")
    full = logical_shape(tuple(tensor.shape), placement)
    parts = logical_parts(site, full, layout)
    stream = site.get("stream", "none")
    grid = site.get("img_grid")
    grid = None if grid is None else (int(grid[0]), int(grid[1]))
    txt_lens, txt_starts = site.get("txt_lens"), site.get("txt_starts")
    axes = [a for a in range(tensor.dim()) if a != bax]  # the part's axes, in order
    tags = [layout[a] for a in axes]
    row_pos = tags.index("S") if "S" in tags else None
    placed = [i for i, a in enumerate(axes) if a in placement]
    cols = [i for i in placed if i != row_pos]
    if len(cols) > 1:
        raise ValueError(f"placed axes {[axes[i] for i in cols]} besides the rows: a block is not "
                         "one column range of a canonical row")
    payloads = []
    for b, part in enumerate(parts):
        t = tensor.select(bax, b) if bax >= 0 else tensor
        txt_len = None if bax < 0 or txt_lens is None else int(txt_lens[b])
        t0 = 0 if bax < 0 or txt_starts is None else int(txt_starts[b])
        for i, tag in enumerate(tags):  # axes held whole: canonical selection as on one device
            if i not in placed and tag in "SK":
                segs, _ = _segments(tag, stream, t.shape[i], txt_len, grid, t0, cond_grids_of(site))
                t = _take(t, i, segs)
        runs = {i: _axis_runs(tags[i], stream, placement[axes[i]], txt_len, grid, t0) for i in placed}
        n_rows = part.shape[row_pos] if row_pos is not None else 1
        blocks = []
        for combo in itertools.product(*(runs[i] for i in placed)):
            block = t
            at = dict(zip(placed, combo))
            for i, (a, n, _) in at.items():
                block = block.narrow(i, a, n)
            row_off = at[row_pos][2] if row_pos in at else 0
            blocks.extend(_column_blocks(block, part.shape, row_pos, cols, at, row_off, n_rows,
                                         keep_rows))
        if not blocks:
            payloads.append(_identity(payload_widths([part], keep_rows)[0] - 1 - _STATS, tensor.device))
        else:
            payloads.append(reduce_payloads(torch.stack(blocks), [blocks[0].shape[0]]))
    out = torch.cat(payloads) if payloads else torch.zeros(0, dtype=torch.int64, device=tensor.device)
    return parts, out


def _column_blocks(block: torch.Tensor, shape: tuple[int, ...], row_pos: int | None,
                   cols: list[int], at: dict, row_off: int, n_rows: int,
                   keep_rows: bool) -> list[torch.Tensor]:
    """Payloads of ``block`` (narrowed on its placed axes) cut into runs that are contiguous in a
    canonical row's elements: the row axis first, then the others in order."""
    keep = keep_rows and row_pos is not None
    if not cols:
        return [_block_payload(block, row_pos, row_off, 0, n_rows, keep)]
    c = cols[0]
    others = [i for i in range(len(shape)) if i != row_pos]
    k = others.index(c)
    inner = math.prod(shape[i] for i in others[k + 1:])
    start = at[c][2]
    out = []
    for idx in itertools.product(*(range(shape[i]) for i in others[:k])):
        sub = block
        for i, j in zip(others[:k], idx):
            sub = sub.narrow(i, j, 1)
        lead = 0
        for i, j in zip(others[:k], idx):
            lead = lead * shape[i] + j
        col = (lead * shape[c] + start) * inner
        out.append(_block_payload(sub, row_pos, row_off, col, n_rows, keep))
    return out


def combine_payloads(parts: list[LogicalPart], total: torch.Tensor, dtype: torch.dtype,
                     keep_rows: bool) -> list[PendingDigest]:
    """The pending digests of the logical parts from the payload every rank's payloads reduced
    to (``reduce_payloads`` over the ranks).

    Args:
        parts: ``shard_payload``'s parts (the same on every rank).
        total: ``int64 [Σ L_part]``.
        dtype: the output's dtype.
        keep_rows: as given to ``shard_payload``.
    """
    name = dtype_name(dtype)
    out, at = [], 0
    for p, n in zip(parts, payload_widths(parts, keep_rows)):
        keep = keep_rows and p.row_axis is not None
        out.append(PendingDigest(name, p.shape, core.header_value(name, p.shape), math.prod(p.shape),
                                 keep, total[at:at + n]))
        at += n
    return out


# -- every rank's copy checked: the ``rank_digests`` and ``rank_disagree`` columns --------------


@dataclass(frozen=True)
class RankCheck:
    """What the owning rank learned of one logical part from every rank of a TP/SP layout.

    Attributes:
        digests: ``int64 [world]``: each global rank's payload word 0 (``V`` of what it holds of
            the part: its block of a sharded output, its whole copy of a replicated one; 0 for a
            rank that holds none), on the capture device (read back at flush).
        refs: per global rank, the rank whose ``V`` it must equal (the rank at coordinate 0 of
            every mesh dimension that replicates the output, the others unchanged), or −1 where
            the rank is not one of the record's ranks (another CFG branch).
        copies, copy_refs: likewise for a part of the output every rank repeats but only one
            rank's block holds (the text rows of a joint output under SP): ``int64 [world]``,
            each rank's ``V`` of its own copy, and the ranks to compare; ``None`` if none.
    """

    digests: torch.Tensor
    refs: tuple[int, ...]
    copies: torch.Tensor | None = None
    copy_refs: tuple[int, ...] | None = None


def part_words(payload: torch.Tensor, parts: list[LogicalPart], keep_rows: bool) -> torch.Tensor:
    """Word 0 (``V`` without header) of each part's payload in ``shard_payload``'s concatenation:
    ``int64 [len(parts)]``."""
    starts = [0, *itertools.accumulate(payload_widths(parts, keep_rows))][:-1]
    return payload[torch.tensor(starts, dtype=torch.long, device=payload.device)]


def rank_columns(checks: list[RankCheck | None]) -> tuple[Any, Any]:
    """The ``rank_digests`` (``list<uint64>``) and ``rank_disagree`` (``list<int32>``: the ranks
    whose ``V`` differs from their reference's, ascending) columns of op records, null where a
    record has no ``RankCheck``; every device's digests are read back in one transfer."""
    import numpy as np
    import pyarrow as pa

    by_dev: dict[torch.device, list[int]] = {}
    for i, c in enumerate(checks):
        if c is not None:
            by_dev.setdefault(c.digests.device, []).append(i)
    host: dict[int, Any] = {}
    for idx in by_dev.values():
        flat = torch.stack([torch.stack([checks[i].digests, checks[i].digests if checks[i].copies
                                         is None else checks[i].copies]) for i in idx]).cpu().numpy()
        host.update(zip(idx, flat))
    digests, disagree = [], []
    for i, c in enumerate(checks):
        if c is None:
            digests.append(None)
            disagree.append(None)
            continue
        v, copies = host[i]
        bad = {r for r, ref in enumerate(c.refs) if ref >= 0 and v[r] != v[ref]}
        if c.copy_refs is not None:
            bad |= {r for r, ref in enumerate(c.copy_refs) if ref >= 0 and copies[r] != copies[ref]}
        digests.append(v.astype(np.uint64).tolist())
        disagree.append(sorted(bad))
    return (pa.array(digests, type=pa.list_(pa.uint64())),
            pa.array(disagree, type=pa.list_(pa.int32())))
