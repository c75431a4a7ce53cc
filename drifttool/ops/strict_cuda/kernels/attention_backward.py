"""Strict joint attention backward on CUDA (contract ``grad.cuda1``): dQ, dK, dV of the fused
kernel (``kernels.attention``, contract cuda1) in fixed orders, without atomics.

    >>> o, ml = attention(q, k, v, key_mask, text_len=L, with_stats=True)   # the forward, + (m, 1/l)
    >>> dq, dk, dv = attention_grads(do, q, k, v, o, ml, key_mask, text_len=L)

Saved from the forward: q, k, v, the output o (v's dtype) and each row's (m, 1/l) exactly as
the forward's pass 2 reads them (``ml`` [B,H,2,Sq] FP32, written by the forward's own program
after pass 1; ``kernels.attention``). Nothing else; P is recomputed. The autograd wiring is
``strict_cuda.attention_backward``; docs/strict-arithmetic.md, "The attention's backward".

Blocks and tiles are the forward's: keys in 64-key blocks in global key order (text blocks from
key 0, the last ending at L; image blocks from key L, the last ending at S); query tiles aligned
the same way (text tiles from row 0, image tiles from row L). Three kernels, each FP32, FMA
contraction off (every operation rounded on its own):

1. ``_delta_kernel``, one program per (batch·head, query tile): D_i = the pairwise tree over Dh
   (adjacent pairs, level by level: ``strict_trees.tree_sum``'s order) of fp32(dO_i,d)·fp32(O_i,d)
   (each product rounded) — IEEE FP32 in a stated order, so torch reproduces its bytes.
2. ``_dq_kernel``, one program per (batch·head, query tile of ``DQ_CONFIG`` rows), walking the
   forward's key blocks in the forward's order (a text block without a valid key skipped), per
   block: s = fp32(q·kᵀ)·fp32(1/√Dh) and P = exp2(s·fp32(log2 e) − m)·(1/l) — the forward's
   jitted functions (``kernels.attention_block``) on the forward's operands, with the forward's
   tensor-core instruction shape (128 rows on 8 warps, as its bf16 configuration), so P is the
   forward's P bit for bit; dP = dO·Vᵀ (one ``tl.dot``, FP32 accumulator); dS = P·(dP − D_i);
   G = dS·fp32(1/√Dh); masked keys G = +0; dQ += G̃·K (G̃ = G cast to q's dtype; one ``tl.dot``
   [rows, 64] × [64, Dh] into the FP32 accumulator, block after block); dQ cast once.
3. ``_dkv_kernel``, one program per (batch·head, 64-key block), walking the query tiles of
   ``DKV_CONFIG`` rows in one fixed order — the text tiles from row 0 (a tile without a valid
   row skipped), then the image tiles from row L — per tile: s, P as above; dV += P̃ᵀ·dO (P̃ = P
   cast to v's dtype, the forward's cast); dP = dO·Vᵀ; dS = P·(dP − D_i); G = dS·fp32(1/√Dh);
   dK += G̃ᵀ·Q; each product one ``tl.dot`` into an FP32 accumulator; dK, dV cast once. A block
   without a valid key is not walked at all.

Operands: bf16 on the tensor cores (FP32 accumulators), FP32 in IEEE FP32 (never TF32). exp2 is
the forward's ``ex2.approx``. No reduction is split across programs, so a row's dQ and a key's
dK, dV depend on the sample's own rows only: not on the batch, its position or the other samples.

Masked positions (``key_mask`` False; the joint self-attention layout, Sq = S, so a position is
both a key and a query row): their K, V rows are never read and their query rows are never read
in the backward (Q, O, dO, m, l): their output gradient is taken as +0, they enter no sum, and
their dQ, dK, dV are exactly +0. So prompt padding (``text_len`` the padded length) changes no
valid row's gradient bytes, whatever the padded rows hold. Prompt-padding rows only reach masked
keys and unused outputs in the model, whose output gradient there is zero anyway.

Fixed configurations (part of the contract: the query-tile rows of the dK/dV walk set the
tensor-core steps of its reduction): ``DKV_CONFIG``/``DQ_CONFIG`` for bf16,
``DKV_CONFIG_FP32``/``DQ_CONFIG_FP32`` for FP32 operands; nothing is chosen from the shape.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_cuda.kernels.attention import BLOCK_N, _bshd, _mask_args, _text_len
from drifttool.ops.strict_cuda.kernels.attention_block import _key_ok, _probs, _qk
from drifttool.ops.strict_cuda.kernels.rows import _pair_tree

DKV_CONFIG = (128, 8, 2)
"""bf16 operands, dK/dV: (query rows per tile walked, warps, pipeline stages)."""
DQ_CONFIG = (128, 8, 3)
"""bf16 operands, dQ and D: (query rows per program, warps, pipeline stages). Three stages: on an
H100 at 1024² (24 heads × 128) the dQ kernel took 0.846 ms against 1.030 with two (batch 1) and
1.868 against 2.259 (batch 2), the same bytes (``benchmarks/sweep_strict_attention_backward.py``;
a row's dQ does not depend on its tile: the GPU tests)."""
DKV_CONFIG_FP32 = (16, 4, 1)
DQ_CONFIG_FP32 = (32, 8, 1)
"""FP32 operands (IEEE FMA dots; one stage, as the forward's FP32 configuration)."""

KERNEL_ID = (f"triton.attention_bwd.block{BLOCK_N}.dkv_rows{DKV_CONFIG[0]}w{DKV_CONFIG[1]}s{DKV_CONFIG[2]}"
             f".dq_rows{DQ_CONFIG[0]}w{DQ_CONFIG[1]}s{DQ_CONFIG[2]}.delta_pairtree"
             f"|fp32.dkv_rows{DKV_CONFIG_FP32[0]}.dq_rows{DQ_CONFIG_FP32[0]}")
"""Kernel identity of the attention backward."""


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a·b, one ``tl.dot`` into the FP32 accumulator."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a·b, one ``tl.dot`` (FP32 result)."""
    if IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _rows(Tn, b, h, offs_m, offs_d, sb, ss, sh, live):
    """A [rows, Dh] tile of a [B,S,H,Dh] tensor; rows outside ``live`` read as +0."""
    ptrs = Tn + b * sb + h * sh + offs_m[:, None] * ss + offs_d[None, :]
    return tl.load(ptrs, mask=live[:, None], other=0.0)


@triton.jit
def _query_tile(pid_m, n_tq, L, SQ, BLOCK_M: tl.constexpr):
    """(rows, end) of query tile ``pid_m``: text tiles from row 0 (ending at L), then image tiles
    from row L (ending at SQ), as the forward's."""
    if pid_m < n_tq:
        row0 = pid_m * BLOCK_M
        row_end = L
    else:
        row0 = L + (pid_m - n_tq) * BLOCK_M
        row_end = SQ
    return row0 + tl.arange(0, BLOCK_M), row_end


@triton.jit
def _row_states(ML, DELTA, pid_bh, SQ, offs_m, live):
    """(m, 1/l, D) of the rows ``offs_m`` (+0 outside ``live``)."""
    ml = ML + pid_bh.to(tl.int64) * 2 * SQ + offs_m
    m_use = tl.load(ml, mask=live, other=0.0)
    r_i = tl.load(ml + SQ, mask=live, other=0.0)
    dlt = tl.load(DELTA + pid_bh.to(tl.int64) * SQ + offs_m, mask=live, other=0.0)
    return m_use, r_i, dlt


@triton.jit
def _image_ok(MASK, smb, b, j, end, img_full, HAS_MASK: tl.constexpr):
    """Image positions j < end that are valid; the mask is read only for a sample whose image
    positions are not all valid (``img_full``)."""
    ok = j < end
    if HAS_MASK:
        ok = ok & (tl.load(MASK + b * smb + j, mask=ok & (img_full == 0), other=1) != 0)
    return ok


@triton.jit
def _grad_tile(q, do, k, v, ok, live, m_use, r_i, dlt, sm_scale, IEEE: tl.constexpr):
    """(P, G) of one [rows, 64] tile: P the forward's probabilities (+0 outside live rows and
    valid keys), G = (P·(dO·Vᵀ − D))·scale (+0 outside)."""
    s = _qk(q, k, sm_scale, IEEE)
    p = _probs(s, ok, m_use, r_i, True)
    p = tl.where(live[:, None], p, 0.0)
    dp = _dot(do, tl.trans(v), IEEE)
    g = (p * (dp - dlt[:, None])) * sm_scale
    g = tl.where(live[:, None] & ok[None, :], g, 0.0)
    return p, g


@triton.jit(do_not_specialize=["SQ", "L", "n_tq"])
def _delta_kernel(O, DO, DELTA, MASK, sob, sos, soh, sdb, sds, sdh, smb, H, SQ, L, n_tq,
                  HEAD_DIM: tl.constexpr, LOG2_DH: tl.constexpr, BLOCK_M: tl.constexpr,
                  HAS_MASK: tl.constexpr):
    """D[b,h,i] = tree over Dh of dO·O (module docstring, 1); +0 for rows not read."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m, row_end = _query_tile(pid_m, n_tq, L, SQ, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    live = _key_ok(MASK, smb, b, offs_m, row_end, HAS_MASK)
    o = _rows(O, b, h, offs_m, offs_d, sob, sos, soh, live).to(tl.float32)
    do = _rows(DO, b, h, offs_m, offs_d, sdb, sds, sdh, live).to(tl.float32)
    d = _pair_tree(do * o, LOG2_DH)
    tl.store(DELTA + pid_bh.to(tl.int64) * SQ + offs_m, d, mask=offs_m < row_end)


@triton.jit(do_not_specialize=["SQ", "S", "L", "n_tq"])
def _dq_kernel(Q, K, V, DO, ML, DELTA, DQ, MASK, IMG_FULL, sm_scale,
               sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, smb, H, SQ, S, L, n_tq,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_MASK: tl.constexpr, IEEE: tl.constexpr):
    """dQ of one query tile (module docstring, 2); DQ [B,SQ,H,Dh] as Q's strides."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m, row_end = _query_tile(pid_m, n_tq, L, SQ, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    live = _key_ok(MASK, smb, b, offs_m, row_end, HAS_MASK)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if tl.max(live.to(tl.int32), 0) > 0:
        q = _rows(Q, b, h, offs_m, offs_d, sqb, sqs, sqh, live)
        do = _rows(DO, b, h, offs_m, offs_d, sdb, sds, sdh, live)
        m_use, r_i, dlt = _row_states(ML, DELTA, pid_bh, SQ, offs_m, live)
        img_full = 1
        if HAS_MASK:
            img_full = tl.load(IMG_FULL + b)
        for t in range(0, tl.cdiv(L, BLOCK_N)):  # text blocks; one without a valid key is skipped
            j = t * BLOCK_N + offs_n
            ok = _key_ok(MASK, smb, b, j, L, HAS_MASK)
            if tl.max(ok.to(tl.int32), 0) > 0:
                k = _rows(K, b, h, j, offs_d, skb, sks, skh, ok)
                v = _rows(V, b, h, j, offs_d, svb, svs, svh, ok)
                _, g = _grad_tile(q, do, k, v, ok, live, m_use, r_i, dlt, sm_scale, IEEE)
                dq = _mma(g.to(k.dtype), k, dq, IEEE)
        for t in range(0, tl.cdiv(S - L, BLOCK_N)):  # image blocks, in order
            j = L + t * BLOCK_N + offs_n
            ok = _image_ok(MASK, smb, b, j, S, img_full, HAS_MASK)
            k = _rows(K, b, h, j, offs_d, skb, sks, skh, ok)
            v = _rows(V, b, h, j, offs_d, svb, svs, svh, ok)
            _, g = _grad_tile(q, do, k, v, ok, live, m_use, r_i, dlt, sm_scale, IEEE)
            dq = _mma(g.to(k.dtype), k, dq, IEEE)
    dq = tl.where(live[:, None], dq, 0.0)
    ptrs = DQ + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :]
    tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m < row_end)[:, None])


@triton.jit
def _dkv_tile(Q, DO, ML, DELTA, k, v, ok, live, b, h, pid_bh, offs_m, offs_d, sm_scale, dk, dv,
              sqb, sqs, sqh, sdb, sds, sdh, SQ, IEEE: tl.constexpr):
    """One query tile's contribution to a key block's dK, dV (module docstring, 3)."""
    q = _rows(Q, b, h, offs_m, offs_d, sqb, sqs, sqh, live)
    do = _rows(DO, b, h, offs_m, offs_d, sdb, sds, sdh, live)
    m_use, r_i, dlt = _row_states(ML, DELTA, pid_bh, SQ, offs_m, live)
    p, g = _grad_tile(q, do, k, v, ok, live, m_use, r_i, dlt, sm_scale, IEEE)
    dv = _mma(tl.trans(p.to(v.dtype)), do, dv, IEEE)
    dk = _mma(tl.trans(g.to(q.dtype)), q, dk, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["SQ", "S", "L", "n_tb"])
def _dkv_kernel(Q, K, V, DO, ML, DELTA, DK, DV, MASK, IMG_FULL, sm_scale,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, smb, H, SQ, S, L, n_tb,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_MASK: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of one 64-key block (module docstring, 3); DK, DV [B,S,H,Dh] as K's, V's strides."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if pid_n < n_tb:
        j = pid_n * BLOCK_N + offs_n
        end = L
    else:
        j = L + (pid_n - n_tb) * BLOCK_N + offs_n
        end = S
    ok = _key_ok(MASK, smb, b, j, end, HAS_MASK)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if tl.max(ok.to(tl.int32), 0) > 0:
        k = _rows(K, b, h, j, offs_d, skb, sks, skh, ok)
        v = _rows(V, b, h, j, offs_d, svb, svs, svh, ok)
        img_full = 1
        if HAS_MASK:
            img_full = tl.load(IMG_FULL + b)
        for t in range(0, tl.cdiv(L, BLOCK_M)):  # text tiles from row 0; one without a valid row skipped
            offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
            live = _key_ok(MASK, smb, b, offs_m, L, HAS_MASK)
            if tl.max(live.to(tl.int32), 0) > 0:
                dk, dv = _dkv_tile(Q, DO, ML, DELTA, k, v, ok, live, b, h, pid_bh, offs_m, offs_d, sm_scale,
                                   dk, dv, sqb, sqs, sqh, sdb, sds, sdh, SQ, IEEE)
        for t in range(0, tl.cdiv(SQ - L, BLOCK_M)):  # image tiles from row L, in order
            offs_m = L + t * BLOCK_M + tl.arange(0, BLOCK_M)
            live = _image_ok(MASK, smb, b, offs_m, SQ, img_full, HAS_MASK)
            dk, dv = _dkv_tile(Q, DO, ML, DELTA, k, v, ok, live, b, h, pid_bh, offs_m, offs_d, sm_scale,
                               dk, dv, sqb, sqs, sqh, sdb, sds, sdh, SQ, IEEE)
    dk = tl.where(ok[:, None], dk, 0.0)
    dv = tl.where(ok[:, None], dv, 0.0)
    inside = (j < end)[:, None]
    tl.store(DK + b * skb + h * skh + j[:, None] * sks + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=inside)
    tl.store(DV + b * svb + h * svh + j[:, None] * svs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=inside)


# --------------------------------------------------------------------------------------------
# wrapper


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _check_layout(key_mask: torch.Tensor | None, sq: int, s: int) -> None:
    if key_mask is not None and sq != s:
        raise UnsupportedConfigError(
            f"strict CUDA joint attention backward: a key mask needs the joint self-attention layout "
            f"(as many query rows as keys), got {sq} query rows and {s} keys")


def _q_grid(L: int, sq: int, bh: int, rows: int) -> tuple[int, tuple[int, int]]:
    """(text query tiles, grid) of the query-tile kernels: text tiles from row 0, image from L."""
    n_tq = triton.cdiv(L, rows)
    return n_tq, (n_tq + triton.cdiv(sq - L, rows), bh)


def deltas(do: torch.Tensor, o: torch.Tensor, key_mask: torch.Tensor | None = None, *,
           text_len: int | None = None, config=None) -> torch.Tensor:
    """D = the pairwise tree over Dh of fp32(dO)·fp32(O) per row (module docstring, 1): do, o
    [B,Sq,H,Dh] (bf16 or FP32) → [B,H,Sq] FP32, +0 at masked rows.

    Raises:
        UnsupportedConfigError: a key mask [B,S] with S ≠ Sq."""
    b, sq, h, dh = o.shape
    _check_layout(key_mask, sq, sq if key_mask is None else key_mask.shape[1])
    o, do = _bshd(o), _bshd(do)
    L = _text_len(text_len)
    mask, _, has_mask = _mask_args(key_mask, L, o)
    rows, warps, _ = (DQ_CONFIG_FP32 if o.dtype == torch.float32 else DQ_CONFIG) if config is None else config
    n_tq, grid = _q_grid(L, sq, b * h, rows)
    d = torch.empty(b, h, sq, dtype=torch.float32, device=o.device)
    _delta_kernel[grid](o, do, d, mask, *_strides(o), *_strides(do), mask.stride(0) if has_mask else 0,
                        h, sq, L, n_tq, HEAD_DIM=dh, LOG2_DH=int(math.log2(dh)), BLOCK_M=rows,
                        HAS_MASK=has_mask, num_warps=warps, enable_fp_fusion=False)
    return d


def attention_grads(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    ml: torch.Tensor, key_mask: torch.Tensor | None = None, *, text_len: int | None = None,
                    needs=(True, True, True), configs=None):
    """(dQ, dK, dV) of the fused strict attention (module docstring).

    Args:
        do: [B,Sq,H,Dh] output gradient (cast to v's dtype first).
        q: [B,Sq,H,Dh]; k, v: [B,S,H,Dh] — the forward's operands (one dtype, FP32 or BF16).
        o: [B,Sq,H,Dh] the forward's output; ml: [B,H,2,Sq] FP32 its row states
            (``kernels.attention.attention(..., with_stats=True)``).
        key_mask: [B,S] bool or None; text_len: L (None = 0).
        needs: which of (dQ, dK, dV) to compute (dK and dV come from one kernel).
        configs: tests and sweeps only — ((dkv rows, warps, stages[, keys]), (dq rows, warps,
            stages)); ``keys``: the keys one dK/dV program holds (a multiple of the 64-key block;
            default one block).
    Returns:
        dQ in q's dtype, dK in k's, dV in v's ([B,·,H,Dh], contiguous); None where not needed.
    Raises:
        UnsupportedConfigError: a key mask with Sq ≠ S (masked query rows need the joint
            self-attention layout), operands not FP32 or BF16 alike, or ``ml`` of another shape.
    """
    b, sq, h, dh = q.shape
    s = k.shape[1]
    _check_layout(key_mask, sq, s)
    if q.dtype not in (torch.float32, torch.bfloat16) or len({q.dtype, k.dtype, v.dtype}) > 1:
        raise UnsupportedConfigError(f"strict CUDA joint attention backward: q, k, v {q.dtype}, {k.dtype}, "
                                     f"{v.dtype}; one of float32, bfloat16 needed")
    if tuple(ml.shape) != (b, h, 2, sq) or ml.dtype != torch.float32:
        raise UnsupportedConfigError(f"strict CUDA joint attention backward: row states {tuple(ml.shape)} "
                                     f"{ml.dtype}; [B, H, 2, Sq] float32 needed")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the gradients are written with their strides
    o, do = _bshd(o), _bshd(do.to(v.dtype))
    ml = ml.contiguous()
    ieee = q.dtype == torch.float32
    dkv_cfg, dq_cfg = ((DKV_CONFIG_FP32, DQ_CONFIG_FP32) if ieee else (DKV_CONFIG, DQ_CONFIG)) \
        if configs is None else configs
    L = _text_len(text_len)
    mask, img_full, has_mask = _mask_args(key_mask, L, q)
    smb = mask.stride(0) if has_mask else 0
    scale = 1.0 / math.sqrt(dh)
    meta = dict(HEAD_DIM=dh, HAS_MASK=has_mask, enable_fp_fusion=False)
    qs, ks, vs, ds_ = _strides(q), _strides(k), _strides(v), _strides(do)

    delta = deltas(do, o, key_mask, text_len=L, config=dq_cfg)
    rows, warps, stages = dq_cfg
    n_tq, q_grid = _q_grid(L, sq, b * h, rows)
    dq = dk = dv = None
    if needs[0]:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _dq_kernel[q_grid](q, k, v, do, ml, delta, dq, mask, img_full, scale, *qs, *ks, *vs, *ds_, smb,
                           h, sq, s, L, n_tq, BLOCK_M=rows, BLOCK_N=BLOCK_N, IEEE=ieee,
                           num_warps=warps, num_stages=stages, **meta)
    if needs[1] or needs[2]:
        rows, warps, stages, keys = (*dkv_cfg, BLOCK_N)[:4]
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        n_tb = triton.cdiv(L, keys)
        _dkv_kernel[(n_tb + triton.cdiv(s - L, keys), b * h)](
            q, k, v, do, ml, delta, dk, dv, mask, img_full, scale, *qs, *ks, *vs, *ds_, smb,
            h, sq, s, L, n_tb, BLOCK_M=rows, BLOCK_N=keys, IEEE=ieee,
            num_warps=warps, num_stages=stages, **meta)
    return dq, (dk if needs[1] else None), (dv if needs[2] else None)
