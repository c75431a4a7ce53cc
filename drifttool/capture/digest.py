"""Digest v2 of tensors: an exact keyed hash mod 2**61 - 1, computed on the tensor's device,
row-resolvable and shard-combinable.

    >>> d = digest_tensor(torch.tensor([[3.0, -0.0], [4.0, 0.0]]), row_axis=0)
    >>> d.dtype, d.shape, 0 <= d.digest < P, d.rows.dtype, len(d.rows)
    ('float32', (2, 2), True, dtype('uint64'), 2)
    >>> d.nonfinite, d.l2, d.maxabs
    (0, 5.0, 4.0)

Definition (design.md, "Digests"; docs/digest.md). All arithmetic is exact,
modulo the Mersenne prime ``p = 2**61 - 1``.

* Words. A canonical tensor of dtype D and shape (R, …) — the row axis moved first; a tensor
  without a row axis is one row, R = 1 — is R rows of C words. An element of 1, 2 or 4 bytes is
  one word (its unsigned bit pattern); an 8-byte element is two words (low 32 bits, then high);
  complex64 is two 4-byte words (real, imaginary). Word column ``c = e · words_per_element + j``
  for element ``e`` of the row (row-major). So +0/−0 and NaN payloads differ, and a TP shard
  holding a contiguous range of columns knows their global indices.
* Keys. ``B[c]``, ``B'[c]`` (columns), ``A[r]``, ``A'[r]`` (rows) and ``H[c]`` (header) are
  ``splitmix64(seed_family + index) mod p`` (numpy uint64, wrapping), with the fixed seeds of
  ``drifttool.digestcore.SEEDS``: functions of the global index only.
* Row digests. ``T[r] = Σ_c B[c] w[r, c]`` and ``T'[r] = Σ_c B'[c] w[r, c]`` (mod p). The L2 row
  digest of row r is ``T[r]``.
* Record digest. ``V = Σ_r (A[r] T[r] + A'[r] T'[r]) + Σ_c H[c] h[c]`` (mod p), where the header
  row (r = −1) holds the words ``h = [dtype code, ndim, d0, d1, …]`` of the canonical shape, so
  V pins dtype and shape. ``V`` is stored in the ``digest`` column (uint64, in ``[0, p)``).

Collision bound. Fix two distinct tensors X ≠ Y chosen independently of the keys; model the keys
as independent and uniform on ``[0, p)``.
* Row digests: if row r differs, ``T_X[r] − T_Y[r] = Σ_c B[c] (x[r,c] − y[r,c])`` is a nonzero
  linear form in the ``B`` (word differences are nonzero mod p since words are < 2**32 < p), so
  it vanishes with probability exactly ``1/p < 2**-60`` (fix all keys but one with a nonzero
  coefficient: one value of that key makes the form zero).
* Record digest, headers differ (other dtype or shape): ``V_X − V_Y`` is (the body difference,
  independent of ``H``) plus a nonzero linear form in ``H``: probability ``≤ 1/p``.
* Same header, some row r differs: ``Pr[ΔT[r] = 0 and ΔT'[r] = 0] = 1/p**2`` (B and B' are
  independent). Otherwise some ``(ΔT[r], ΔT'[r]) ≠ (0, 0)`` and ``ΔV = Σ_r A[r] ΔT[r] + A'[r]
  ΔT'[r]`` is a nonzero degree-1 form in the row keys, independent of B and B': probability
  ``≤ 1/p``. Total ``≤ 1/p**2 + 1/p < 2**-60``.
  Over m compared record pairs, a real difference is missed with probability ``≤ m · 2**-60``.
* Not adversarially collision-resistant: the keys are public, so anyone can construct two
  tensors with equal digests. It detects drift, it does not authenticate.

Shards. ``V`` and ``T`` are sums of per-element terms keyed by global indices, so a rank holding
rows ``[r0, r1)`` (SP) and/or element columns ``[c0, c1)`` of each row (TP heads or channels,
a contiguous range of the flattened row) computes ``partial`` (its column sums of T, T' per row
and its part of V); ``combine`` adds row partials mod p per global row, V partials mod p and the
header once. The one-shard case is ``digest_tensor``.

Computation (``drifttool.digestcore``): words split into 16-bit halves, keys into 21-bit limbs;
an FP64 matmul ``[6, C] @ [C, H·R]`` over at most 2**16 columns is exact on CPU BLAS and cuBLAS
alike (integers < 2**53, any order), then int64 with 61-bit rotations. Nothing syncs with the
host: ``digest_pending`` returns a small device tensor, ``materialize`` reads many back at once
(the recorder does this once per step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import math

import numpy as np
import torch

from drifttool import digestcore as core
from drifttool.capture import gpu_rows
from drifttool.digestcore import COL_CHUNK, P, ROW_CHUNK

_STAT_CHUNK = 1 << 22  # elements per fp64 chunk for the norm on a device (32 MiB of scratch)
_NP_STAT_CHUNK = 1 << 16  # elements per chunk on the CPU (stays in cache)
_BLOCK = {"cpu": 1 << 16}  # halves per FP64 block: in cache on CPU, one launch on a GPU
_GPU_BLOCK = 1 << 24  # 128 MiB of FP64 scratch per block
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CPU_NUMPY = True
"""CPU tensors run the same arithmetic through numpy (``digestcore``), zero-copy: measured 2-5×
faster than the torch ops on the shared 2-core machine, where torch's intra-op threads stall
(docs/benchmarks.md). The values are identical either way (tests run both)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling stored in artifacts)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; raises ``ValueError`` for an unknown name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` in row-major order as a flat ``uint8`` array (no copy when ``t`` is a
    contiguous CPU tensor; a GPU tensor is copied to the host)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# -- key tables per device -------------------------------------------------------------------
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
_CONSTS: dict[torch.device, dict[str, torch.Tensor]] = {}


def _table(kind: str, n: int, device: torch.device) -> torch.Tensor:
    """``core.np_table(kind, n)`` on ``device``: cached, grown by doubling, moved once."""
    have = _TABLES.get((kind, device))
    if have is None or have.shape[-1] < n:
        have = torch.from_numpy(core.np_table(kind, n)).to(device)
        _TABLES[(kind, device)] = have
    return have


def _consts(device: torch.device) -> dict[str, torch.Tensor]:
    if device not in _CONSTS:
        _CONSTS[device] = core.shift_consts(lambda a: torch.from_numpy(a).to(device))
    return _CONSTS[device]


# -- words -----------------------------------------------------------------------------------
def _halves(t: torch.Tensor, row_axis: int | None) -> torch.Tensor:
    """``[R, C, H]`` uint8/uint16 halves of ``t``'s words (``digestcore.halves_np``); copies only
    when the row axis is not first or ``t`` is not contiguous."""
    name = dtype_name(t.dtype)
    wpe = core.words_per_element(name)
    t = t.detach().resolve_conj().resolve_neg()
    if row_axis is not None and t.dim():
        t = t.movedim(row_axis, 0)
        r, n = t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64))
    else:
        r, n = 1, t.numel()
    size = t.element_size()
    if t.numel() == 0:
        return torch.empty(r, n * wpe, 1 if size <= 2 else 2, dtype=torch.uint8, device=t.device)
    t = t.contiguous().reshape(-1)
    raw = t.view(torch.uint8) if size == 1 else t.view(torch.uint16)
    return raw.reshape(r, n * wpe, 1 if size <= 2 else 2)


def _row_sums(halves: torch.Tensor, col_offset: int) -> torch.Tensor:
    """``int64 [2, R]``: ``T``, ``T'`` over the columns ``col_offset + [0, C)``, on the device."""
    if halves.device.type == "cpu" and _CPU_NUMPY:
        return torch.from_numpy(core.row_sums_np(halves.numpy(), col_offset))
    r, n, h = halves.shape
    dev = halves.device
    acc = torch.zeros(6, h, r, dtype=torch.int64, device=dev)
    kt = _table("col", col_offset + n, dev)
    block = _BLOCK.get(dev.type, _GPU_BLOCK)
    for ci, c0 in enumerate(range(0, n, COL_CHUNK)):
        c1 = min(n, c0 + COL_CHUNK)
        rb = max(1, block // ((c1 - c0) * h))
        k = kt[:, col_offset + c0:col_offset + c1]  # [6, cb] float64
        for r0 in range(0, r, rb):
            r1 = min(r, r0 + rb)
            buf = torch.empty(h, r1 - r0, c1 - c0, dtype=torch.float64, device=dev)
            for j in range(h):
                buf[j].copy_(halves[r0:r1, c0:c1, j])
            s = torch.mm(k, buf.view(-1, c1 - c0).t())  # [6, h·rows], exact integers < 2**53
            acc[:, :, r0:r1] += s.view(6, h, r1 - r0).to(torch.int64)
        if ci % core._FOLD_EVERY == core._FOLD_EVERY - 1:
            acc = core.fold(acc)
    return core.finish_rows(acc, _consts(dev))


def _level2(rows: torch.Tensor, row_offset: int) -> torch.Tensor:
    """``int64`` 0-dim: ``Σ_r A[r] T[r] + A'[r] T'[r] mod p`` over global rows ``row_offset + r``."""
    dev, n = rows.device, rows.shape[1]
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    if dev.type == "cpu" and _CPU_NUMPY:
        return torch.tensor(core.level2_np(rows.numpy(), row_offset), dtype=torch.int64)
    a = _table("row", row_offset + n, dev)
    c = _consts(dev)
    parts = [core.level2(rows[:, r0:r0 + ROW_CHUNK],
                         a[:, :, row_offset + r0:row_offset + min(n, r0 + ROW_CHUNK)], c)
             for r0 in range(0, n, ROW_CHUNK)]
    return parts[0] if len(parts) == 1 else core.modsum(torch.stack(parts), 0)


# -- shards ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Partial:
    """One shard's contribution, on its device (nothing read back).

    Attributes:
        row_offset: global index of the shard's first row.
        rows: ``int64 [2, R_shard]``: partial ``T``, ``T'`` over the shard's columns.
        v: ``int64`` 0-dim: the shard's part of ``V`` (without the header).
    """

    row_offset: int
    rows: torch.Tensor
    v: torch.Tensor


def partial(t_shard: torch.Tensor, *, row_axis: int | None = None, row_offset: int = 0,
            col_offset: int = 0, total_shape: tuple[int, ...] | None = None) -> Partial:
    """The part of digest v2 that a rank holding ``t_shard`` contributes.

    Args:
        t_shard: rows ``[row_offset, row_offset + R_shard)`` (SP) and, of each row, the flattened
            elements ``[col_offset, col_offset + C_shard)`` (TP: a contiguous range, e.g. heads
            ``[h0, h1)`` of ``[S, H, D]`` are elements ``[h0·D, h1·D)``); any device.
        row_axis: the row axis (``None``: the tensor is one row; ``row_offset`` must be 0).
        total_shape: the unsharded canonical shape, to check the ranges against.

    Raises:
        ValueError: the shard does not fit in ``total_shape``.
        UnsupportedConfigError: a dtype without a digest code.
    """
    halves = _halves(t_shard, row_axis)
    wpe = core.words_per_element(dtype_name(t_shard.dtype))
    if total_shape is not None:
        tr = total_shape[row_axis] if row_axis is not None and len(total_shape) else 1
        tc = int(np.prod(total_shape, dtype=np.int64)) // tr if tr else 0
        if row_offset + halves.shape[0] > tr or col_offset * wpe + halves.shape[1] > tc * wpe:
            raise ValueError(f"shard of shape {tuple(t_shard.shape)} at row {row_offset}, column "
                             f"{col_offset} does not fit in {tuple(total_shape)}")
    rows = _row_sums(halves, col_offset * wpe)
    return Partial(int(row_offset), rows, _level2(rows, row_offset))


def combine(partials: list[Partial], dtype: str, shape: tuple[int, ...],
            row_axis: int | None = None) -> tuple[int, np.ndarray]:
    """Digest v2 of the unsharded tensor from its shards' partials: ``(V, uint64 [R] T)``.

    Every (row, column) of ``shape`` must be covered by exactly one partial (not checked: a
    missing or doubled shard gives another value, which the diff reports as drift).
    """
    r = shape[row_axis] if row_axis is not None and len(shape) else 1
    rows = np.zeros((2, r), np.int64)
    v = core.header_value(dtype, tuple(shape))
    for p in partials:
        pr = p.rows.cpu().numpy()
        sl = slice(p.row_offset, p.row_offset + pr.shape[1])
        rows[:, sl] = core.addmod(rows[:, sl], pr)
        v = (v + int(p.v)) % P
    return v, rows[0].astype(np.uint64)


# -- whole tensors, read back in batches -----------------------------------------------------
@dataclass(frozen=True)
class TensorDigest:
    """Everything a record keeps about one canonical tensor (never the tensor itself).

    Attributes:
        dtype: e.g. ``"bfloat16"``. shape: the canonical shape.
        digest: ``V`` of digest v2 (module docstring), in ``[0, p)``.
        rows: ``uint64 [n_rows]`` row digests ``T``, or ``None`` when not kept.
        nonfinite, l2, maxabs: see ``stats``.
    """

    dtype: str
    shape: tuple[int, ...]
    digest: int
    rows: np.ndarray | None
    nonfinite: int
    l2: float
    maxabs: float


@dataclass(frozen=True)
class PendingDigest:
    """A digest computed on the device and not read back yet (``materialize`` reads it).

    ``vec`` is ``int64 [5 + R_kept]`` on the tensor's device: ``V`` without header, then the
    fp64 bits of (sum of squares, max, min, nonfinite count), then the kept row digests.
    """

    dtype: str
    shape: tuple[int, ...]
    header: int
    numel: int
    keep_rows: bool
    vec: torch.Tensor


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


def _device_rows(t: torch.Tensor, row_axis: int | None) -> PendingRows | None:
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


def _finish_rows(pending: list[PendingRows]) -> list[tuple[int, np.ndarray | None, np.ndarray]]:
    """Level 2 and the summaries of ``pending`` (one device), vectorised over every record:
    ``(V without header, kept rows or None, float64 [4] stats)`` per record, one read-back."""
    dev = pending[0].table[0].device
    # unique row tables ([S, R, ·] split partials), grouped by split count: each group is
    # concatenated and its splits combined once (normally one group: one split count per run)
    groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    seen: set[int] = set()
    for p in pending:
        if id(p.table[0]) not in seen:
            seen.add(id(p.table[0]))
            groups.setdefault(p.table[0].shape[0], []).append(p.table)
    tables: dict[int, int] = {}
    rows_l, stats_l, base = [], [], 0
    for group in groups.values():
        for r_t, _ in group:
            tables[id(r_t)] = base
            base += r_t.shape[1]
        cat = (lambda ts: torch.cat(ts, 1) if len(ts) > 1 else ts[0])  # noqa: E731
        r_g, s_g = gpu_rows.combine_splits(cat([g[0] for g in group]), cat([g[1] for g in group]))
        rows_l.append(r_g)
        stats_l.append(s_g)
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
    rec_np = np.asarray(rec_len, np.int64)
    cum = np.concatenate([[0], np.cumsum(lens_np)[:-1]]).astype(np.int64)
    rcum = np.concatenate([[0], np.cumsum(rec_np)[:-1]]).astype(np.int64)
    meta = torch.from_numpy(np.concatenate([lens_np, np.asarray(starts, np.int64) - cum, rec_np, rcum]))
    if dev.type == "cuda":  # pinned, asynchronous: a pageable copy would block the host
        meta = meta.pin_memory().to(dev, non_blocking=True)
    else:
        meta = meta.to(dev)
    nr, nrec = len(lens_np), len(rec_np)
    d_lens, d_delta, d_rec, d_rcum = meta[:nr], meta[nr:2 * nr], meta[2 * nr:2 * nr + nrec], meta[2 * nr + nrec:]
    total = int(lens_np.sum())
    pos = torch.arange(total, device=dev, dtype=torch.int64)
    idx = pos + torch.repeat_interleave(d_delta, d_lens, output_size=total)
    local = pos - torch.repeat_interleave(d_rcum, d_rec, output_size=total)
    rows_all = torch.cat(rows_l) if len(rows_l) > 1 else rows_l[0]
    stats_all = torch.cat(stats_l) if len(stats_l) > 1 else stats_l[0]
    t = rows_all[idx].t()  # [2, total]: T, T'
    a = _table("row", int(rec_np.max(initial=0)) or 1, dev)[:, :, local]  # [2, 3, total] limbs of A, A'
    c = _consts(dev)
    tl_ = (t.reshape(2, 1, -1) >> c["s3"]) & ((1 << 21) - 1)  # [2, 3 (j), total]
    prod = (a.reshape(2, 3, 1, -1) * tl_.reshape(2, 1, 3, -1)).sum(0)  # [3 (i), 3 (j), total] < 2**43
    u = _segment_sums(prod.reshape(9, -1), d_rcum, d_rec).reshape(3, 3, nrec)
    v = core.modsum(core.rot(core.fold(u), c["s2"].reshape(3, 3, 1), c["m2"].reshape(3, 3, 1)), (0, 1))
    s = stats_all[idx]
    lengths = d_rec
    red = [torch.segment_reduce(s[:, k], how, lengths=lengths, unsafe=True, initial=init)
           for k, (how, init) in enumerate((("sum", 0.0), ("max", -math.inf), ("min", math.inf),
                                            ("sum", 0.0)))]
    keep = any(p.keep_rows for p in pending)
    host = torch.cat([v.view(torch.int64).reshape(-1), torch.stack(red, 1).view(torch.int64).reshape(-1)]
                     + ([t[0]] if keep else [])).cpu().numpy()
    out = []
    st = host[nrec:5 * nrec].view(np.float64).reshape(nrec, 4)
    kept = host[5 * nrec:] if keep else None
    for i, p in enumerate(pending):
        rows = kept[rcum[i]:rcum[i] + rec_np[i]].astype(np.uint64) if p.keep_rows else None
        out.append((int(host[i]), rows, st[i]))
    return out


def _stats_vec(t: torch.Tensor) -> torch.Tensor:
    """``float64 [4]`` on ``t``'s device: Σx² (fp64, chunked), max, min, count of NaN/±inf."""
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    elif x.is_complex():
        x = x.abs()
    elif x.is_floating_point() and x.dtype not in _REDUCIBLE:
        x = x.float()  # fp8: exact in fp32, and max/min have kernels for it
    if x.device.type == "cpu" and _CPU_NUMPY:
        return torch.from_numpy(_stats_np(x))
    x = x.reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    if x.numel() == 0:
        return zero.repeat(4)
    sq, bad = zero, zero
    for i in range(0, x.numel(), _STAT_CHUNK):
        c = x[i:i + _STAT_CHUNK].to(torch.float64)
        sq = sq + (c * c).sum()
        if x.is_floating_point():
            bad = bad + (~torch.isfinite(c)).sum()
    return torch.stack([sq, x.max().to(torch.float64), x.min().to(torch.float64), bad])


def _stats_np(x: torch.Tensor) -> np.ndarray:
    """``_stats_vec`` of a CPU tensor in single-threaded numpy: no BLAS and no torch intra-op
    threads, which stall on a busy machine (docs/benchmarks.md). bf16 widens to fp32 by its bits.
    Chunks of ``_NP_STAT_CHUNK`` elements keep the scratch small (no fresh pages per call)."""
    bf16 = x.dtype == torch.bfloat16
    v = x.contiguous().reshape(-1)
    v = v.view(torch.uint16).numpy() if bf16 else v.numpy()
    if v.size == 0:
        return np.zeros(4)
    sq, mx, mn, bad = 0.0, -math.inf, math.inf, 0
    for i in range(0, v.size, _NP_STAT_CHUNK):
        c = v[i:i + _NP_STAT_CHUNK]
        if bf16:
            c = (c.astype(np.uint32) << 16).view(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            sq += float(np.einsum("i,i->", c, c, dtype=np.float64))  # fp64 products and sum
        mx, mn = max(mx, float(c.max())), min(mn, float(c.min()))
        if c.dtype.kind == "f" and not math.isfinite(sq):  # only then can an element be NaN/±inf
            bad += int(c.size - np.count_nonzero(np.isfinite(c)))
    return np.array([sq, mx, mn, bad], np.float64)


def digest_pending(t: torch.Tensor, *, row_axis: int | None = None,
                   keep_rows: bool = False) -> PendingDigest | PendingRows:
    """Start digest v2 and the summary of ``t`` on its device (no host sync).

    Args:
        t: any dtype of ``digestcore.DTYPE_CODES``, any device, any layout.
        row_axis: the canonical row axis (``None``: one row). It is part of the definition:
            the same tensor digested with another row axis has another ``V``.
        keep_rows: keep the row digests ``T`` (L2).

    Raises:
        UnsupportedConfigError: a dtype without a digest code.
    """
    fast = _device_rows(t, row_axis)
    if fast is not None:
        return dataclasses.replace(fast, keep_rows=keep_rows and row_axis is not None)
    name = dtype_name(t.dtype)
    header = core.header_value(name, tuple(t.shape))
    rows = _row_sums(_halves(t, row_axis), 0)
    v = _level2(rows, 0)
    parts = [v.reshape(1), _stats_vec(t).view(torch.int64)]
    if keep_rows:
        parts.append(rows[0])
    return PendingDigest(name, tuple(t.shape), header, t.numel(), keep_rows, torch.cat(parts))


def materialize(pending: list[PendingDigest | PendingRows]) -> list[TensorDigest]:
    """Read ``pending`` back: one device-to-host transfer per device (and kind), in order."""
    host: list[np.ndarray | None] = [None] * len(pending)
    done: dict[int, TensorDigest] = {}
    by_dev: dict[torch.device, list[int]] = {}
    rows_by_dev: dict[torch.device, list[int]] = {}
    for i, p in enumerate(pending):
        if isinstance(p, PendingRows):
            rows_by_dev.setdefault(p.table[0].device, []).append(i)
        else:
            by_dev.setdefault(p.vec.device, []).append(i)
    for idx in rows_by_dev.values():
        for i, (v, rows, st) in zip(idx, _finish_rows([pending[i] for i in idx])):
            p = pending[i]
            done[i] = TensorDigest(p.dtype, p.shape, (v + p.header) % P, rows,
                                   *_summary(p.numel, st))
    for idx in by_dev.values():
        flat = torch.cat([pending[i].vec for i in idx]).cpu().numpy()
        at = 0
        for i in idx:
            n = pending[i].vec.shape[0]
            host[i], at = flat[at:at + n], at + n
    out = []
    for i, (p, h) in enumerate(zip(pending, host)):
        if i in done:
            out.append(done[i])
            continue
        out.append(TensorDigest(p.dtype, p.shape, (int(h[0]) + p.header) % P,
                                h[5:].astype(np.uint64) if p.keep_rows else None,
                                *_summary(p.numel, h[1:5].view(np.float64))))
    return out


def _summary(numel: int, s: np.ndarray) -> tuple[int, float, float]:
    """``(nonfinite, l2, maxabs)`` from ``_stats_vec`` read back."""
    sq, mx, mn, bad = s.tolist()
    if numel == 0:
        return 0, 0.0, 0.0
    if math.isnan(sq):  # NaN propagates into l2 and maxabs
        return int(bad), math.nan, math.nan
    return int(bad), math.sqrt(sq), max(mx, -mn)


def digest_tensor(t: torch.Tensor, *, row_axis: int | None = None,
                  keep_rows: bool | None = None) -> TensorDigest:
    """Digest ``t`` (rows along ``row_axis``) and summarise it, read back now (one sync).

    ``keep_rows`` defaults to ``row_axis is not None``."""
    keep = row_axis is not None if keep_rows is None else keep_rows
    return materialize([digest_pending(t, row_axis=row_axis, keep_rows=keep)])[0]


def digest(t: torch.Tensor, row_axis: int | None = None) -> int:
    """``V`` of digest v2 of ``t`` (rows along ``row_axis``, or one row), in ``[0, p)``."""
    d = materialize([digest_pending(t, row_axis=row_axis)])[0]
    return d.digest


def row_digests(t: torch.Tensor, axis: int = 0) -> np.ndarray:
    """``uint64 [t.shape[axis]]``: the row digests ``T`` along ``axis``."""
    return _row_sums(_halves(t, axis), 0)[0].cpu().numpy().astype(np.uint64)


def stats(t: torch.Tensor) -> tuple[int, float, float]:
    """``(nonfinite, l2, maxabs)`` of ``t``: count of NaN/Inf elements, fp64 L2 norm, max |x|,
    computed on ``t``'s device.

    NaN/Inf are never hidden: they propagate into ``l2`` and ``maxabs`` and are counted. The norm
    is accumulated in fp64 (not bitwise-defined; a summary, not an identity). Integer and bool
    tensors have ``nonfinite = 0``; complex tensors are summarised by ``|x|``.
    """
    return _summary(t.numel(), _stats_vec(t).cpu().numpy())


__all__ = ["P", "Partial", "PendingDigest", "PendingRows", "pending_rows", "TensorDigest", "combine",
           "digest", "digest_pending", "digest_tensor", "dtype_from_name", "dtype_name",
           "materialize", "partial", "raw_bytes", "row_digests", "stats"]
