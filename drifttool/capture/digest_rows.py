"""Digests whose level 1 ran per row on a CUDA device, finished for a whole step at once; and
digest v2's key tables on a device, which every device path shares.

    table = gpu_rows.row_table(flat)                      # [rows, C] -> per-row partial sums
    pending = [pending_rows(table, dtype, part.shape, part.ranges, keep_rows) for part in parts]
    RowTables(pending)()  # V without header, kept row digests, fp64 [n, 4] stats

On a CUDA device the recorder digests a whole operator output once per row of its flat view
(``gpu_rows.row_table``, one Triton pass) and cuts each logical sample's part from that table as
row ranges (``layout.flat_parts``); ``RowTables`` then computes level 2
(``V = Σ_r A[r] T[r] + A'[r] T'[r]``, ``drifttool.capture.digest``) and the summaries of every
pending record of a step, vectorised, with one read-back. ``drifttool.capture.digest.materialize`` calls it; the values are
the canonical path's (``digest_pending``), bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from drifttool import digestcore as core
from drifttool.capture import gpu_rows
from drifttool.capture.dtypes import dtype_name
from drifttool.digestcore import ROW_CHUNK

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
"""Key tables replaced by a larger one, kept alive: a CUDA graph captured before the growth reads
the old table at its address at every replay (``model.graphs``)."""
_CONSTS: dict[torch.device, dict[str, torch.Tensor]] = {}


def key_table(kind: str, n: int, device: torch.device) -> torch.Tensor:
    """``core.np_table(kind, n)`` on ``device``: cached, grown by doubling, moved once."""
    have = _TABLES.get((kind, device))
    if have is None or have.shape[-1] < n:
        if have is not None:
            _RETIRED.append(have)
        have = torch.from_numpy(core.np_table(kind, n)).to(device)
        _TABLES[(kind, device)] = have
    return have


def key_consts(device: torch.device) -> dict[str, torch.Tensor]:
    """``core.shift_consts`` on ``device``, cached."""
    if device not in _CONSTS:
        _CONSTS[device] = core.shift_consts(lambda a: torch.from_numpy(a).to(device))
    return _CONSTS[device]


@dataclass(frozen=True)
class PendingRows:
    """A digest whose level 1 ran on a CUDA device per row of a flat view (one Triton pass,
    ``gpu_rows.row_table``); level 2 and the summary are finished at ``materialize``, for all
    pending records of a step at once.

    Attributes:
        dtype, shape, header, numel, keep_rows: as ``PendingDigest`` (of the canonical part).
        table: ``(rows int64 [S, R, 2], stats float64 [S, R, 4])`` of the whole flat view (its
            ``S`` column splits, ``gpu_rows.row_table``), shared by every part cut from it.
        ranges: the part's rows of the flat view, in canonical order (``layout.FlatPart``).
    """

    dtype: str
    shape: tuple[int, ...]
    header: int
    numel: int
    keep_rows: bool
    table: tuple[torch.Tensor, torch.Tensor]
    ranges: tuple[tuple[int, int], ...]


def pending_rows(table: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
                 shape: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                 keep_rows: bool) -> PendingRows:
    """A ``PendingRows`` for the canonical part ``shape`` made of ``ranges`` rows of ``table``.

    Raises:
        ValueError: more than ``ROW_CHUNK`` rows (level 2 sums them in one int64 block).
    """
    shape, ranges = tuple(shape), tuple(ranges)
    n = sum(z - a for a, z in ranges)
    if n > ROW_CHUNK:
        raise ValueError(f"a part of {n} rows exceeds the {ROW_CHUNK} rows of one level-2 block")
    name = dtype_name(dtype)
    return PendingRows(name, shape, core.header_value(name, shape), math.prod(shape), keep_rows,
                       table, ranges)


def device_rows(t: torch.Tensor, row_axis: int | None) -> PendingRows | None:
    """``digest_pending`` through the Triton row kernel, when ``t`` allows it (``None``: not)."""
    if not gpu_rows.available(t) or t.numel() == 0:
        return None
    x = t.detach()
    if row_axis is not None and x.dim():
        x = x.movedim(row_axis, 0)
        r = x.shape[0]
    else:
        r = 1
    if r > ROW_CHUNK:
        return None
    flat = x.contiguous().reshape(r, -1)
    return pending_rows(gpu_rows.row_table(flat), t.dtype, tuple(t.shape), ((0, r),),
                        keep_rows=False)


def _segment_sums(x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Exact sums of ``x`` (int64 ``[K, total]``, values in ``[0, 2**43)``) over the column
    segments ``[start, start + length)``: ``[K, n_segments]``. Prefix sums of the low 22 and the
    high 21 bits apart stay below 2**63 for up to 2**41 columns; a segment of at most
    ``ROW_CHUNK`` columns sums below 2**59. No atomics: the same work on any device, in any
    segment layout (``index_add_`` serialises on the few records a step has)."""
    pad = torch.nn.functional.pad
    out = None
    for shift, mask in ((0, (1 << 22) - 1), (22, (1 << 21) - 1)):
        cs = pad(torch.cumsum((x >> shift) & mask, dim=1), (1, 0))
        part = (cs[:, starts + lengths] - cs[:, starts]) << shift
        out = part if out is None else out + part
    return out


def level2_products(t_rows: torch.Tensor, keys: torch.Tensor, local: torch.Tensor,
                    rcum: torch.Tensor, rec: torch.Tensor, c: dict[str, torch.Tensor]) -> torch.Tensor:
    """Level 2's limb products summed per record, in torch ops on any device: ``int64 [9, n]``,
    ``u[3i + j, r] = Σ_k Σ_h A_h,i[k] · limb_j(T_h[rcum_r + k])`` (``gpu_rows.level2_products``
    computes the same in one Triton launch). ``t_rows`` ``int64 [total, 2]``; ``keys`` ``int64
    [2, 3, L]``; ``local`` each row's position in its record; ``rcum``, ``rec`` each record's
    first row and row count; ``c`` ``key_consts``."""
    t = t_rows.t()  # [2, total]
    a = keys[:, :, local]  # [2, 3, total]
    tl_ = (t.reshape(2, 1, -1) >> c["s3"]) & ((1 << 21) - 1)  # [2, 3 (j), total]
    prod = (a.reshape(2, 3, 1, -1) * tl_.reshape(2, 1, 3, -1)).sum(0)  # [3 (i), 3 (j), total] < 2**43
    return _segment_sums(prod.reshape(9, -1), rcum, rec)


class RowTables:
    """Level 2 and the summaries of a fixed list of ``PendingRows`` (one device), vectorised over
    every record. The grouping of their row tables and each record's row segments are planned
    once, on the host (and moved to the device), here; each call reads what the tables hold then
    (a CUDA graph's replay rewrites them in place, ``drifttool.model.replay``), in one read-back,
    and returns ``V`` without header (``int64 [n]``), the kept rows per record (``uint64`` or
    ``None``) and the stats (``float64 [n, 4]``, ``summary.stats_vec``).

    On a CUDA device (with Triton) the records' rows, their splits combined, come from one launch
    that reads each table at its address of now (``gpu_rows.gather_rows``): the tables must stay
    where they are between calls. Elsewhere, or with ``fused=False`` (the tests' reference), the
    tables are concatenated per split count, combined (``gpu_rows.combine_splits``) and indexed:
    the same bits."""

    def __init__(self, pending: list[PendingRows], *, fused: bool = True) -> None:
        dev = self._dev = pending[0].table[0].device
        # unique row tables ([S, R, ·] split partials), grouped by split count: each group is
        # concatenated and its splits combined once (normally one group: one split count per run)
        groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        seen: set[int] = set()
        for p in pending:
            if id(p.table[0]) not in seen:
                seen.add(id(p.table[0]))
                groups.setdefault(p.table[0].shape[0], []).append(p.table)
        tables: dict[int, int] = {}
        base = 0
        for group in groups.values():
            for r_t, _ in group:
                tables[id(r_t)] = base
                base += r_t.shape[1]
        self._groups = list(groups.values())
        starts, lens, rec_len = [], [], []
        for p in pending:
            off = tables[id(p.table[0])]
            n = 0
            for a, z in p.ranges:
                starts.append(off + a)
                lens.append(z - a)
                n += z - a
            rec_len.append(n)
        lens_np = np.asarray(lens, np.int64)
        rec_np = self._rec = np.asarray(rec_len, np.int64)
        cum = np.concatenate([[0], np.cumsum(lens_np)[:-1]]).astype(np.int64)
        rcum = self._rcum = np.concatenate([[0], np.cumsum(rec_np)[:-1]]).astype(np.int64)
        meta = torch.from_numpy(np.concatenate([lens_np, np.asarray(starts, np.int64) - cum, rec_np, rcum]))
        if dev.type == "cuda":  # pinned, asynchronous: a pageable copy would block the host
            meta = meta.pin_memory().to(dev, non_blocking=True)
        else:
            meta = meta.to(dev)
        nr, nrec = len(lens_np), len(rec_np)
        self._meta = (meta[:nr], meta[nr:2 * nr], meta[2 * nr:2 * nr + nrec], meta[2 * nr + nrec:])
        self._total = int(lens_np.sum())
        self._keep = [p.keep_rows for p in pending]
        self._plan = None
        if fused and dev.type == "cuda" and gpu_rows.triton is not None:
            order = [t for group in self._groups for t in group]
            which = {id(r_t): i for i, (r_t, _) in enumerate(order)}
            self._plan = gpu_rows.gather_plan(
                order, [(which[id(p.table[0])], a, z - a) for p in pending for a, z in p.ranges])

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The records' rows in torch ops: ``int64 [total, 2]`` (T, T'), ``float64 [total, 4]``
        (stats), what ``gpu_rows.gather_rows`` gives in one launch."""
        d_lens, d_delta = self._meta[:2]
        cat = (lambda ts: torch.cat(ts, 1) if len(ts) > 1 else ts[0])  # noqa: E731
        rows_l, stats_l = [], []
        for group in self._groups:
            r_g, s_g = gpu_rows.combine_splits(cat([g[0] for g in group]), cat([g[1] for g in group]))
            rows_l.append(r_g)
            stats_l.append(s_g)
        total = self._total
        idx = torch.arange(total, device=self._dev, dtype=torch.int64) \
            + torch.repeat_interleave(d_delta, d_lens, output_size=total)
        rows_all = torch.cat(rows_l) if len(rows_l) > 1 else rows_l[0]
        stats_all = torch.cat(stats_l) if len(stats_l) > 1 else stats_l[0]
        return rows_all[idx], stats_all[idx]

    def __call__(self) -> tuple[np.ndarray, list[np.ndarray | None], np.ndarray]:
        dev, total, rec_np, rcum, nrec = self._dev, self._total, self._rec, self._rcum, len(self._rec)
        _, _, d_rec, d_rcum = self._meta
        # [total, 2] T, T' and [total, 4] stats of the records' rows, record after record
        t_rows, s = gpu_rows.gather_rows(self._plan) if self._plan is not None else self._gather()
        keys = key_table("row", int(rec_np.max(initial=0)) or 1, dev)  # [2, 3, L] limbs of A, A'
        c = key_consts(dev)
        if dev.type == "cuda" and gpu_rows.triton is not None:  # one launch, no [9, total] products
            u = gpu_rows.level2_products(t_rows, keys, d_rcum, d_rec).reshape(3, 3, nrec)
        else:
            local = torch.arange(total, device=dev, dtype=torch.int64) \
                - torch.repeat_interleave(d_rcum, d_rec, output_size=total)  # row within its record
            u = level2_products(t_rows, keys, local, d_rcum, d_rec, c).reshape(3, 3, nrec)
        v = core.modsum(core.rot(core.fold(u), c["s2"].reshape(3, 3, 1), c["m2"].reshape(3, 3, 1)), (0, 1))
        red = [torch.segment_reduce(s[:, k], how, lengths=d_rec, unsafe=True, initial=init)
               for k, (how, init) in enumerate((("sum", 0.0), ("max", -math.inf), ("min", math.inf),
                                                ("sum", 0.0)))]
        keep = any(self._keep)
        host = host_numpy(torch.cat([v.view(torch.int64).reshape(-1), torch.stack(red, 1).view(torch.int64).reshape(-1)]
                                    + ([t_rows[:, 0]] if keep else [])))
        st = host[nrec:5 * nrec].view(np.float64).reshape(nrec, 4)
        kept = host[5 * nrec:] if keep else None
        rows = [kept[rcum[i]:rcum[i] + rec_np[i]].astype(np.uint64) if k else None
                for i, k in enumerate(self._keep)]
        return host[:nrec], rows, st


def host_numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` read back to the host as numpy (one host synchronisation). A CUDA tensor goes
    through pinned memory (torch's caching host allocator keeps the block for the next step):
    a copy into pageable memory runs at a fraction of the bus's speed, and an L2 step's row
    digests are large at full size (a 1024² forward's: 19.6 ms into pageable memory on an H100)."""
    if not t.is_cuda:
        return t.cpu().numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()
