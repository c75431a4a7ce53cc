"""Align two record tables by identity, vectorised: matched index pairs and the unmatched rest.

    >>> al = align(ops_a, ops_b, OPS_KEY)
    >>> al.ia, al.ib          # int64 row indices of matched records (same identity)
    >>> al.only_a, al.only_b  # records present in one run only
    >>> t = compare_table(ops_a, ops_b, OPS_KEY); t.da, t.db   # matched pairs whose digests differ

Identity keys hold no rank (``schema.OPS_KEY``): a record owned by rank 1 in one run pairs with
the same record owned by rank 0 in the other. Fast path: when both tables hold the same identity
columns row for row (the usual case, two runs of one program on one layout), rows pair by
position without encoding anything; the pairing is the same as the slow path's. Otherwise every identity
column is integer-encoded over both tables (strings through one shared dictionary), the codes
are folded into one int64 key (re-densified with ``np.unique`` before it could overflow), and
the sorted keys are matched with ``searchsorted``. An identity that occurs k times in a run (it
should not) pairs its i-th occurrence with the other run's i-th, in table order; the count is
reported. Source: design.md, "Diff" (align by identity, never by position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.diff.arrays import arrow_array
from drifttool.diff.order import program_order
from drifttool.diff.report import Counts

_LIMIT = 1 << 62


@dataclass(frozen=True)
class Alignment:
    """Row indices (int64) into table A and B."""

    ia: np.ndarray
    ib: np.ndarray
    only_a: np.ndarray
    only_b: np.ndarray
    duplicates: int = 0  # records whose identity already occurred earlier in the same run


def _codes(ca: pa.ChunkedArray, cb: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, int]:
    """Dense int64 codes of one column over both tables, and the code count."""
    if pa.types.is_string(ca.type) or pa.types.is_large_string(ca.type):
        both = pa.chunked_array([*ca.chunks, *cb.chunks], type=ca.type).combine_chunks()
        enc = ac.dictionary_encode(both)
        codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        n = len(enc.dictionary)
    else:
        codes = np.concatenate([ca.to_numpy(), cb.to_numpy()]).astype(np.int64)
        lo = codes.min() if codes.size else 0
        codes -= lo
        n = int(codes.max()) + 1 if codes.size else 1
    return codes[: len(ca)], codes[len(ca):], max(n, 1)


def _densify(ka: np.ndarray, kb: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    uniq, inv = np.unique(np.concatenate([ka, kb]), return_inverse=True)
    return inv[: len(ka)].astype(np.int64), inv[len(ka):].astype(np.int64), len(uniq)


def encode_keys(a: pa.Table, b: pa.Table, key: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """One int64 per row such that equal identity <=> equal int, over both tables."""
    ka = np.zeros(a.num_rows, np.int64)
    kb = np.zeros(b.num_rows, np.int64)
    card = 1
    for name in key:
        ca, cb, n = _codes(a.column(name), b.column(name))
        if card * n >= _LIMIT:
            ka, kb, card = _densify(ka, kb)
        ka = ka * n + ca
        kb = kb * n + cb
        card *= n
    return ka, kb


def _occurrence(sorted_keys: np.ndarray) -> np.ndarray:
    """For sorted keys: 0 for a key's first occurrence, 1 for its second, ..."""
    n = sorted_keys.size
    if n == 0:
        return np.zeros(0, np.int64)
    start = np.ones(n, bool)
    start[1:] = sorted_keys[1:] != sorted_keys[:-1]
    idx = np.arange(n)
    return idx - np.maximum.accumulate(np.where(start, idx, 0))


def align(a: pa.Table, b: pa.Table, key: Sequence[str]) -> Alignment:
    """Pair the rows of ``a`` and ``b`` that share the identity columns ``key``.

    Returns:
        ``Alignment``; ``ia``/``ib`` are in no particular order (callers order by program
        position, ``drifttool.diff.order``).
    """
    if a.num_rows == b.num_rows and all(a.column(k).equals(b.column(k)) for k in key):
        idx = np.arange(a.num_rows, dtype=np.int64)
        return Alignment(idx, idx, np.zeros(0, np.int64), np.zeros(0, np.int64))
    ka, kb = encode_keys(a, b, key)
    oa = np.argsort(ka, kind="stable")
    ob = np.argsort(kb, kind="stable")
    sa, sb = ka[oa], kb[ob]
    occ_a, occ_b = _occurrence(sa), _occurrence(sb)
    dups = int(np.count_nonzero(occ_a) + np.count_nonzero(occ_b))
    if dups:
        m = int(max(occ_a.max(initial=0), occ_b.max(initial=0))) + 1
        if (max(sa.max(initial=0), sb.max(initial=0)) + 1) * m >= _LIMIT:
            sa, sb, _ = _densify(sa, sb)
        sa, sb = sa * m + occ_a, sb * m + occ_b  # still sorted: occurrence breaks ties in order
    pos = np.searchsorted(sb, sa)
    hit = pos < sb.size
    hit[hit] = sb[pos[hit]] == sa[hit]
    matched_b = np.zeros(sb.size, bool)
    matched_b[pos[hit]] = True
    return Alignment(oa[hit], ob[pos[hit]], np.sort(oa[~hit]), np.sort(ob[~matched_b]), dups)


def drop_replicas(t: pa.Table, key: Sequence[str]) -> tuple[pa.Table, int, int]:
    """Keep one of the records that several ranks hold with the same identity (a replicated
    computation, e.g. the sigma table every rank of a sample-parallel rollout computes).

    Identity keys hold no rank, so replicas would otherwise pair by occurrence against a
    single-process run's one record. When all replicas of an identity carry one digest, the
    lowest rank's is kept; when they disagree (the ranks computed different bytes) all are kept
    and counted, so the diff reports them. Records repeated on one rank are left as they are.

    Args:
        t: records with the ``key`` columns, ``rank`` and ``digest``.

    Returns:
        ``(table, dropped, conflicts)``: the table without the dropped replicas (row order kept),
        the number dropped and the number of identities whose replicas disagree.
    """
    if t.num_rows < 2 or "rank" not in t.column_names:
        return t, 0, 0
    k, _ = encode_keys(t, t.slice(0, 0), key)
    rank = t.column("rank").to_numpy().astype(np.int64)
    dig = t.column("digest").to_numpy()
    order = np.lexsort((np.arange(k.size), rank, k))
    ks, rs, ds = k[order], rank[order], dig[order]
    start = np.ones(ks.size, bool)
    start[1:] = ks[1:] != ks[:-1]
    group = np.cumsum(start) - 1
    n = int(group[-1]) + 1
    many_ranks = np.zeros(n, bool)
    np.logical_or.at(many_ranks, group[1:][~start[1:]], rs[1:][~start[1:]] != rs[:-1][~start[1:]])
    if not many_ranks.any():
        return t, 0, 0
    first_dig = ds[start][group]
    agree = np.ones(n, bool)
    np.logical_and.at(agree, group, ds == first_dig)
    first_rank = rs[start][group]
    drop = many_ranks[group] & agree[group] & (rs != first_rank)
    # a replica on the lowest rank repeated on that rank stays (a duplicate, not a replica)
    keep = np.ones(t.num_rows, bool)
    keep[order[drop]] = False
    conflicts = int(np.count_nonzero(many_ranks & ~agree))
    if keep.all():
        return t, 0, conflicts
    return ac.filter(t, arrow_array(keep)), int(np.count_nonzero(~keep)), conflicts


@dataclass
class TableDiff:
    """One record table of both runs, aligned by identity and compared by digest.

    Attributes:
        a, b: the tables (at least the identity and program-order columns and ``digest``).
        al: the alignment. pos_a, pos_b: ``int64`` program position of every row
            (``drifttool.diff.order.program_order``; rank-independent, comparable across runs).
        da, db: ``int64`` row indices of the matched records whose digests differ (pairs).
    """

    a: pa.Table
    b: pa.Table
    al: Alignment
    pos_a: np.ndarray
    pos_b: np.ndarray
    da: np.ndarray
    db: np.ndarray
    replicas: tuple[int, int] = (0, 0)  # replicated records dropped in A, B (drop_replicas)
    conflicts: tuple[int, int] = (0, 0)  # identities whose replicas disagree in A, B

    def counts(self) -> Counts:
        """Record counts for the report."""
        return Counts(a=self.a.num_rows, b=self.b.num_rows, matched=self.al.ia.size,
                      differ=self.da.size, only_a=self.al.only_a.size, only_b=self.al.only_b.size)


def compare_table(a: pa.Table, b: pa.Table, key: tuple[str, ...],
                  pos: tuple[np.ndarray, np.ndarray] | None = None) -> TableDiff:
    """Align ``a`` and ``b`` on ``key`` and find the matched rows whose ``digest`` differs.

    Args:
        pos: program positions of the rows of ``a`` and ``b`` (e.g. computed together with other
            tables, so they compare across tables); ``None``: ``program_order([a, b])``.
    """
    al = align(a, b, key)
    dig_a = a.column("digest").to_numpy()
    dig_b = b.column("digest").to_numpy()
    ne = dig_a[al.ia] != dig_b[al.ib]
    pos_a, pos_b = program_order([a, b]) if pos is None else pos
    return TableDiff(a, b, al, pos_a, pos_b, al.ia[ne], al.ib[ne])
