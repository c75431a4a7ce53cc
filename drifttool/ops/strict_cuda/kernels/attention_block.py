"""The arithmetic of one 64-key block of the strict CUDA joint attention (contract cuda1), shared
by the forward kernel (``kernels.attention``: scores, pass 1's row-state update, pass 2's
probabilities) and the backward kernels (``kernels.attention_backward``), so that the backward
recomputes the forward's scores and probabilities with the same jitted code, bit for bit.
The order and casts are the forward module's docstring's.
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _key_ok(MASK, smb, b, j, end, HAS_MASK: tl.constexpr):
    """Keys j of a block that enter: j < end (the block's part) and key_mask[b, j]."""
    ok = j < end
    if HAS_MASK:
        mk = tl.load(MASK + b * smb + j, mask=ok, other=0)
        ok = ok & (mk != 0)
    return ok


@triton.jit
def _canonical(s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """s + 0·0 through one bf16 tensor-core dot: the same values (zero products add +0), in the
    accumulator layout of the bf16 QKᵀ dot, so the row sums that follow reduce in one order."""
    za = tl.zeros([BLOCK_M, 16], tl.bfloat16)
    zb = tl.zeros([16, BLOCK_N], tl.bfloat16)
    return tl.dot(za, zb, s)


@triton.jit
def _qk(q, k, sm_scale, IEEE: tl.constexpr):
    """s = fp32(q · kᵀ) · scale: q [rows, Dh] by one block's loaded K [64, Dh] → [rows, 64] (one
    ``tl.dot``: bf16 on the tensor cores with an FP32 accumulator, FP32 in IEEE FP32)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * sm_scale


@triton.jit
def _scores(q, k_base, skn, j, ok, offs_d, sm_scale, BOUNDED: tl.constexpr, IEEE: tl.constexpr):
    """s = fp32(q · kᵀ) · scale for one key block: q [BLOCK_M, Dh], keys j → [BLOCK_M, 64].
    Keys outside ``ok`` are not read (their K rows taken as 0) when BOUNDED."""
    ptrs = k_base + j[:, None] * skn + offs_d[None, :]
    if BOUNDED:
        k = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        k = tl.load(ptrs)
    return _qk(q, k, sm_scale, IEEE)


@triton.jit
def _tile(x_rows, sxn, j, ok, row_ok):
    """A [BLOCK_M, 64] FP32 tile of a [B,H,S,S] tensor (scores or probabilities); lanes outside
    ``ok`` (and rows outside ``row_ok``) read as +0."""
    return tl.load(x_rows + j[None, :] * sxn, mask=row_ok[:, None] & ok[None, :], other=0.0)


@triton.jit
def _state(s, ok, m_i, l_i, MASKED: tl.constexpr):
    """Pass 1 on one block: (m, l) ← (m', l · exp2(m − m') + Σ exp2(x − m')), x = s · log2 e."""
    x = s * _LOG2E
    if MASKED:
        x = tl.where(ok[None, :], x, _NEG_INF)
    m_new = tl.maximum(m_i, tl.max(x, 1))
    m_use = tl.where(m_new == _NEG_INF, 0.0, m_new)
    p = tl.math.exp2(x - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i


@triton.jit
def _probs(s, ok, m_use, r_i, MASKED: tl.constexpr):
    """Pass 2 on one block: P = exp2(s · log2 e − m) · fp32(1/l); masked keys +0."""
    x = s * _LOG2E
    if MASKED:
        x = tl.where(ok[None, :], x, _NEG_INF)
    return tl.math.exp2(x - m_use[:, None]) * r_i[:, None]
