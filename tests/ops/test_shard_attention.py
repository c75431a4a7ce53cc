"""Strict attention contract v2 (docs/strict-arithmetic.md, "Attention (contract v2)"): the fused
operator equals the three unfused ones byte for byte, and the distributed arithmetic the
contract is built for reproduces them — simulated on the CPU from the public pieces of
``drifttool.ops.strict.attention_blocks`` / ``attention_core``:

* Ring attention: image *keys* split into 2/4/8 ranks on segment boundaries (text keys
  replicated); each rank computes the block states, probabilities, AV partials, Σ P·dP and dQ
  partials of its own keys (the fixed merge finishes them), and the dK, dV rows of its keys;
* SP: image *queries* split on segment boundaries (text queries replicated); each rank computes
  its rows and its dK/dV partials over its query blocks; the fixed merge finishes them.

Every comparison is on raw bits (``assert_same_bytes``), on fresh random inputs with padded
prompts of odd lengths.
"""

from __future__ import annotations

import pytest
import torch

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict import attention_fused
from drifttool.ops.strict.attention_blocks import (
    BLOCK,
    SEGMENTS,
    JointLayout,
    Partial,
    add_combine,
    block_partials,
    finish_ranks,
    image_segments,
    merge,
    merge_sequential,
    merge_tree,
    rank_segments,
    rank_subtree,
    softmax_block_states,
    softmax_combine,
    softmax_probs,
)
from drifttool.ops.strict.attention_core import (
    geometry,
    heads_f32,
    masked_keys,
    over_queries,
    qk_scale,
    query_block_parts,
    scores_blocked,
    scores_dot,
    softmax_backward_blocked,
    softmax_blocked,
)
from drifttool.ops.strict.attention_kernels import block_weighted
from drifttool.ops.strict_math import tree_sum
from tests.conftest import assert_same_bytes
from tests.harness import Target, targets


STRICT = targets("strict")
"""The unsharded strict operators the simulations must equal, per strict target (``strict-cpu``;
``strict-cuda`` once registered): the simulations define what a strict CUDA family reproduces."""


def strict(name, target: Target):
    """The strict ``target``'s operator ``name``, CPU tensors in and out (``Target.fn``)."""
    return target.fn(name)


def _inputs(seed, lens, lpad, n_img, heads, dh, dtype=torch.float32):
    """q, k, v [B, L+N, H, Dh] and the joint key mask for prompts of ``lens`` padded to ``lpad``."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    q, k, v = (torch.randn(b, lpad + n_img, heads, dh, generator=g).mul(1.5).to(dtype) for _ in range(3))
    km = torch.ones(b, lpad + n_img, dtype=torch.bool)
    for i, n in enumerate(lens):
        km[i, n:lpad] = False
    go = torch.randn(q.shape, generator=g).to(dtype)
    return q, k, v, km, go


def _grads(fn, q, k, v, go):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = fn(*leaves)
    return (o, *torch.autograd.grad(o, leaves, go))


def _unfused(km, lpad, target: Target):
    def f(q, k, v):
        s = strict("joint_attn_qk_gemm", target)(q, k, km, text_len=lpad)
        p = strict("joint_attn_softmax", target)(s, km, text_len=lpad)
        return strict("joint_attn_av_gemm", target)(p, v, km, text_len=lpad)
    return f


# ---------------------------------------------------------------------------------------------
# the fixed structure itself


def test_image_segments_recursive_halving():
    """8 segments by recursive halving at mid = lo + ⌈n/2⌉, covering the blocks in order; 6889
    image tokens = 108 blocks give unequal segments; fewer than 8 blocks leave empty segments."""
    for n in (0, 1, 3, 5, 8, 13, 16, 108):
        segs = image_segments(n)
        assert len(segs) == SEGMENTS and segs[0][0] == 0 and segs[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
        sizes = [hi - lo for lo, hi in segs]
        assert max(sizes) - min(sizes) <= 1
    assert [hi - lo for lo, hi in image_segments(108)] == [14, 13, 14, 13, 14, 13, 14, 13]
    assert image_segments(3) == ((0, 1), (1, 1), (1, 2), (2, 2), (2, 3), (3, 3), (3, 3), (3, 3))
    lay = JointLayout(16 + 6889, 16)
    assert (lay.text_blocks, lay.image_blocks) == (1, 108) and lay.segments()[0] == (1, 15)


def test_merge_tree_is_the_fixed_depth3_tree():
    """merge_tree over 8 segment partials = ((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7)) exactly, and
    absent (None or not present) partials are skipped, not added as zeros."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, generator=g) * 10 ** (i % 4) for i in range(8)]
    yes = torch.ones(5, dtype=torch.bool)
    parts = [Partial((x,), yes) for x in xs]
    want = ((xs[0] + xs[1]) + (xs[2] + xs[3])) + ((xs[4] + xs[5]) + (xs[6] + xs[7]))
    assert_same_bytes(merge_tree(parts, add_combine).values[0], want, "depth-3 tree")
    neg0 = torch.full((5,), -0.0)
    skipped = merge_tree([Partial((neg0,), yes), Partial((torch.zeros(5),), ~yes)] + [None] * 6, add_combine)
    assert_same_bytes(skipped.values[0], neg0, "an absent partial is skipped (−0 + +0 would give +0)")


def test_softmax_merge_matches_one_block_softmax():
    """Merging block states gives the softmax normaliser up to rounding (a sanity check of ⊕)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 2 * BLOCK, generator=g) * 4
    valid = torch.ones(1, 1, 2, BLOCK, dtype=torch.bool)
    m_b, l_b = softmax_block_states(x.view(3, 4, 2, BLOCK), valid)
    st = merge(Partial((m_b[..., 0], l_b[..., 0]), torch.ones((), dtype=torch.bool)),
               Partial((m_b[..., 1], l_b[..., 1]), torch.ones((), dtype=torch.bool)), softmax_combine)
    m, l = st.values
    assert torch.equal(m, x.amax(-1))
    torch.testing.assert_close(l.double(), torch.exp(x.double() - m.double()[..., None]).sum(-1), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# fused == unfused


@pytest.mark.parametrize("dh,lens,lpad,n_img,dtype", [
    (16, [7], 9, 150, torch.float32),
    (16, [5, 13, 1], 13, 131, torch.bfloat16),
    (16, [3, 70, 9], 77, 65, torch.float32),  # a text block fully padded for two samples
    (128, [11], 11, 70, torch.float32),
    (128, [3, 9, 6], 17, 33, torch.bfloat16),
], ids=["dh16-b1", "dh16-b3-bf16", "dh16-b3-two-text-blocks", "dh128-b1", "dh128-b3-bf16"])
@pytest.mark.parametrize("target", STRICT)
def test_fused_equals_unfused_forward_and_backward(dh, lens, lpad, n_img, dtype, target, monkeypatch):
    q, k, v, km, go = _inputs(11 + dh + lpad, lens, lpad, n_img, 2, dh, dtype)
    want = _grads(_unfused(km, lpad, target), q, k, v, go)
    got = _grads(lambda *t: strict("joint_attention_fused", target)(*t, km, text_len=lpad), q, k, v, go)
    for a, b, name in zip(got, want, ("out", "dq", "dk", "dv")):
        assert_same_bytes(a, b, f"fused vs unfused {name}")
    assert got[0].dtype == dtype
    monkeypatch.setattr(attention_fused, "QUERY_CHUNK_ELEMS", 1)  # a 64-row query block of one sample a chunk
    chunked = _grads(lambda *t: strict("joint_attention_fused", target)(*t, km, text_len=lpad), q, k, v, go)
    for a, b, name in zip(chunked, want, ("out", "dq", "dk", "dv")):
        assert_same_bytes(a, b, f"fused (64-row chunks) vs unfused {name}")


@pytest.mark.parametrize("target", STRICT)
def test_image_rows_invariant_to_text_length_and_padding(target):
    """Image queries' outputs and the image keys' dK, dV of a sample do not depend on how long its
    prompt is padded, nor on the padded length moving past a 64-key block boundary."""
    n, n_img, dh = 9, 140, 16
    q, k, v, _, go = _inputs(5, [n], n, n_img, 2, dh)
    base = _grads(lambda *t: strict("joint_attention_fused", target)(*t, None, text_len=n), q, k, v, go)
    for pad in (1, 55, 60, 120):
        z = torch.zeros(1, pad, 2, dh)
        qp, kp, vp, gp = (torch.cat([t[:, :n], z, t[:, n:]], 1) for t in (q, k, v, go))
        km = torch.ones(1, n + pad + n_img, dtype=torch.bool)
        km[:, n : n + pad] = False
        got = _grads(lambda *t: strict("joint_attention_fused", target)(*t, km, text_len=n + pad), qp, kp, vp, gp)
        keep = torch.cat([torch.arange(n), torch.arange(n + pad, n + pad + n_img)])
        for a, b, name in zip(got, base, ("out", "dq", "dk", "dv")):
            assert_same_bytes(a[:, keep], b, f"{name} with {pad} padded text positions")


@pytest.mark.parametrize("target", STRICT)
def test_text_len_is_checked(target):
    q, k, v, km, _ = _inputs(3, [4], 6, 10, 1, 16)
    for bad in (-1, 17, 2.0, True):
        with pytest.raises(UnsupportedConfigError, match="text_len"):
            strict("joint_attention_fused", target)(q, k, v, km, text_len=bad)
    km[:, :] = False
    with pytest.raises(UnsupportedConfigError, match="no valid key"):
        strict("joint_attn_softmax", target)(torch.zeros(1, 1, 16, 16), km, text_len=6)
    production = Target("production", target.device).fn("joint_attention_fused")
    production(q, k, v, None, text_len=6)  # accepted, ignored


# ---------------------------------------------------------------------------------------------
# Ring attention: image keys sharded on segment boundaries


def _ring(q, k, v, km, lpad, go):
    """Per rank (image key segments of 2/4/8 ranks; text keys on every rank): block states,
    probabilities, AV, Σ_k P·dP and dQ partials of its own keys, finished by the fixed order.
    Returns {ranks: (probs [B,H,S,S], out, dQ, dK, dV)}; dK, dV of a rank's keys sum over all
    queries (the query structure), which the rank sees as the ring passes them."""
    b, s, h, d = q.shape
    geo = geometry("ring", b, s, s, km, lpad)
    lay = geo.lk
    qb, kb = geo.lq.to_blocked(heads_f32(q), 2), geo.lk.to_blocked(heads_f32(k), 2)
    vb = masked_keys(geo, geo.lk.to_blocked(heads_f32(v), 2))
    kbm = masked_keys(geo, kb)
    gob = geo.lq.to_blocked(heads_f32(go), 2)
    valid = geo.valid_k.view(b, 1, 1, lay.n_blocks, BLOCK)
    res = {}

    def own(blocks):
        """What a rank holding key ``blocks`` computes: its scores [B,H,Pq,nb',64] and validity."""
        idx = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in blocks])
        sc = scores_blocked(qb, kb[:, :, idx]).view(b, h, -1, len(blocks), BLOCK)
        return sc, valid[:, :, :, blocks], geo.present_k[:, blocks], idx

    def states(blocks):
        sc, vv, pr, _ = own(blocks)
        m_b, l_b = softmax_block_states(sc, vv)
        return block_partials((m_b, l_b), pr, dim=-1)

    text_blocks = list(range(lay.text_blocks))
    for ranks in (2, 4, 8):
        owned = rank_segments(lay, ranks)
        text_state = merge_sequential(states(text_blocks), softmax_combine) if text_blocks else None
        subtrees = [rank_subtree(o, states, softmax_combine) for o in owned]
        m, l = finish_ranks(text_state, subtrees, softmax_combine).values
        p = torch.zeros(b, h, geo.lq.padded, lay.padded)
        pc = torch.zeros_like(p)

        def probs(blocks):
            sc, vv, _, idx = own(blocks)
            pr = softmax_probs(sc, vv, m, l).view(b, h, geo.lq.padded, -1)
            p[:, :, :, idx] = pr
            pc[:, :, :, idx] = pr.to(v.dtype).to(torch.float32)

        def weighted(w, x, blocks):
            """Per-block partials Σ_{k∈block} w[q,k]·x[k] of the rank's keys."""
            idx = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in blocks])
            wt = w[:, :, :, idx].reshape(b * h, geo.lq.padded, len(blocks), BLOCK)
            parts = block_weighted(wt, x[:, :, idx].reshape(b * h, len(blocks), BLOCK, d))
            return block_partials((parts.view(len(blocks), b, h, geo.lq.padded, d),), geo.present_k[:, blocks])

        for blocks in [text_blocks] + [list(range(lo, hi)) for o in owned for lo, hi in o]:
            if blocks:
                probs(blocks)
        av = finish_ranks(merge_sequential(weighted(pc, vb, text_blocks), add_combine) if text_blocks else None,
                          [rank_subtree(o, lambda bl: weighted(pc, vb, bl), add_combine) for o in owned],
                          add_combine).values[0]
        # backward: dP per element, Σ_k P·dP by the key structure, then dS, G and dQ = Σ_k G·K
        dp = torch.where(geo.valid_k[:, None, None, :], scores_dot(gob, vb), torch.zeros(()))

        def pdp(blocks):
            idx = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in blocks])
            t = (p[:, :, :, idx] * dp[:, :, :, idx]).view(b, h, -1, len(blocks), BLOCK)
            t = torch.where(valid[:, :, :, blocks], t, torch.zeros(()))
            return block_partials((tree_sum(t, -1),), geo.present_k[:, blocks], dim=-1)

        r = finish_ranks(merge_sequential(pdp(text_blocks), add_combine) if text_blocks else None,
                         [rank_subtree(o, pdp, add_combine) for o in owned], add_combine).values[0]
        pb, dpb = p.view(b, h, -1, lay.n_blocks, BLOCK), dp.view(b, h, -1, lay.n_blocks, BLOCK)
        gq = torch.where(valid, pb * (dpb - r[..., None, None]), torch.zeros(())).view(p.shape) * qk_scale(d)
        dq = finish_ranks(merge_sequential(weighted(gq, kbm, text_blocks), add_combine) if text_blocks else None,
                          [rank_subtree(o, lambda bl: weighted(gq, kbm, bl), add_combine) for o in owned],
                          add_combine).values[0]
        # dK, dV of the rank's own keys: Σ over all queries (the query structure), per key row
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        for blocks in [text_blocks] + [list(range(lo, hi)) for o in owned for lo, hi in o]:
            if blocks:
                idx = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in blocks])
                dk[:, :, idx] = over_queries(geo, gq[:, :, :, idx], qb)
                dv[:, :, idx] = over_queries(geo, pc[:, :, :, idx], gob)
        unb = lambda t: geo.lk.from_blocked(geo.lq.from_blocked(t, 2), 3)  # noqa: E731
        rows = lambda t, like: geo.lk.from_blocked(t, 2).permute(0, 2, 1, 3).to(like.dtype)  # noqa: E731
        res[ranks] = (unb(p), geo.lq.from_blocked(av, 2).permute(0, 2, 1, 3).to(v.dtype),
                      geo.lq.from_blocked(dq, 2).permute(0, 2, 1, 3).to(q.dtype),
                      rows(masked_keys(geo, dk), k), rows(masked_keys(geo, dv), v))
    return res


@pytest.mark.parametrize("lens,lpad,n_img,dh,dtype", [
    ([5, 12, 1], 13, 600, 16, torch.float32),  # 10 image blocks: segments of 2 and 1
    ([7], 70, 333, 16, torch.bfloat16),  # 6 image blocks: empty segments; 2 text blocks
    ([4, 9], 9, 200, 64, torch.float32),  # tiled kernels
], ids=["b3-n600", "b1-n333-bf16", "dh64-b2-n200"])
@pytest.mark.parametrize("target", STRICT)
def test_ring_key_shards_reproduce_softmax_av_and_dq(lens, lpad, n_img, dh, dtype, target):
    q, k, v, km, go = _inputs(21 + n_img, lens, lpad, n_img, 1, dh, dtype)
    s = strict("joint_attn_qk_gemm", target)(q, k, km, text_len=lpad)
    p_want = strict("joint_attn_softmax", target)(s, km, text_len=lpad)
    o_want, dq_want, dk_want, dv_want = _grads(_unfused(km, lpad, target), q, k, v, go)
    for ranks, (p, o, dq, dk, dv) in _ring(q, k, v, km, lpad, go).items():
        assert_same_bytes(p, p_want, f"Ring {ranks} ranks: probabilities")
        assert_same_bytes(o, o_want, f"Ring {ranks} ranks: output")
        assert_same_bytes(dq, dq_want, f"Ring {ranks} ranks: dQ")
        assert_same_bytes(dk, dk_want, f"Ring {ranks} ranks: dK of each rank's keys")
        assert_same_bytes(dv, dv_want, f"Ring {ranks} ranks: dV of each rank's keys")


# ---------------------------------------------------------------------------------------------
# SP: image queries sharded on segment boundaries


def _sp(q, k, v, km, lpad, go, ranks, target: Target):
    """Each rank holds the text queries (replicated) and the image query segments of its rank:
    its output rows (the fused operator on its queries) and its dK, dV partials over its query
    blocks, finished by the fixed order of the query axis; each rank's forward rows come from
    ``target``'s fused operator. Returns (out, dk, dv)."""
    b, s, h, d = q.shape
    geo = geometry("sp", b, s, s, km, lpad)
    lq = geo.lq
    qb, kb = lq.to_blocked(heads_f32(q), 2), geo.lk.to_blocked(heads_f32(k), 2)
    vb = masked_keys(geo, geo.lk.to_blocked(heads_f32(v), 2))
    gob = lq.to_blocked(heads_f32(go), 2)
    fused = strict("joint_attention_fused", target)
    out = torch.empty_like(q)
    t_idx = torch.arange(lpad)

    def rows_of(blocks):
        return torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in blocks])

    def parts(blocks):
        """dK, dV per-query-block partials of the rank's query blocks, from its own rows."""
        rows = rows_of(blocks)
        sc = scores_blocked(qb[:, :, rows], kb)
        p, _, _ = softmax_blocked(geo, sc)
        dp = torch.where(geo.valid_k[:, None, None, :], scores_dot(gob[:, :, rows], vb), torch.zeros(()))
        g = softmax_backward_blocked(geo, p, dp) * qk_scale(d)
        pc = p.to(v.dtype).to(torch.float32)
        pres = geo.present_q[:, blocks]
        return (block_partials((torch.stack(query_block_parts(g, qb[:, :, rows])),), pres),
                block_partials((torch.stack(query_block_parts(pc, gob[:, :, rows])),), pres))

    text_blocks = list(range(lq.text_blocks))
    tk, tv = parts(text_blocks) if text_blocks else ([], [])
    subs_k, subs_v = [], []
    for owned in rank_segments(lq, ranks):
        mine_parts = {lo: parts(list(range(lo, hi))) for lo, hi in owned if hi > lo}  # the rank's own rows only
        subs_k.append(rank_subtree(owned, lambda bl: mine_parts[bl[0]][0], add_combine))
        subs_v.append(rank_subtree(owned, lambda bl: mine_parts[bl[0]][1], add_combine))
        # forward: the rank's own rows [text, its image rows] through the fused operator
        img = torch.cat([torch.arange(lpad + (lo - lq.text_blocks) * BLOCK, min(s, lpad + (hi - lq.text_blocks) * BLOCK))
                         for lo, hi in owned if hi > lo] or [torch.arange(0)])
        mine = torch.cat([t_idx, img])
        out[:, mine] = fused(q[:, mine], k, v, km, text_len=lpad)
    res = [out]
    for text, subs, like in ((tk, subs_k, k), (tv, subs_v, v)):
        t = finish_ranks(merge_sequential(text, add_combine), subs, add_combine).values[0]
        res.append(geo.lk.from_blocked(masked_keys(geo, t), 2).permute(0, 2, 1, 3).to(like.dtype))
    return res


def _check_sp(lens, lpad, n_img, dh, dtype, ranks_list, target: Target):
    q, k, v, km, go = _inputs(31 + n_img, lens, lpad, n_img, 1, dh, dtype)
    go = go * km[:, :, None, None].to(dtype)  # padded text rows: zero output gradient, as in the model
    o_want, _, dk_want, dv_want = _grads(_unfused(km, lpad, target), q, k, v, go)
    for ranks in ranks_list:
        o, dk, dv = _sp(q, k, v, km, lpad, go, ranks, target)
        assert_same_bytes(o, o_want, f"SP {ranks} ranks: output rows")
        assert_same_bytes(dk, dk_want, f"SP {ranks} ranks: dK")
        assert_same_bytes(dv, dv_want, f"SP {ranks} ranks: dV")


@pytest.mark.parametrize("lens,lpad,n_img,dh,dtype", [
    ([5, 12, 1], 13, 600, 16, torch.float32),
    ([7], 70, 333, 16, torch.bfloat16),
    ([4, 9], 9, 200, 64, torch.float32),
], ids=["b3-n600", "b1-n333-bf16", "dh64-b2-n200"])
@pytest.mark.parametrize("target", STRICT)
def test_sp_query_shards_reproduce_rows_dk_dv(lens, lpad, n_img, dh, dtype, target):
    _check_sp(lens, lpad, n_img, dh, dtype, (2, 4, 8), target)


@pytest.mark.slow  # 6905 × 6905 scores several times over
@pytest.mark.parametrize("target", STRICT)
def test_sp_query_shards_at_6889_image_tokens(target):
    """1328² image tokens (108 blocks, unequal segments) with a prompt of 7 tokens padded to 16."""
    _check_sp([7], 16, 6889, 16, torch.float32, (2, 8), target)
