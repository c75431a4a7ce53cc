"""Strict Ring attention forward for sequence parallelism (SP): each rank holds the text positions
(replicated) and its own image rows; image K/V shards travel around the ring, and every rank
finishes the same bytes as the unsharded strict ``joint_attention_fused`` for its query rows.

    out = ring_attention(q, k, v, key_mask, text_len=L, n_img=N, group=mesh.get_group("sp"))

Sharding (``sp_row_spans``): rank r of S ∈ {1, 2, 4, 8} holds the image blocks of segments
[r·8/S, (r+1)·8/S) of the ⌈N/64⌉ image blocks (``shards.sp_row_spans``), i.e. image rows [lo·64, min(hi·64, N)) of its
block range [lo, hi) (possibly empty when N is small): an aligned subtree of the contract's
segment tree.

Algorithm (two passes over the ring, as the contract's softmax is two-pass). In each pass the rank
first computes on its own image K/V shard, then sends the shard it holds to rank r+1 and receives
the next from rank r−1 (``dist.batch_isend_irecv``; the transfer of the next shard overlaps the
work on the current one), S shards in all. For each source rank it computes that rank's *subtree*
partial (``rank_subtree`` over the source's segments) and keeps it by source rank; the text keys
(replicated) give the text state (``merge_sequential``); the end is ``finish_ranks(text,
subtrees in rank order)``:

* pass 1: softmax block states (m_b, l_b) merged with ``softmax_combine`` → (m, l) per row;
* pass 2: P = ``softmax_probs`` (s, valid, m, l), cast to v's dtype and back to FP32, the AV
  partials per key block (``block_weighted``) merged with ``add_combine``; the output cast once
  to v's dtype.

Scores of the rank's queries are held against one key run (text, or one source shard) at a time,
in query chunks of whole 64-row blocks (``QUERY_CHUNK_ELEMS``; rows are independent, so the
chunking changes no byte). Never [B,H,S,S].

Shapes and dtypes: q, k, v [B, L + n_r, H, Dh] (text first, then the rank's n_r image rows), FP32
or BF16, k and v of every rank the same dtype; key_mask the *full* joint mask [B, L + N] bool
(True = valid) or None. Output [B, L + n_r, H, Dh] in v's dtype (the fused operator's), raw bits
equal to ``joint_attention_fused(q_full, k_full, v_full, key_mask, text_len=L)`` at those rows.
The strict CPU operator defines the bytes; on another device the same order runs, and the tiled
kernels' member bytes (Dh > 32) come from that device's library.

Raises ``UnsupportedConfigError``: S not in {1, 2, 4, 8}, tensors of the wrong rank, shape,
length (L + n_r), dtype or device, both ``group`` and ``transport``, a ``group`` without an
initialised process group, plus the fused operator's own checks (mask shape, ``text_len``, a
sample without a valid key).

Source of the arithmetic: docs/strict-arithmetic.md, "Attention (contract v2)"; the pieces are the
public ones of ``drifttool.ops.strict.attention_blocks`` / ``attention_kernels`` /
``attention_core`` (what the fused operator is written with). Backward: not here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from drifttool.distributed.canonical import COMM
from drifttool.errors import UnsupportedConfigError
from drifttool.shards import sp_row_spans
from drifttool.ops.strict.attention_blocks import (
    BLOCK,
    Combine,
    JointLayout,
    Partial,
    add_combine,
    block_partials,
    finish_ranks,
    merge_sequential,
    rank_segments,
    rank_subtree,
    softmax_block_states,
    softmax_combine,
    softmax_probs,
)
from drifttool.ops.strict.attention_core import AttnGeometry, geometry, heads_f32, scores_blocked
from drifttool.ops.strict.attention_kernels import block_weighted

__all__ = ["LocalRing", "P2PRing", "QUERY_CHUNK_ELEMS", "RingTransport", "ring_attention", "sp_row_spans"]  # sp_row_spans: from drifttool.shards

OP = "ring_attention"
QUERY_CHUNK_ELEMS = 1 << 22  # bound on one query chunk's [B, H, rows, keys] scores (bytes do not depend on it)

Shard = tuple[int, torch.Tensor, torch.Tensor]  # (source rank, its image k rows, its image v rows)


# ----------------------------------------------------------------------------- sharding


# ----------------------------------------------------------------------------- transports


class RingTransport(Protocol):
    """How a rank sees the image K/V shards of the ring, one at a time.

    Attributes:
        rank, size: this rank and S.
    ``shards(k_img, v_img, rows)`` yields (src, k_src, v_src) for src = rank, rank−1, …,
    rank−S+1 (mod S): first this rank's own shard (``k_img``, ``v_img`` [B, n_rank, H, Dh]),
    then the one received from rank−1 at each step; ``rows[src]`` is source ``src``'s row count.
    A yielded shard is only valid until the next one is requested.
    """

    rank: int
    size: int

    def shards(self, k_img: torch.Tensor, v_img: torch.Tensor, rows: Sequence[int]) -> Iterator[Shard]: ...


def ring_order(rank: int, size: int) -> list[int]:
    """The source ranks a rank sees, in ring order: rank, rank−1, …, rank−size+1 (mod size)."""
    return [(rank - t) % size for t in range(size)]


class P2PRing:
    """The real ring over ``group``: at each step send the held shard to rank+1 and receive the
    next from rank−1 (``dist.batch_isend_irecv`` of ``P2POp`` isend/irecv; gloo and NCCL). Empty
    shards are not sent (both ends know every source's row count)."""

    def __init__(self, group: ProcessGroup) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise UnsupportedConfigError(f"{OP}: a group was given but no process group is initialised")
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def shards(self, k_img: torch.Tensor, v_img: torch.Tensor, rows: Sequence[int]) -> Iterator[Shard]:
        s = self.size
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % s)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % s)
        cur = (k_img.contiguous(), v_img.contiguous())
        order = ring_order(self.rank, s)
        for t, src in enumerate(order):
            works, nxt_bufs = [], None
            if t + 1 < s:
                incoming = order[t + 1]
                nxt_bufs = tuple(x.new_empty((x.shape[0], rows[incoming], *x.shape[2:])) for x in cur)
                ops = []
                if rows[src]:
                    ops += [dist.P2POp(dist.isend, x, nxt, self.group) for x in cur]
                if rows[incoming]:
                    ops += [dist.P2POp(dist.irecv, x, prv, self.group) for x in nxt_bufs]
                works = dist.batch_isend_irecv(ops) if ops else []
            yield src, *cur
            with COMM.timing(sum(x.numel() * x.element_size() for x in nxt_bufs or ())):
                for w in works:  # the exposed part of the transfer (it overlapped the work on cur)
                    w.wait()
            if nxt_bufs is not None:
                cur = nxt_bufs


@dataclass
class LocalRing:
    """A stand-in for the ring in one process (tests, S = 1): ``rank`` of ``size`` ranks, with
    the *full* image K/V ``k_img``, ``v_img`` [B, N, H, Dh]; yields each source's rows (by
    ``sp_row_spans``) in ring order, as ``P2PRing`` receives them. The rank's own shard is
    taken from the tensors ``ring_attention`` passes."""

    k_img: torch.Tensor
    v_img: torch.Tensor
    rank: int
    size: int

    def shards(self, k_img: torch.Tensor, v_img: torch.Tensor, rows: Sequence[int]) -> Iterator[Shard]:
        spans = sp_row_spans(self.k_img.shape[1], self.size)
        if [hi - lo for lo, hi in spans] != list(rows):
            raise UnsupportedConfigError(f"{OP}: LocalRing holds {self.k_img.shape[1]} image rows, "
                                         f"the ranks' row counts {list(rows)} say otherwise")
        for src in ring_order(self.rank, self.size):
            if src == self.rank:
                yield src, k_img, v_img
            else:
                lo, hi = spans[src]
                yield src, self.k_img[:, lo:hi], self.v_img[:, lo:hi]


# ----------------------------------------------------------------------------- key runs


@dataclass(frozen=True)
class _Keys:
    """A run of whole key blocks [first, first + nb) of the blocked key layout (global block
    indices): the text keys, or one source rank's image shard. ``segments``: the source rank's
    segments (``None`` for text: its blocks merge sequentially)."""

    k: torch.Tensor  # [B, H, nb·64, Dh] FP32, absent slots +0
    v: torch.Tensor  # [B, H, nb·64, Dv] FP32, masked and absent keys +0
    valid: torch.Tensor  # [B, 1, 1, nb, 64]
    present: torch.Tensor  # [B, nb]
    first: int
    segments: tuple[tuple[int, int], ...] | None

    @property
    def nb(self) -> int:
        return self.present.shape[1]

    def fold(self, parts: list[Partial], combine: Combine) -> Partial | None:
        """The run's partial: text sequentially; a source rank's subtree over its segments."""
        if self.segments is None:
            return merge_sequential(parts, combine)
        return rank_subtree(self.segments, lambda bl: parts[bl[0] - self.first : bl[-1] + 1 - self.first], combine)


def _key_run(geo: AttnGeometry, k_rows, v_rows, first: int, nb: int, segments) -> _Keys:
    """Blocked FP32 keys/values of ``k_rows``, ``v_rows`` [B, n, H, D] (n ≤ 64·nb), whose first
    row is the start of global block ``first``; validity from the full geometry."""
    b = k_rows.shape[0]
    pad = BLOCK * nb - k_rows.shape[1]
    kb, vb = (torch.nn.functional.pad(heads_f32(x), (0, 0, 0, pad)) for x in (k_rows, v_rows))
    valid = geo.valid_k[:, first * BLOCK : (first + nb) * BLOCK]
    vb = torch.where(valid[:, None, :, None], vb, torch.zeros(()))  # masked keys' values +0
    return _Keys(kb, vb, valid.view(b, 1, 1, nb, BLOCK), geo.present_k[:, first : first + nb], first, segments)


def _chunked(pq: int, per_row: int, fn) -> Partial | None:
    """``fn(lo, hi)`` (a Partial over query rows [lo, hi) at axis 2, or None) over query chunks
    of whole 64-row blocks, concatenated along the query axis. ``None`` and ``present`` depend
    on the keys only, so they are the same for every chunk."""
    rows = BLOCK * max(1, QUERY_CHUNK_ELEMS // max(1, per_row * BLOCK))
    parts = [fn(lo, min(pq, lo + rows)) for lo in range(0, pq, rows)]
    if parts[0] is None:
        return None
    return Partial(tuple(torch.cat(vs, dim=2) for vs in zip(*(p.values for p in parts))), parts[0].present)


def _scores(qb: torch.Tensor, keys: _Keys, lo: int, hi: int) -> torch.Tensor:
    """Scaled FP32 scores of query rows [lo, hi) against the run: [B, H, rows, nb, 64]."""
    b, h = qb.shape[:2]
    return scores_blocked(qb[:, :, lo:hi], keys.k).view(b, h, hi - lo, keys.nb, BLOCK)


def _state(qb: torch.Tensor, keys: _Keys) -> Partial | None:
    """Pass 1: the run's softmax partial (m, l) [B, H, Pq]."""
    def chunk(lo, hi):
        m_b, l_b = softmax_block_states(_scores(qb, keys, lo, hi), keys.valid)
        return keys.fold(block_partials((m_b, l_b), keys.present, dim=-1), softmax_combine)
    return _chunked(qb.shape[2], qb.shape[0] * qb.shape[1] * keys.nb, chunk)


def _av(qb: torch.Tensor, keys: _Keys, m: torch.Tensor, l: torch.Tensor, dtype: torch.dtype) -> Partial | None:
    """Pass 2: the run's AV partial Σ P̃·v [B, H, Pq, Dv] (P̃ = P cast to ``dtype`` and back)."""
    b, h = qb.shape[:2]
    dv = keys.v.shape[-1]

    def chunk(lo, hi):
        p = softmax_probs(_scores(qb, keys, lo, hi), keys.valid, m[:, :, lo:hi], l[:, :, lo:hi])
        pc = p.to(dtype).to(torch.float32)  # the declared cast: P → activation dtype
        parts = block_weighted(pc.reshape(b * h, hi - lo, keys.nb, BLOCK),
                               keys.v.reshape(b * h, keys.nb, BLOCK, dv))  # [nb, BH, rows, Dv]
        return keys.fold(block_partials((parts.view(keys.nb, b, h, hi - lo, dv),), keys.present), add_combine)
    return _chunked(qb.shape[2], b * h * keys.nb, chunk)


# ----------------------------------------------------------------------------- the operator


def _check(q, k, v, key_mask, text_len, n_img, rows: int, rank: int, size: int) -> None:
    bad = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise UnsupportedConfigError(f"{OP}: {name} must be a [B, L + n_r, H, Dh] tensor")
        if t.dtype not in (torch.float32, torch.bfloat16):
            bad.append(f"{name} dtype {t.dtype} (float32 or bfloat16)")
        if t.device != q.device:
            bad.append(f"{name} on {t.device}, q on {q.device}")
    if isinstance(text_len, bool) or not isinstance(text_len, int) or text_len < 0:
        bad.append(f"text_len {text_len!r} (an int >= 0)")
    elif q.shape[1] != text_len + rows:
        bad.append(f"q length {q.shape[1]}: rank {rank} of {size} holds text_len {text_len} + {rows} "
                   f"image rows of n_img {n_img}")
    if tuple(k.shape) != tuple(q.shape):
        bad.append(f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        bad.append(f"v shape {tuple(v.shape)} does not match q {tuple(q.shape)} in [B, L + n_r, H]")
    if k.dtype != v.dtype:
        bad.append(f"k dtype {k.dtype} != v dtype {v.dtype} (one activation dtype)")
    if key_mask is not None and key_mask.device != q.device:
        bad.append(f"key_mask on {key_mask.device}, q on {q.device}")
    if bad:
        raise UnsupportedConfigError(f"{OP}: unsupported " + "; ".join(bad))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, *,
                   text_len: int, n_img: int, group: ProcessGroup | None = None,
                   transport: RingTransport | None = None) -> torch.Tensor:
    """Strict Ring attention forward: this rank's output rows, byte-equal to the strict
    ``joint_attention_fused`` on the full sequence at those rows (see the module docstring).

    Args:
        q, k, v: this rank's [B, L + n_r, H, Dh]: the L = ``text_len`` text positions
            (replicated on every rank), then its n_r image rows (``sp_row_spans(n_img, S)[rank]``).
        key_mask: the full joint key mask [B, L + N] bool (True = valid) or None.
        text_len: L.  n_img: N, the total image rows over all ranks.
        group: the SP process group (real P2P ring); ``None`` with ``transport=None``: S = 1.
        transport: a ``RingTransport`` standing in for the ring (``LocalRing``: tests).
    Returns:
        [B, L + n_r, H, Dh] in v's dtype.
    Raises:
        UnsupportedConfigError: see the module docstring.
    """
    if group is not None and transport is not None:
        raise UnsupportedConfigError(f"{OP}: give a process group or a transport, not both")
    if group is not None:
        transport = P2PRing(group)
    rank, size = (transport.rank, transport.size) if transport is not None else (0, 1)
    spans = sp_row_spans(n_img, size)  # checks S and n_img
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise UnsupportedConfigError(f"{OP}: rank {rank!r} outside [0, {size})")
    rows = [hi - lo for lo, hi in spans]
    _check(q, k, v, key_mask, text_len, n_img, rows[rank], rank, size)
    k_img, v_img = k[:, text_len:], v[:, text_len:]
    if transport is None:
        transport = LocalRing(k_img, v_img, 0, 1)
    b, _, h, _ = q.shape
    geo = geometry(OP, b, text_len + n_img, text_len + n_img, key_mask, text_len, q.device)
    lk = geo.lk
    owned = rank_segments(lk, size)  # global block ranges of each rank's segments
    first = [o[0][0] for o in owned]
    nbs = [o[-1][1] - o[0][0] for o in owned]
    lq = JointLayout(text_len + rows[rank], text_len)
    qb = lq.to_blocked(heads_f32(q), 2)  # [B, H, Pq, Dh]; image tiles start at the rank's first block
    text = _key_run(geo, k[:, :text_len], v[:, :text_len], 0, lk.text_blocks, None) if lk.text_blocks else None

    def over_ring(run, combine: Combine) -> Partial | None:
        """One pass over the ring: text ⊕ merge_tree(source subtrees in rank order) of ``run``."""
        subtrees: list[Partial | None] = [None] * size
        for src, ks, vs in transport.shards(k_img, v_img, rows):
            if nbs[src]:
                subtrees[src] = run(_key_run(geo, ks, vs, first[src], nbs[src], owned[src]))
        return finish_ranks(run(text) if text else None, subtrees, combine)

    if lq.padded == 0:  # no text and no image rows here: only relay the shards (both passes)
        for _ in range(2):
            for _ in transport.shards(k_img, v_img, rows):
                pass
        return v.new_empty(v.shape)
    m, l = over_ring(lambda keys: _state(qb, keys), softmax_combine).values  # pass 1: (m, l) [B, H, Pq]
    (y,) = over_ring(lambda keys: _av(qb, keys, m, l, v.dtype), add_combine).values  # pass 2: [B, H, Pq, Dv]
    return lq.from_blocked(y, 2).permute(0, 2, 1, 3).to(v.dtype)
