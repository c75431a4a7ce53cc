"""Strict Ring attention forward (``drifttool.distributed.ring``): every SP rank's output rows are
the raw bits of the strict fused operator's rows on the full sequence (docs/strict-arithmetic.md,
"Attention (contract v2)").

* one process, S ∈ {1, 2, 4, 8} simulated through ``LocalRing`` (every rank of S in turn):
  FP32 and BF16, head dims 16 (exact kernels) and 64 (tiled), batch 1 and 3, odd padded prompts
  with a key mask, image counts with empty (333) and unequal (600) segments, query chunking;
* real processes over gloo (``on_ranks``, S = 2 and 4): ``P2PRing`` on the mesh's ``sp`` group;
* ``sp_row_spans`` and the refusals.

Inputs are fresh random tensors from a seeded generator; comparisons by ``assert_same_bytes``.
"""

from __future__ import annotations

import pytest
import torch

from drifttool.distributed import ring
from drifttool.distributed.plan import ParallelDims
from drifttool.distributed.ring import LocalRing, ring_attention, sp_row_spans
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict.attention_blocks import BLOCK, JointLayout, rank_segments
from tests.conftest import assert_same_bytes
from tests.distributed.plan_ranks import on_ranks
from tests.harness import Target

FUSED = Target("strict", "cpu").fn("joint_attention_fused")


def _inputs(seed, lens, lpad, n_img, heads, dh, dtype):
    """Full q, k, v [B, L+N, H, Dh] and the joint key mask for prompts ``lens`` padded to ``lpad``
    (``lens`` None: no mask)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens) if lens else 1
    q, k, v = (torch.randn(b, lpad + n_img, heads, dh, generator=g).mul(1.5).to(dtype) for _ in range(3))
    if lens is None:
        return q, k, v, None
    km = torch.ones(b, lpad + n_img, dtype=torch.bool)
    for i, n in enumerate(lens):
        km[i, n:lpad] = False
    return q, k, v, km


def _rows(lpad, span):
    """Sequence positions a rank holds: the text, then its image rows."""
    lo, hi = span
    return torch.cat([torch.arange(lpad), lpad + torch.arange(lo, hi)])


def _simulate(q, k, v, km, lpad, n_img, ranks):
    """Each rank's rows of ``ranks`` simulated ranks, through ``LocalRing`` (or no transport: S = 1)."""
    out = []
    for r, span in enumerate(sp_row_spans(n_img, ranks)):
        idx = _rows(lpad, span)
        tr = LocalRing(k[:, lpad:], v[:, lpad:], r, ranks) if ranks > 1 else None
        out.append((idx, ring_attention(q[:, idx], k[:, idx], v[:, idx], km, text_len=lpad, n_img=n_img,
                                        transport=tr)))
    return out


CASES = [
    ([5, 12, 1], 13, 600, 16, torch.float32),  # 10 image blocks: unequal segments (2 and 1)
    ([5, 12, 1], 13, 333, 16, torch.bfloat16),  # 6 image blocks: empty segments (ranks of 8 empty)
    ([7], 70, 333, 64, torch.float32),  # tiled kernels; two text blocks, the second all padding
    ([4, 9, 2], 9, 600, 64, torch.bfloat16),  # tiled, batch 3
    (None, 0, 130, 16, torch.float32),  # no text, no mask
]


@pytest.mark.parametrize("lens,lpad,n_img,dh,dtype", CASES,
                         ids=["b3-n600-f32", "b3-n333-bf16", "dh64-b1-n333-f32", "dh64-b3-n600-bf16", "no-text"])
def test_simulated_ring_equals_fused(lens, lpad, n_img, dh, dtype):
    q, k, v, km = _inputs(41 + n_img + dh, lens, lpad, n_img, 2, dh, dtype)
    want = FUSED(q, k, v, km, text_len=lpad)
    for ranks in (1, 2, 4, 8):
        seen = []
        for idx, got in _simulate(q, k, v, km, lpad, n_img, ranks):
            assert got.dtype == dtype
            assert_same_bytes(got, want[:, idx], f"Ring {ranks} ranks: rows {idx[lpad:lpad + 1].tolist()}…")
            seen.append(idx[lpad:])
        assert torch.equal(torch.cat(seen), torch.arange(lpad, lpad + n_img))  # every image row once


def test_query_chunking_changes_no_byte(monkeypatch):
    """One 64-row query block per chunk (``QUERY_CHUNK_ELEMS`` = 1) gives the same bytes."""
    q, k, v, km = _inputs(7, [3, 11], 11, 300, 2, 64, torch.float32)
    want = FUSED(q, k, v, km, text_len=11)
    monkeypatch.setattr(ring, "QUERY_CHUNK_ELEMS", 1)
    for idx, got in _simulate(q, k, v, km, 11, 300, 4):
        assert_same_bytes(got, want[:, idx], "Ring 4 ranks, 64-row query chunks")


def test_sp_row_spans_are_segment_aligned():
    for n in (0, 1, 64, 65, 130, 333, 600, 6889):
        lay = JointLayout(n, 0)
        for sp in (1, 2, 4, 8):
            spans = sp_row_spans(n, sp)
            assert len(spans) == sp and spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(spans, spans[1:]))
            for (lo, hi), segs in zip(spans, rank_segments(lay, sp)):
                assert lo == min(segs[0][0] * BLOCK, n) and hi == min(segs[-1][1] * BLOCK, n)
    assert sp_row_spans(333, 8)[3] == (192, 192) and sp_row_spans(333, 8)[7] == (333, 333)
    assert sp_row_spans(600, 4) == [(0, 192), (192, 320), (320, 512), (512, 600)]


def test_refusals():
    q, k, v, km = _inputs(3, [4], 6, 200, 1, 16, torch.float32)
    idx = _rows(6, sp_row_spans(200, 2)[0])
    args = (q[:, idx], k[:, idx], v[:, idx], km)
    with pytest.raises(UnsupportedConfigError, match="SP degree"):
        sp_row_spans(200, 3)
    with pytest.raises(UnsupportedConfigError, match="SP degree"):
        ring_attention(*args, text_len=6, n_img=200, transport=LocalRing(k[:, 6:], v[:, 6:], 0, 3))
    with pytest.raises(UnsupportedConfigError, match="q length"):  # rank 0 of 2's rows, but S = 1
        ring_attention(*args, text_len=6, n_img=200)
    with pytest.raises(UnsupportedConfigError, match="q length"):
        ring_attention(q, k, v, km, text_len=6, n_img=200, transport=LocalRing(k[:, 6:], v[:, 6:], 1, 2))
    with pytest.raises(UnsupportedConfigError, match="not both"):
        ring_attention(*args, text_len=6, n_img=200, group=object(), transport=LocalRing(k[:, 6:], v[:, 6:], 0, 2))
    with pytest.raises(UnsupportedConfigError, match="dtype"):
        ring_attention(q.double(), k.double(), v.double(), km, text_len=6, n_img=200)
    with pytest.raises(UnsupportedConfigError, match="key_mask"):
        ring_attention(q, k, v, km[:, :-1], text_len=6, n_img=200)
    with pytest.raises(UnsupportedConfigError, match="LocalRing holds"):
        ring_attention(*args, text_len=6, n_img=200, transport=LocalRing(k[:, 7:], v[:, 7:], 0, 2))
    with pytest.raises(UnsupportedConfigError, match="rank 2 outside"):
        ring_attention(*args, text_len=6, n_img=200, transport=LocalRing(k[:, 6:], v[:, 6:], 2, 2))
    with pytest.raises(UnsupportedConfigError, match="no process group"):
        ring_attention(*args, text_len=6, n_img=200, group=object())


# ---------------------------------------------------------------------------------------------
# real processes: P2P over gloo


PROCESS_CASES = {  # S: (layout, inputs)
    # two rings of 2 (TP innermost: SP groups {0, 2} and {1, 3}, peers are not the group ranks); tiled
    2: (ParallelDims(sp=2, tp=2), dict(seed=5, lens=[5, 12, 1], lpad=13, n_img=333, heads=2, dh=64,
                                       dtype=torch.bfloat16)),
    # one ring of 4; 3 image blocks leave rank 3 without rows (it only relays)
    4: (ParallelDims(sp=4), dict(seed=6, lens=[3, 9], lpad=9, n_img=130, heads=2, dh=16, dtype=torch.float32)),
}


def rank_case(ctx, dims, arg):
    """Rank body: build the full inputs from the seed, compute this rank's rows over the ``sp``
    group. Returns (SP rank, rows)."""
    c = arg
    q, k, v, km = _inputs(c["seed"], c["lens"], c["lpad"], c["n_img"], c["heads"], c["dh"], c["dtype"])
    group = ctx.mesh.get_group("sp")
    rank = torch.distributed.get_rank(group)
    idx = _rows(c["lpad"], sp_row_spans(c["n_img"], dims.sp)[rank])
    return rank, ring_attention(q[:, idx], k[:, idx], v[:, idx], km, text_len=c["lpad"], n_img=c["n_img"],
                                group=group)


@pytest.mark.parametrize("sp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_p2p_ring_over_gloo_equals_fused(sp):
    dims, c = PROCESS_CASES[sp]
    q, k, v, km = _inputs(c["seed"], c["lens"], c["lpad"], c["n_img"], c["heads"], c["dh"], c["dtype"])
    want = FUSED(q, k, v, km, text_len=c["lpad"])
    spans = sp_row_spans(c["n_img"], sp)
    got = on_ranks(dims, "tests.distributed.test_ring:rank_case", c)
    assert sorted(r for r, _ in got) == sorted(list(range(sp)) * (dims.world_size // sp))
    for g, (r, rows) in enumerate(got):
        assert_same_bytes(rows, want[:, _rows(c["lpad"], spans[r])], f"P2P ring, process {g}: SP rank {r} of {sp}")
