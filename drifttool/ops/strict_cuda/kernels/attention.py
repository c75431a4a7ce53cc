"""Strict joint attention on CUDA (contract cuda1): one Triton kernel, four modes — the fused
attention and its three unfused operators, byte-equal to one another by construction.

    >>> o = attention(q, k, v, key_mask, text_len=L)            # [B,S,H,Dh], v's dtype
    >>> p = softmax(scores(q, k, text_len=L), key_mask, text_len=L)   # [B,H,S,S] FP32 each
    >>> assert torch.equal(attend(p, v, key_mask, text_len=L), o)      # on the GPU, bytes

Layout (as contract v2's): the joint sequence is [text (padded length L = ``text_len``), image
(N)]. Keys are walked in fixed 64-key blocks in global key order — text blocks from key 0
(⌈L/64⌉ of them, the last one ending at L), then image blocks from key L (⌈N/64⌉, the last one
ending at S) — so prompt padding never moves an image key between blocks. Query tiles of
``BLOCK_M`` rows are aligned the same way (text tiles from row 0, image tiles from row L).

Arithmetic of one query row i (``MODE_FUSED``; FP32 throughout, every operation rounded on its
own: the kernels are compiled with FMA contraction off):

* s_j = fp32(q_i · k_j) · fp32(1/√Dh), the dot one ``tl.dot`` of a [BLOCK_M, Dh] by [Dh, 64] tile
  (bf16 operands on tensor cores with an FP32 accumulator, or FP32 operands in IEEE FP32); x_j =
  s_j · fp32(log2 e), masked keys x_j = −inf;
* pass 1, blocks in order (a block without a valid key is skipped; masked K/V rows never read):
  m' = max(m, max_j x_j); l = l · exp2(m − m') + Σ_j exp2(x_j − m') (the block's Σ is ``tl.sum``
  on the score tile in the tensor-core accumulator layout — see ``_canonical``); m = m';
* pass 2, blocks in the same order: P_j = exp2(x_j − m) · fp32(1/l) (1/l correctly rounded);
  acc += P̃ · V_block with
  P̃ = P cast to v's dtype (one ``tl.dot`` [BLOCK_M, 64] by [64, Dh], FP32 accumulator);
* out_i = acc cast once to v's dtype.

exp2 is the GPU's ``ex2.approx.f32``. The unfused modes run the same code on the same tiles:
``MODE_QK`` writes s (every key, masked or not), ``MODE_SOFTMAX`` reads s back and writes P
(masked keys +0), ``MODE_AV`` reads P back and runs pass 2's product. The only reduction whose
order could follow the register layout is the block's Σ in pass 1; ``_canonical`` moves every
score tile into the tensor-core accumulator layout first (a dot with zero operands: s + 0 = s),
so that Σ runs in one layout whatever produced the tile.

Why two passes (QKᵀ computed twice) and not FlashAttention's one-pass online form: the unfused
operators must be byte-equal to the fused one, and the one-pass form's output
(Σ_b Π alpha · (P_b cast)·V_b) / l casts probabilities relative to a running max — numbers the
unfused softmax cannot hand to the AV product (it must output normalised probabilities). The
cost on paper: 3 instead of 2 [S × S × Dh] matmuls (1.5× the tensor-core work) and 2 instead of
1 exp2 per score.

Fixed configuration, for every shape: ``BLOCK_N`` = 64 keys; bf16 operands ``BLOCK_M`` = 128
query rows, 4 warps, 2 pipeline stages, TMA loads of the whole image blocks' K and V (``CONFIG``);
FP32 operands 64 rows, 4 warps, 1 stage. No split-KV, no
atomics; one program per (batch·head, query tile). The warps split the tile's rows only (the
tensor-core layout ``warpsPerCTA [n, 1]``: each warp holds whole rows of a score tile), so a
row's block Σ runs in one order whatever the query rows or warps; a configuration whose warps
also split the 64 keys (64 rows on 8 warps: ``[4, 2]``) sums each row in another order and gives
other bytes — launch configurations are part of the contract.

The per-block pieces (scores, pass 1's state update, pass 2's probabilities) are
``kernels.attention_block``'s, shared with the backward kernels.

Row states for the backward (``attention(..., with_stats=True)``, the fused mode only): the
program also stores each row's m (−inf taken as 0) and fp32(1/l) — the two numbers pass 2 reads —
to a [B,H,2,Sq] FP32 tensor (``STORE_ML``, a constexpr: without it the kernel compiles to the
forward-only code; with it the same floating-point instructions plus the two stores, so the
output's bytes do not change). ``kernels.attention_backward`` recomputes P from them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from drifttool.capture import gpu_rows, produced
from drifttool.capture.gpu_rows_kernels import (_add_terms, _fold_terms, _no_terms, _store_rows_digest, _tile_digest,
                                              _tile_terms)
from drifttool.ops.strict_cuda.kernels.attention_block import (_NEG_INF, _canonical, _key_ok, _probs, _qk, _scores,
                                                              _state, _tile)

BLOCK_N = 64
"""Keys per block: part of the reduction order (contract)."""
BLOCK_M = 128
"""Query rows per program for bf16 operands (does not change a row's bytes while every warp holds
whole rows: module docstring)."""
NUM_WARPS = 4
NUM_STAGES = 2

MODE_FUSED, MODE_QK, MODE_SOFTMAX, MODE_AV = 0, 1, 2, 3
FOLD_BLOCKS = tl.constexpr(256)
"""Image key blocks whose internals' limb sums are carried in int32 between folds: 256 blocks of
64 FP32 keys are 2**16 byte columns, each term at most 2**14 in magnitude (``_tile_limbs``), so
the sums stay below 2**30; the text blocks (the prompt's slots, far fewer) are folded before
them."""
INTERNALS_CONFIG = (BLOCK_M, 8, NUM_STAGES, False)
"""The bf16 launch that also digests the scores and probabilities (``attention``'s ``internals``):
8 warps, so each holds 16 whole rows (the same bytes) and the digests' registers fit better
(offline sm_90a, Dh 128: 448 bytes of spills, against 2.5 KiB at 4 warps)."""
INTERNALS_MIN_HEAD_DIM = 32
"""The narrowest heads the internals launch takes. At Dh 16 it made an out-of-range shared or
local memory access on an H200 (Triton 3.6, compute-sanitizer's memcheck; every launch
configuration tried, with and without the output's digest). Verified on the H200: Dh 32 (the
tiny model's records equal the decomposition's) and Dh 128 (full width: the output's bytes and
both tables). ``attention`` refuses narrower heads; the registered operator's ``internals``
declines them and the decomposition runs (the same records)."""


@triton.jit
def _pass1(q, k_base, skn, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale, m_i, l_i,
           MODE: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if MODE == 2:  # MODE_SOFTMAX: the scores written by MODE_QK
        s = _canonical(_tile(x_rows, sxn, j, ok, row_ok), BLOCK_M, BLOCK_N)
    else:
        s = _scores(q, k_base, skn, j, ok, offs_d, sm_scale, MASKED, IEEE)
        if IEEE:  # the FP32 dot's result layout is not the tensor core's
            s = _canonical(s, BLOCK_M, BLOCK_N)
    return _state(s, ok, m_i, l_i, MASKED)


@triton.jit
def _pass2(q, k_base, skn, v_base, svn, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale, m_use, r_i, acc,
           MODE: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    if MODE == 3:  # MODE_AV: the probabilities written by MODE_SOFTMAX (masked keys +0)
        p = _tile(x_rows, sxn, j, ok, row_ok)
    else:
        s = _scores(q, k_base, skn, j, ok, offs_d, sm_scale, MASKED, IEEE)
        p = _probs(s, ok, m_use, r_i, MASKED)
    return _pv(p, v_base, svn, j, ok, offs_d, acc, MASKED, IEEE)


@triton.jit
def _pv(p, v_base, svn, j, ok, offs_d, acc, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """acc + P̃·V for one key block (P cast to V's dtype)."""
    vp = v_base + j[:, None] * svn + offs_d[None, :]
    if MASKED:
        v = tl.load(vp, mask=ok[:, None], other=0.0)
    else:
        v = tl.load(vp)
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc


@triton.jit
def _pass2_digested(s, ok, sel, m_use, r_i, v_base, svn, j, offs_d, acc, col0, IK, iktab, ls, lp, ts, tp,
                    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_pass2`` (MODE_FUSED) from this block's scores ``s`` (every key inside the sequence
    read, as MODE_QK reads them; ``ok``: the valid keys), also adding digest v2's row terms of the
    scores and of the probabilities P, as MODE_QK and MODE_SOFTMAX store them, at the record's
    columns ``col0 + [0, BLOCK_N)`` where ``sel`` holds (the keys the record keeps): their limb
    sums to ``ls`` and ``lp``, their summaries to ``ts`` and ``tp`` (``_tile_terms``; the caller
    folds)."""
    p = _probs(s, ok, m_use, r_i, True)
    sel = sel[None, :]
    ls, ts = _tile_terms(s, col0, sel, IK, iktab, ls, ts, BLOCK_M, BLOCK_N, 4, True)
    lp, tp = _tile_terms(p, col0, sel, IK, iktab, lp, tp, BLOCK_M, BLOCK_N, 4, True)
    return _pv(p, v_base, svn, j, ok, offs_d, acc, True, IEEE), ls, lp, ts, tp


@triton.jit
def _pass1_tma(q, KD, row, col, sm_scale, m_i, l_i, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``_pass1`` (MODE_FUSED) on a whole image block, every key valid, its K tile [64, Dh] loaded
    through the TMA descriptor ``KD`` at (row, col) of K's [B·S, H·Dh] view: the same values."""
    s = _qk(q, KD.load([row, col]), sm_scale, IEEE)
    if IEEE:
        s = _canonical(s, BLOCK_M, BLOCK_N)
    return _state(s, s, m_i, l_i, False)


@triton.jit
def _pass2_tma(q, KD, VD, row, col, sm_scale, m_use, r_i, acc, IEEE: tl.constexpr):
    """``_pass2`` (MODE_FUSED) on a whole image block, its K and V tiles loaded through TMA."""
    p = _probs(_qk(q, KD.load([row, col]), sm_scale, IEEE), acc, m_use, r_i, False)
    v = VD.load([row, col])
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc


@triton.jit
def _internals(q, k_base, sks, v_base, svs, offs_m, offs_n, offs_d, row_ok, b, h, sm_scale, m_use, r_i,
               acc, MASK, smb, SQ, S, L, n_rows, IK, iktab, SDR, SDS, PDR, PDS, ISHIFT, T0, NV,
               HAS_MASK: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Pass 2 of MODE_FUSED with the internals digested (``attention``'s ``internals``): the same
    blocks in the same order as pass 2 (every image key valid: whole image blocks unmasked), each
    block's scores and probabilities digested at their canonical columns — head h's keys
    ``[h·Kv, (h+1)·Kv)`` of the sample's ``Kv = n + S − L`` valid keys, text key j at
    ``j − t0``, image key j at ``n + j − L`` — as head h's column split of the scores' and P's
    row tables (rows ``b·SQ + query row``). Returns the accumulator (the output before its cast)."""
    t0 = tl.load(T0 + b)
    n = tl.load(NV + b)
    base = h * (n + S - L)
    ts = _no_terms(BLOCK_M)
    tp = _no_terms(BLOCK_M)
    ls = tl.zeros([BLOCK_M, 16], tl.int32)  # limb sums, folded after the text blocks and after
    lp = tl.zeros([BLOCK_M, 16], tl.int32)  # every FOLD_BLOCKS image blocks
    n_tb = tl.cdiv(L, BLOCK_N)
    for t in tl.range(0, n_tb, num_stages=1):
        j = t * BLOCK_N + offs_n
        ok = _key_ok(MASK, smb, b, j, L, HAS_MASK)
        sel = (j >= t0) & (j < t0 + n)  # the prompt's keys the record keeps
        if tl.max((ok | sel).to(tl.int32), 0) > 0:
            s = _scores(q, k_base, sks, j, j < L, offs_d, sm_scale, True, IEEE)
            acc, ls, lp, ts, tp = _pass2_digested(s, ok, sel, m_use, r_i, v_base, svs, j, offs_d, acc,
                                                  base + t * BLOCK_N - t0, IK, iktab, ls, lp, ts, tp, IEEE,
                                                  BLOCK_M, BLOCK_N)
    n_ib = tl.cdiv(S - L, BLOCK_N)
    for c in tl.range(0, n_ib, FOLD_BLOCKS, num_stages=1):
        ts = _fold_terms(ts, ls)
        tp = _fold_terms(tp, lp)
        ls = tl.zeros([BLOCK_M, 16], tl.int32)
        lp = tl.zeros([BLOCK_M, 16], tl.int32)
        for t in tl.range(c, tl.minimum(c + FOLD_BLOCKS, n_ib), num_stages=1):
            j = L + t * BLOCK_N + offs_n
            inside = j < S
            s = _scores(q, k_base, sks, j, inside, offs_d, sm_scale, True, IEEE)
            acc, ls, lp, ts, tp = _pass2_digested(s, _key_ok(MASK, smb, b, j, S, HAS_MASK), inside, m_use, r_i,
                                                  v_base, svs, j, offs_d, acc, base + n + t * BLOCK_N, IK, iktab,
                                                  ls, lp, ts, tp, IEEE, BLOCK_M, BLOCK_N)
    ts = _fold_terms(ts, ls)
    tp = _fold_terms(tp, lp)
    rows = b * SQ + offs_m
    s1 = tl.load(ISHIFT + b * 2)
    s2 = tl.load(ISHIFT + b * 2 + 1)
    _store_rows_digest(SDR, SDS, rows, row_ok, n_rows, h, s1, s2, ts)
    _store_rows_digest(PDR, PDS, rows, row_ok, n_rows, h, s1, s2, tp)
    return acc


@triton.jit(do_not_specialize=["SQ", "S", "L", "n_tq"])
def _attn_kernel(Q, K, V, X, Y, MASK, IMG_FULL, sm_scale,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                 sxb, sxh, sxm, sxn, sy0, sy1, sy2,
                 smb, H, SQ, S, L, n_tq, ML, KD, VD, KEYS, ktab, DR, DS, shift_t, shift_t2, rows,
                 IK, iktab, SDR, SDS, PDR, PDS, ISHIFT, T0, NV,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 MODE: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
                 STORE_ML: tl.constexpr = False, TMA: tl.constexpr = False, DIGEST: tl.constexpr = False,
                 WBYTES: tl.constexpr = 2, INTERNALS: tl.constexpr = False):
    """One program per (query tile, batch·head). X: scores (SOFTMAX) or probabilities (AV) in;
    Y: output — [B,S,H,Dh] (FUSED, AV: strides sy0..2 = b, s, h; last 1) or [B,H,S,S] FP32 (QK,
    SOFTMAX: b, h, m; last 1). SQ query rows ([text L, image]), S keys (L text, S − L image).
    STORE_ML (FUSED, a gradient wanted): ML [B,H,2,SQ] FP32 receives each row's (m, 1/l) as pass 2
    uses them; without it ML is None (a constexpr) and the kernel is the forward-only one.
    TMA (FUSED): KD, VD are TMA descriptors of K and V as [B·S, H·Dh] with [64, Dh] blocks; the
    whole image blocks of a sample whose image keys are all valid load through them (the loads
    only: the same values, the same arithmetic); every other block reads through pointers."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kv_row = (pid_bh // H) * S + L  # TMA: the sample's first image key in the [B·S, H·Dh] view
    kv_col = (pid_bh % H) * HEAD_DIM
    if pid_m < n_tq:  # text query tiles from row 0, image query tiles from row L
        row0 = pid_m * BLOCK_M
        row_end = L
    else:
        row0 = L + (pid_m - n_tq) * BLOCK_M
        row_end = SQ
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < row_end

    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    x_rows = X + b * sxb + h * sxh + offs_m[:, None] * sxm
    if MODE >= 2:
        q = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # unused: SOFTMAX and AV read X
    else:
        q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    n_tb = tl.cdiv(L, BLOCK_N)
    n_img = S - L
    n_ib_full = n_img // BLOCK_N
    n_ib = tl.cdiv(n_img, BLOCK_N)
    img_full = 1
    if HAS_MASK:
        img_full = tl.load(IMG_FULL + b)

    if MODE == 1:  # MODE_QK: every key's score, written out
        y_rows = Y + b * sy0 + h * sy1 + offs_m[:, None] * sy2
        for t in tl.range(0, n_tb + n_ib, num_stages=1):
            if t < n_tb:
                j = t * BLOCK_N + offs_n
                ok = j < L
            else:
                j = L + (t - n_tb) * BLOCK_N + offs_n
                ok = j < S
            s = _scores(q, k_base, sks, j, ok, offs_d, sm_scale, True, IEEE)
            tl.store(y_rows + j[None, :], s, mask=row_ok[:, None] & ok[None, :])
        return

    # ---- pass 1 (FUSED, SOFTMAX): the row states (m, l), blocks in global key order
    m_i = tl.full([BLOCK_M], _NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if MODE != 3:
        for t in tl.range(0, n_tb, num_stages=1):  # text blocks; one without a valid key is skipped
            j = t * BLOCK_N + offs_n
            ok = _key_ok(MASK, smb, b, j, L, HAS_MASK)
            if tl.max(ok.to(tl.int32), 0) > 0:
                m_i, l_i = _pass1(q, k_base, sks, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale, m_i, l_i,
                                  MODE, True, IEEE, BLOCK_M, BLOCK_N)
        if img_full != 0:  # whole image blocks, every key valid
            for t in range(0, n_ib_full):
                if TMA:
                    m_i, l_i = _pass1_tma(q, KD, kv_row + t * BLOCK_N, kv_col, sm_scale, m_i, l_i,
                                          IEEE, BLOCK_M, BLOCK_N)
                else:
                    j = L + t * BLOCK_N + offs_n
                    m_i, l_i = _pass1(q, k_base, sks, x_rows, sxn, j, j < S, row_ok, offs_d, sm_scale, m_i,
                                      l_i, MODE, False, IEEE, BLOCK_M, BLOCK_N)
        else:  # the key mask reaches into the image keys
            for t in range(0, n_ib_full):
                j = L + t * BLOCK_N + offs_n
                ok = _key_ok(MASK, smb, b, j, S, HAS_MASK)
                m_i, l_i = _pass1(q, k_base, sks, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale, m_i, l_i,
                                  MODE, True, IEEE, BLOCK_M, BLOCK_N)
        for t in tl.range(n_ib_full, n_ib, num_stages=1):  # the partial last image block
            j = L + t * BLOCK_N + offs_n
            ok = _key_ok(MASK, smb, b, j, S, HAS_MASK)
            m_i, l_i = _pass1(q, k_base, sks, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale, m_i, l_i,
                              MODE, True, IEEE, BLOCK_M, BLOCK_N)
    m_use = tl.where(m_i == _NEG_INF, 0.0, m_i)
    r_i = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.where(l_i > 0.0, l_i, 1.0))  # l = 0: AV only
    if STORE_ML:  # the backward's row states: the same two numbers pass 2 reads
        ml = ML + pid_bh.to(tl.int64) * 2 * SQ + offs_m
        tl.store(ml, m_use, mask=row_ok)
        tl.store(ml + SQ, r_i, mask=row_ok)

    if MODE == 2:  # MODE_SOFTMAX: P of every key written out (masked keys, skipped blocks +0)
        y_rows = Y + b * sy0 + h * sy1 + offs_m[:, None] * sy2
        for t in tl.range(0, n_tb + n_ib, num_stages=1):
            if t < n_tb:
                j = t * BLOCK_N + offs_n
                inside = j < L
            else:
                j = L + (t - n_tb) * BLOCK_N + offs_n
                inside = j < S
            ok = inside
            if HAS_MASK:
                ok = inside & (tl.load(MASK + b * smb + j, mask=inside, other=0) != 0)
            s = _tile(x_rows, sxn, j, ok, row_ok)
            p = _probs(s, ok, m_use, r_i, True)
            tl.store(y_rows + j[None, :], p, mask=row_ok[:, None] & inside[None, :])
        return

    # ---- pass 2 (FUSED, AV): acc = Σ P̃ · V, the same blocks in the same order
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if INTERNALS:  # FUSED, every image key valid: the scores' and P's digests, never stored
        acc = _internals(q, k_base, sks, v_base, svs, offs_m, offs_n, offs_d, row_ok, b, h, sm_scale, m_use,
                         r_i, acc, MASK, smb, SQ, S, L, rows, IK, iktab, SDR, SDS, PDR, PDS, ISHIFT, T0, NV,
                         HAS_MASK, IEEE, BLOCK_M, BLOCK_N, HEAD_DIM)
    else:
        for t in tl.range(0, n_tb, num_stages=1):
            j = t * BLOCK_N + offs_n
            ok = _key_ok(MASK, smb, b, j, L, HAS_MASK)
            if tl.max(ok.to(tl.int32), 0) > 0:
                acc = _pass2(q, k_base, sks, v_base, svs, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale,
                             m_use, r_i, acc, MODE, True, IEEE)
        if img_full != 0:
            for t in range(0, n_ib_full):
                if TMA:
                    acc = _pass2_tma(q, KD, VD, kv_row + t * BLOCK_N, kv_col, sm_scale, m_use, r_i, acc, IEEE)
                else:
                    j = L + t * BLOCK_N + offs_n
                    acc = _pass2(q, k_base, sks, v_base, svs, x_rows, sxn, j, j < S, row_ok, offs_d, sm_scale,
                                 m_use, r_i, acc, MODE, False, IEEE)
        else:
            for t in range(0, n_ib_full):
                j = L + t * BLOCK_N + offs_n
                ok = _key_ok(MASK, smb, b, j, S, HAS_MASK)
                acc = _pass2(q, k_base, sks, v_base, svs, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale,
                             m_use, r_i, acc, MODE, True, IEEE)
        for t in tl.range(n_ib_full, n_ib, num_stages=1):
            j = L + t * BLOCK_N + offs_n
            ok = _key_ok(MASK, smb, b, j, S, HAS_MASK)
            acc = _pass2(q, k_base, sks, v_base, svs, x_rows, sxn, j, ok, row_ok, offs_d, sm_scale,
                         m_use, r_i, acc, MODE, True, IEEE)
    o_ptrs = Y + b * sy0 + h * sy2 + offs_m[:, None] * sy1 + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None])
    if DIGEST:  # the tile read back (the L2 cache) after a block barrier: head h's columns of its rows,
        tl.debug_barrier()  # in column pieces of at most 32 (fewer live registers)
        PIECE: tl.constexpr = HEAD_DIM if HEAD_DIM < 32 else 32
        offs_p = tl.arange(0, PIECE)
        o_rows = Y + b * sy0 + h * sy2 + offs_m[:, None] * sy1
        y = tl.load(o_rows + offs_p[None, :], mask=row_ok[:, None], other=0.0)
        terms = _tile_digest(y, h * HEAD_DIM, (offs_p < PIECE)[None, :], KEYS, ktab, BLOCK_M, PIECE, WBYTES)
        for c in tl.static_range(1, HEAD_DIM // PIECE):
            y = tl.load(o_rows + c * PIECE + offs_p[None, :], mask=row_ok[:, None], other=0.0)
            terms = _add_terms(terms, _tile_digest(y, h * HEAD_DIM + c * PIECE, (offs_p < PIECE)[None, :], KEYS,
                                                   ktab, BLOCK_M, PIECE, WBYTES))
        _store_rows_digest(DR, DS, b * SQ + offs_m, row_ok, rows, h, shift_t, shift_t2, terms)


# --------------------------------------------------------------------------------------------
# wrappers


def _text_len(text_len: int | None) -> int:
    return 0 if text_len is None else int(text_len)


def _mask_args(key_mask: torch.Tensor | None, text_len: int, like: torch.Tensor):
    """(mask bytes [B,S] uint8, per-sample "every image key valid" int32 [B], has_mask)."""
    if key_mask is None:
        return like, like, False
    km = key_mask.contiguous()
    img_full = km[:, text_len:].all(dim=1).to(torch.int32)  # [B]; no host sync
    return km.view(torch.uint8), img_full, True


CONFIG = (BLOCK_M, NUM_WARPS, NUM_STAGES, True)
"""The one launch configuration of bf16 operands (query rows, warps, pipeline stages, TMA loads
of whole image blocks where K and V allow them: ``_kv_descriptors``). Tests pass others as
``config=`` (a 3-tuple: pointer loads) to show that a row's bytes do not depend on it; the
operators never do. The fastest of ``benchmarks/sweep_strict_attention.py`` on an H200 over
1664×928 and 1328², batch 1 and CFG-batched 2 (docs/benchmarks.md), the same bytes as each."""
CONFIG_FP32 = (64, 4, 1, False)
"""FP32 operands: one pipeline stage (three FP32 K/V stages at Dh = 128 need 288 KiB of shared
memory; an H200 has 227 KiB), pointer loads. Pipelining moves loads, not arithmetic: same bytes."""


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, s: int, dh: int):
    """TMA descriptors of k, v [B,S,H,Dh] as [B·S, H·Dh] with [64, Dh] blocks, or None when their
    layout does not allow one (heads not adjacent, samples not S rows apart, a base or row stride
    not 16-byte aligned): the kernel then reads every block through pointers."""
    def fits(t):
        es = t.element_size()
        return (t.stride(3) == 1 and t.stride(2) == dh and t.stride(0) == s * t.stride(1)
                and (t.stride(1) * es) % 16 == 0 and t.data_ptr() % 16 == 0 and (dh * es) % 16 == 0)

    if not (fits(k) and fits(v)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(t, [t.shape[0] * s, t.shape[2] * dh], [t.stride(1), 1], [BLOCK_N, dh])
                 for t in (k, v))


def _launch(mode: int, q, k, v, x, y, key_mask, text_len: int, b: int, sq: int, s: int, h: int, dh: int,
            ieee: bool, qkv_strides, x_strides, y_strides, config, ml=None, digest: bool = False,
            internals: tuple | None = None) -> None:
    block_m, num_warps, num_stages, *tma = (CONFIG_FP32 if ieee else CONFIG) if config is None else config
    mask, img_full, has_mask = _mask_args(key_mask, text_len, y)
    descs = _kv_descriptors(k, v, s, dh) if mode == MODE_FUSED and tma and tma[0] else None
    n_tq = triton.cdiv(text_len, block_m)
    grid = (n_tq + triton.cdiv(sq - text_len, block_m), b * h)
    dargs = (y, 0, y, y, 0, 0, 0)
    if digest:  # the output's row table (rows B·Sq, one column split per head), offered to its capture
        table = gpu_rows.empty_table(b * sq, h, y.device)
        keys = gpu_rows.byte_key_table(y.device, h * dh, y.element_size())
        produced.offer(y, table)
        dargs = (keys, keys.shape[1], *table, *gpu_rows.shift_constants(h * dh, y.element_size()), b * sq)
    iargs = (y, 0, y, y, y, y, y, y, y) if internals is None else internals
    if internals is not None:
        dargs = (*dargs[:6], b * sq)
    _attn_kernel[grid](
        q, k, v, x, y, mask, img_full, 1.0 / math.sqrt(dh),
        *qkv_strides, *x_strides, *y_strides, mask.stride(0) if has_mask else 0, h, sq, s, text_len, n_tq, ml,
        *(descs or (k, v)), *dargs, *iargs,
        HEAD_DIM=dh, BLOCK_M=block_m, BLOCK_N=BLOCK_N, MODE=mode, HAS_MASK=has_mask, IEEE=ieee,
        STORE_ML=ml is not None, TMA=descs is not None, DIGEST=digest, WBYTES=y.element_size(),
        INTERNALS=internals is not None,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )


def _digestible(o: torch.Tensor, digest: bool) -> bool:
    """Whether an output ``o`` [B,Sq,H,Dh] gets its row table written in the epilogue: asked
    for, a bf16, fp16 or FP32 output, heads of at least 16 bytes (the int8 product's depth)."""
    return digest and o.dtype in (torch.bfloat16, torch.float16, torch.float32) and o.shape[-1] * o.element_size() >= 16


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
              *, text_len: int | None = None, config=None, with_stats: bool = False, digest: bool = False,
              internals: tuple[list[int], list[int]] | None = None):
    """Fused strict attention (module docstring): q [B,Sq,H,Dh], k, v [B,S,H,Dh] (one dtype, FP32
    or BF16; Sq = S, or the text rows and some image rows: an SP rank's), key_mask [B,S] bool or
    None, text_len = L → [B,Sq,H,Dh] in v's dtype. The caller checks shapes, dtypes and that
    every sample has a valid key.

    ``with_stats``: also return the row states the backward reads, [B,H,2,Sq] FP32 — [..., 0, i]
    = m_i (the row max of x in pass 2, −inf taken as 0), [..., 1, i] = fp32(1/l_i); the same
    program writes them after pass 1, so the output's bytes are those without (the arithmetic is
    the same; without ``with_stats`` the forward-only kernel runs, unchanged).

    ``digest`` (a bf16, fp16 or FP32 output, heads of at least 16 bytes): each program also
    writes digest v2's row terms of its output tile, read back after a block barrier, as head h's
    column split of the output's row table (rows B·Sq), offered to its capture
    (``capture.produced``); the output's bytes are the same.

    ``internals`` ``(t0, n)`` (per sample: the first valid prompt key and the valid prompt keys;
    every image key valid): also the row tables of the scores and the probabilities that
    ``scores`` and ``softmax`` would write, digested in pass 2 and never stored — rows ``B·Sq``
    (sample b's query rows from ``b·Sq``), columns those of their canonical record (``B.SK``:
    per head, the sample's valid prompt keys then the image keys), one column split per head.
    Returns ``(o, scores_table, probs_table)`` (no ``with_stats``).

    Raises:
        ValueError: ``internals`` with ``with_stats`` or for heads narrower than
            ``INTERNALS_MIN_HEAD_DIM``."""
    q, k, v = _bshd(q), _bshd(k), _bshd(v)
    b, sq, h, dh = q.shape
    s = k.shape[1]
    L = _text_len(text_len)
    o = torch.empty(b, sq, h, dh, dtype=v.dtype, device=v.device)
    ml = torch.empty(b, h, 2, sq, dtype=torch.float32, device=v.device) if with_stats else None
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    if internals is not None:
        if with_stats:
            raise ValueError("attention: internals are digested in forward-only launches (no with_stats)")
        if dh < INTERNALS_MIN_HEAD_DIM:
            raise ValueError(f"attention: internals need heads of at least {INTERNALS_MIN_HEAD_DIM} values, "
                             f"got {dh}")
        tables, iargs = _internal_tables(internals, b, sq, s, h, L, o.device)
        if config is None and q.dtype != torch.float32:
            config = INTERNALS_CONFIG
        _launch(MODE_FUSED, q, k, v, o, o, key_mask, L, b, sq, s, h, dh, q.dtype == torch.float32, strides,
                (0, 0, 0, 0), (o.stride(0), o.stride(1), o.stride(2)), config, None, _digestible(o, digest), iargs)
        return (o, *tables)
    _launch(MODE_FUSED, q, k, v, o, o, key_mask, L, b, sq, s, h, dh, q.dtype == torch.float32, strides,
            (0, 0, 0, 0), (o.stride(0), o.stride(1), o.stride(2)), config, ml, _digestible(o, digest))
    return (o, ml) if with_stats else o


def _internal_tables(internals, b: int, sq: int, s: int, h: int, text_len: int, device: torch.device):
    """The scores' and probabilities' row tables and the kernel's arguments for them
    (``attention``'s ``internals``)."""
    t0, n = ([int(x) for x in v] for v in internals)
    if len(t0) != b or len(n) != b or any(a < 0 or c < 0 or a + c > text_len for a, c in zip(t0, n)):
        raise ValueError(f"attention: internals need a valid prompt range per sample within {text_len} "
                         f"text rows, got starts {t0} and lengths {n}")
    kv = [c + s - text_len for c in n]
    keys = gpu_rows.byte_key_table(device, h * max(kv) + BLOCK_N, 4)
    shifts = _device_ints(tuple(v for c in kv for v in gpu_rows.shift_constants(h * c, 4)), torch.int64, device)
    tables = (gpu_rows.empty_table(b * sq, h, device), gpu_rows.empty_table(b * sq, h, device))
    return tables, (keys, keys.shape[1], *tables[0], *tables[1], shifts, _device_ints(tuple(t0), torch.int32, device),
                    _device_ints(tuple(n), torch.int32, device))


@functools.lru_cache(maxsize=256)
def _device_ints(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``, made once per (values, device): a copy from pageable host memory
    synchronises the stream and cannot run inside a CUDA graph's capture (kernels only read it)."""
    return torch.tensor(values, dtype=dtype).to(device)


def scores(q: torch.Tensor, k: torch.Tensor, *, text_len: int | None = None, config=None) -> torch.Tensor:
    """The fused kernel's scores s = fp32(q · k) · fp32(1/√Dh) for every key: q [B,Sq,H,Dh],
    k [B,S,H,Dh] → [B,H,Sq,S] FP32 (``text_len`` sets the blocks, which do not change a score)."""
    q, k = _bshd(q), _bshd(k)
    b, sq, h, dh = q.shape
    s = k.shape[1]
    L = _text_len(text_len)
    y = torch.empty(b, h, sq, s, dtype=torch.float32, device=q.device)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), 0, 0, 0)
    _launch(MODE_QK, q, k, k, y, y, None, L, b, sq, s, h, dh, q.dtype == torch.float32, strides,
            (0, 0, 0, 0), (y.stride(0), y.stride(1), y.stride(2)), config)
    return y


def softmax(x: torch.Tensor, key_mask: torch.Tensor | None = None, *, text_len: int | None = None,
            config=None) -> torch.Tensor:
    """The fused kernel's probabilities from its scores: x [B,H,Sq,S] FP32 → P [B,H,Sq,S] FP32,
    masked keys +0 (pass 1 and pass 2 of the module docstring on the read-back scores)."""
    b, h, sq, s = x.shape
    L = _text_len(text_len)
    y = torch.empty(b, h, sq, s, dtype=torch.float32, device=x.device)
    _launch(MODE_SOFTMAX, x, x, x, x, y, key_mask, L, b, sq, s, h, 16, False, (0,) * 9,
            tuple(x.stride()), (y.stride(0), y.stride(1), y.stride(2)), config)
    return y


def attend(p: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, *,
           text_len: int | None = None, config=None, digest: bool = False) -> torch.Tensor:
    """The fused kernel's pass-2 product from its probabilities: p [B,H,Sq,S] FP32 (cast to v's
    dtype per tile), v [B,S,H,Dh] → [B,Sq,H,Dh] in v's dtype; masked keys' P and V taken as +0.
    ``digest``: as ``attention``'s."""
    v = _bshd(v)
    b, s, h, dh = v.shape
    sq = p.shape[2]
    L = _text_len(text_len)
    o = torch.empty(b, sq, h, dh, dtype=v.dtype, device=v.device)
    strides = (0, 0, 0, 0, 0, 0, v.stride(0), v.stride(1), v.stride(2))
    _launch(MODE_AV, v, v, v, p, o, key_mask, L, b, sq, s, h, dh, v.dtype == torch.float32, strides,
            tuple(p.stride()), (o.stride(0), o.stride(1), o.stride(2)), config, digest=_digestible(o, digest))
    return o
