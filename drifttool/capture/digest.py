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

import numpy as np
import torch

from drifttool import digestcore as core
from drifttool.capture.digest_rows import (PendingRows, RowTables, device_rows, host_numpy, key_consts,
                                           key_table, pending_rows)
from drifttool.capture.dtypes import dtype_from_name, dtype_name, raw_bytes
from drifttool.capture.summary import stats_vec, summaries, summary
from drifttool.digestcore import COL_CHUNK, P, ROW_CHUNK

_BLOCK = {"cpu": 1 << 16}  # halves per FP64 block: in cache on CPU, one launch on a GPU
_GPU_BLOCK = 1 << 24  # 128 MiB of FP64 scratch per block
_CPU_NUMPY = True
"""CPU tensors run the same arithmetic through numpy (``digestcore``), zero-copy: measured 2-5×
faster than the torch ops on the shared 2-core machine, where torch's intra-op threads stall
(docs/benchmarks.md). The values are identical either way (tests run both)."""


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
    kt = key_table("col", col_offset + n, dev)
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
    return core.finish_rows(acc, key_consts(dev))


def _level2(rows: torch.Tensor, row_offset: int) -> torch.Tensor:
    """``int64`` 0-dim: ``Σ_r A[r] T[r] + A'[r] T'[r] mod p`` over global rows ``row_offset + r``."""
    dev, n = rows.device, rows.shape[1]
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    if dev.type == "cpu" and _CPU_NUMPY:
        return torch.tensor(core.level2_np(rows.numpy(), row_offset), dtype=torch.int64)
    a = key_table("row", row_offset + n, dev)
    c = key_consts(dev)
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
class PendingWords:
    """A small CPU tensor's digest, its row sums left to ``materialize``: there the words of
    every such record read back together are summed in one product per word width
    (``_finish_words``) instead of a dozen small numpy calls per record.

    ``halves`` is ``[R, C, H]`` (``digestcore.halves_np``), a copy taken at capture (a later
    in-place write to the tensor cannot reach it); ``stats`` the summary's ``float64 [4]``
    (``summary.stats_vec``), computed at capture.
    """

    dtype: str
    shape: tuple[int, ...]
    header: int
    numel: int
    keep_rows: bool
    halves: np.ndarray
    stats: np.ndarray


_DEFER_ELEMENTS = 1 << 16
"""CPU tensors of at most this many elements (and at least one) leave their row sums to
``materialize`` (``PendingWords``): a copy of their words costs less than the per-record calls."""


def _finish_words(pending: list[PendingWords]) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """``V`` without header (``int64 [n]``) and the kept row digests of ``pending``: the rows of
    every record with the same half width and a column count in the same power-of-two bucket go
    into one zero-padded ``[ΣR, C, H]`` block (a zero word adds nothing to ``T``), summed by
    ``digestcore.row_sums_np``; level 2 per record by ``digestcore.level2_segments_np``."""
    value = np.zeros(len(pending), np.int64)
    rows: list[np.ndarray | None] = [None] * len(pending)
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(pending):
        r, c, h = p.halves.shape
        buckets.setdefault((h, 1 << max(0, c - 1).bit_length()), []).append(i)
    for (h, width), idx in buckets.items():
        lengths = np.asarray([pending[i].halves.shape[0] for i in idx], np.int64)
        block = np.zeros((int(lengths.sum()), width, h), np.uint16)
        at = 0
        for i, n in zip(idx, lengths.tolist()):
            x = pending[i].halves
            block[at:at + n, :x.shape[1]] = x
            at += n
        t = core.row_sums_np(block, 0)  # [2, ΣR]: T, T'
        value[idx] = core.level2_segments_np(t, lengths)
        at = 0
        for i, n in zip(idx, lengths.tolist()):
            if pending[i].keep_rows:
                rows[i] = t[0, at:at + n].astype(np.uint64)
            at += n
    return value, rows


def _stats_vec(t: torch.Tensor) -> torch.Tensor:
    """``summary.stats_vec`` on the path this module's CPU tensors take (``_CPU_NUMPY``)."""
    return stats_vec(t, numpy=_CPU_NUMPY)


def digest_pending(t: torch.Tensor, *, row_axis: int | None = None,
                   keep_rows: bool = False) -> PendingDigest | PendingRows | PendingWords:
    """Start digest v2 and the summary of ``t`` on its device (no host sync).

    Args:
        t: any dtype of ``digestcore.DTYPE_CODES``, any device, any layout.
        row_axis: the canonical row axis (``None``: one row). It is part of the definition:
            the same tensor digested with another row axis has another ``V``.
        keep_rows: keep the row digests ``T`` (L2).

    Raises:
        UnsupportedConfigError: a dtype without a digest code.
    """
    fast = device_rows(t, row_axis)
    if fast is not None:
        return dataclasses.replace(fast, keep_rows=keep_rows and row_axis is not None)
    name = dtype_name(t.dtype)
    header = core.header_value(name, tuple(t.shape))
    if t.device.type == "cpu" and _CPU_NUMPY and 0 < t.numel() <= _DEFER_ELEMENTS:
        return PendingWords(name, tuple(t.shape), header, t.numel(), keep_rows,
                            _halves(t, row_axis).numpy().copy(), _stats_vec(t).numpy())
    rows = _row_sums(_halves(t, row_axis), 0)
    v = _level2(rows, 0)
    parts = [v.reshape(1), _stats_vec(t).view(torch.int64)]
    if keep_rows:
        parts.append(rows[0])
    return PendingDigest(name, tuple(t.shape), header, t.numel(), keep_rows, torch.cat(parts))


@dataclass(frozen=True)
class DigestColumns:
    """Digests read back as columns, one entry per record (``materialize_columns``): the fields
    of ``TensorDigest``, ``digest`` ``uint64 [n]``, ``nonfinite`` ``int64 [n]``, ``l2`` and
    ``maxabs`` ``float64 [n]``, ``dtype``, ``shape`` and ``rows`` lists."""

    dtype: list[str]
    shape: list[tuple[int, ...]]
    digest: np.ndarray
    rows: list[np.ndarray | None]
    nonfinite: np.ndarray
    l2: np.ndarray
    maxabs: np.ndarray

    def __len__(self) -> int:
        return len(self.dtype)

    def __getitem__(self, sl: slice) -> "DigestColumns":
        return DigestColumns(*(getattr(self, f.name)[sl] for f in dataclasses.fields(self)))

    def records(self) -> list[TensorDigest]:
        """One ``TensorDigest`` per entry."""
        return [TensorDigest(*v) for v in zip(self.dtype, self.shape, self.digest.tolist(), self.rows,
                                              self.nonfinite.tolist(), self.l2.tolist(),
                                              self.maxabs.tolist())]


class ReadBack:
    """``materialize_columns`` of a fixed list of pending digests, planned once: which device and
    kind each is read back with, and the row tables' segments (``digest_rows.RowTables``); each
    call reads what the digests hold then (a CUDA graph's replay rewrites them,
    ``drifttool.model.replay``)."""

    def __init__(self, pending: list[PendingDigest | PendingRows | PendingWords | TensorDigest]) -> None:
        n = len(pending)
        self._pending = pending
        self._dtype, self._shape = [p.dtype for p in pending], [p.shape for p in pending]
        self._header = np.zeros(n, np.int64)
        self._numel = np.zeros(n, np.int64)
        self._done: list[int] = []
        self._words: list[int] = []
        by_dev: dict[torch.device, list[int]] = {}
        rows_by_dev: dict[torch.device, list[int]] = {}
        for i, p in enumerate(pending):
            if isinstance(p, TensorDigest):  # read back already
                self._done.append(i)
            else:
                self._header[i], self._numel[i] = p.header, p.numel
                if isinstance(p, PendingRows):
                    rows_by_dev.setdefault(p.table[0].device, []).append(i)
                elif isinstance(p, PendingWords):
                    self._words.append(i)
                else:
                    by_dev.setdefault(p.vec.device, []).append(i)
        self._tables = [(idx, RowTables([pending[i] for i in idx])) for idx in rows_by_dev.values()]
        self._vecs = []
        for idx in by_dev.values():
            lens = np.asarray([pending[i].vec.shape[0] for i in idx], np.int64)
            at = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
            kept = [(i, a, k) for i, a, k in zip(idx, at.tolist(), lens.tolist()) if pending[i].keep_rows]
            self._vecs.append((idx, [pending[i].vec for i in idx], at, kept))

    def __call__(self) -> DigestColumns:
        p, n = self._pending, len(self._pending)
        value = np.zeros(n, np.int64)  # V without header
        st = np.zeros((n, 4), np.float64)
        rows: list[np.ndarray | None] = [None] * n
        for idx, tables in self._tables:
            value[idx], kept, st[idx] = tables()
            for i, r in zip(idx, kept):
                rows[i] = r
        if self._words:
            idx = self._words
            value[idx], kept = _finish_words([p[i] for i in idx])
            st[idx] = np.stack([p[i].stats for i in idx])
            for i, r in zip(idx, kept):
                rows[i] = r
        for idx, vecs, at, kept in self._vecs:
            flat = host_numpy(torch.cat(vecs))
            value[idx] = flat[at]
            st[idx] = flat[at[:, None] + np.arange(1, 5)].view(np.float64)
            for i, a, k in kept:
                rows[i] = flat[a + 5:a + k].astype(np.uint64)
        digest = ((value + self._header) % P).astype(np.uint64)
        nonfinite, l2, maxabs = summaries(self._numel, st)
        for i in self._done:
            d = p[i]
            digest[i], rows[i], nonfinite[i], l2[i], maxabs[i] = d.digest, d.rows, d.nonfinite, d.l2, d.maxabs
        return DigestColumns(list(self._dtype), list(self._shape), digest, rows, nonfinite, l2, maxabs)


def materialize_columns(pending: list[PendingDigest | PendingRows | TensorDigest]) -> DigestColumns:
    """Read ``pending`` back as columns, in order: one device-to-host transfer per device (and
    kind); a ``TensorDigest`` among them (read back already: a sharded output's, combined from
    its ranks) is passed through."""
    return ReadBack(pending)()


def materialize(pending: list[PendingDigest | PendingRows | TensorDigest]) -> list[TensorDigest]:
    """Read ``pending`` back: one device-to-host transfer per device (and kind), in order; a
    ``TensorDigest`` among them is passed through (``materialize_columns``)."""
    return materialize_columns(pending).records()


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
    return summary(t.numel(), _stats_vec(t).cpu().numpy())


__all__ = ["P", "DigestColumns", "Partial", "PendingDigest", "PendingRows", "PendingWords", "pending_rows", "TensorDigest", "combine",
           "digest", "digest_pending", "digest_tensor", "dtype_from_name", "dtype_name",
           "materialize", "materialize_columns", "ReadBack", "partial", "raw_bytes", "row_digests", "stats"]
