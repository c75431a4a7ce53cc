"""Digest v2 row sums of a float tensor on a CUDA device in one Triton kernel: read once, exact.

    >>> rows, stats = combine_splits(*row_table(x2d))   # x2d: CUDA [R, C] bf16/fp16/fp32
    >>> rows.shape, rows.dtype, stats.shape     # T and T' per row (in [0, p)); Σx², max, min, #bad
    ((R, 2), torch.int64, (R, 4))

What it computes is digest v2's level 1 (``drifttool.capture.digest``, docs/digest.md), the row
digests ``T[r] = Σ_c B[c] w[r, c]`` and ``T'[r] = Σ_c B'[c] w[r, c]`` mod ``p = 2**61 − 1``,
plus the per-row summary (fp64 Σx², max, min, count of NaN/±inf), in one pass over the tensor.

Exactness. A word ``w`` (one element of 2 or 4 bytes) is ``Σ_j 256**j u_j`` over its bytes, so
``T[r] = Σ_k E[k] u[r, k]`` over byte columns ``k = c·W + j`` with ``E[k] = B[c]·2**(8j) mod p``.
The kernel feeds the signed bytes ``s = u − 128`` and the 7-bit limbs of ``E`` (9 limbs hold 63
bits) to an int8 × int8 → int32 tensor-core product: each term is below ``128 · 127 < 2**14`` in
magnitude, so up to ``2**17`` terms add exactly in int32, and the kernel folds its int32
accumulator into int64 mod p before that bound (``_FOLD_BYTES``). The ``u − 128`` shift is
undone by the constant ``128 · Σ_k E[k]``, added once per row (by column split 0). Integer sums
do not depend on the order of addition, so the result equals the CPU's digest bit for bit
(tested in ``tests/gpu``). ``row_table`` returns the partial sums of ``TILE["split"]`` column
splits; ``combine_splits`` (or ``digest.materialize``, for a whole step at once) adds them.

The summary is a summary: Σx² is accumulated in fp64 per row in the kernel's order (not the
CPU's), max/min/count are exact.

Cost: one read of the tensor (the int8 products run on the tensor cores and the keys stay in L2);
measured on an H200 at about 600 GB/s, bound by the per-element work rather than memory
(docs/benchmarks.md, "Full-size forward on one GPU").
"""

from __future__ import annotations

import numpy as np
import torch

from drifttool import digestcore as core

try:  # Triton ships with CUDA builds of torch; the CPU never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

_LIMBS = 9  # 7-bit limbs of a 61-bit key
_NCOL = 32  # key columns of the product: 9 limbs of B, 9 of B', zero padding (tl.dot needs 16+)
_FOLD_BYTES = 1 << 16  # byte columns added in int32 before a fold (2**16 · 2**14 < 2**31)
_WORD_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def available(t: torch.Tensor) -> bool:
    """Whether ``row_table`` can digest ``t``: a CUDA float tensor (bf16, fp16, fp32), Triton
    importable."""
    return triton is not None and t.is_cuda and t.dtype in _WORD_BYTES


# -- key tables -----------------------------------------------------------------------------------
def _byte_keys(family: str, n: int, wbytes: int) -> np.ndarray:
    """``int64 [wbytes, n]``: ``E_j[c] = key[c] · 2**(8j) mod p`` (a 61-bit rotation)."""
    k = core.keys(family, 0, n)
    out = np.empty((wbytes, n), np.int64)
    for j in range(wbytes):
        s = 8 * j
        out[j] = core.rot(k, s, (1 << (61 - s)) - 1) if s else k
    return out


def _limb_table(n: int, wbytes: int) -> np.ndarray:
    """``int8 [wbytes, n, 32]``: the 7-bit limbs of ``E_j[c]`` of ``B`` (columns 0–8) and ``B'``
    (9–17); columns 18–31 are zero."""
    t = np.zeros((wbytes, n, _NCOL), np.int8)
    for f, family in enumerate(("col", "col2")):
        e = _byte_keys(family, n, wbytes)
        for l in range(_LIMBS):
            t[:, :, f * _LIMBS + l] = (e >> (7 * l)) & 127
    return t


_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}
_SHIFT: dict[tuple[int, int], tuple[int, int]] = {}


def _byte_table(device: torch.device, n: int, wbytes: int) -> torch.Tensor:
    """``int8 [N · wbytes, 32]`` on ``device`` (``N >= n``, cached, grown by doubling): the limbs
    of ``E_j[c]`` at byte column ``k = c · wbytes + j``, the bytes' order in memory (little
    endian)."""
    have = _TABLES.get((device, wbytes))
    if have is None or have.shape[0] < n * wbytes:
        size = max(4096, 1 << max(0, n - 1).bit_length())
        table = _limb_table(size, wbytes).transpose(1, 0, 2).reshape(-1, _NCOL)
        have = torch.from_numpy(np.ascontiguousarray(table)).to(device)
        _TABLES[(device, wbytes)] = have
    return have


def _shift_constants(n: int, wbytes: int) -> tuple[int, int]:
    """``128 · Σ_{c<n, j} E_j[c] mod p`` for ``B`` and ``B'``: undoes the ``u − 128`` shift."""
    key = (n, wbytes)
    if key not in _SHIFT:
        _SHIFT[key] = tuple(128 * int(_byte_keys(f, n, wbytes).astype(object).sum()) % core.P
                            for f in ("col", "col2"))
    return _SHIFT[key]


# -- the kernel -------------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _modp(x):
        """``x mod p`` for ``0 <= x < 2**63``."""
        P = 2305843009213693951
        y = (x & P) + (x >> 61)
        return tl.where(y >= P, y - P, y)

    @triton.jit
    def _family(lo, hi, sel):
        """``Σ_l x_l mod p`` over the selected limb columns (``x = lo + 2**30 hi``)."""
        l_sum = _modp(tl.sum(tl.where(sel, lo, 0), axis=1))  # < 9 · 2**30 before the fold
        h_sum = _modp(tl.sum(tl.where(sel, hi, 0), axis=1))  # < 9 · 2**31 before the fold
        h_rot = ((h_sum & ((1 << 31) - 1)) << 30) | (h_sum >> 31)  # · 2**30 mod p
        return _modp(l_sum + h_rot)

    @triton.jit
    def _fold_into(acc_t, acc_t2, acc32, LIMBS: tl.constexpr, NCOL: tl.constexpr):
        """Add the int32 limb sums (any sign, |x| < 2**31) into T, T' (int64 in [0, p))."""
        P = 2305843009213693951
        col = tl.arange(0, NCOL)
        sh = (7 * (col % LIMBS)).to(tl.int64)
        x = _modp(acc32.to(tl.int64) + P)  # x + p is in (p − 2**31, p + 2**31): non-negative
        mask = (tl.full([NCOL], 1, tl.int64) << (61 - sh)) - 1
        x = ((x & mask[None, :]) << sh[None, :]) | (x >> (61 - sh[None, :]))  # · 2**(7l) mod p
        lo = x & ((1 << 30) - 1)
        hi = x >> 30
        fam = col // LIMBS
        t = _modp(acc_t + _family(lo, hi, (fam == 0)[None, :]))
        t2 = _modp(acc_t2 + _family(lo, hi, (fam == 1)[None, :]))
        return t, t2

    @triton.jit
    def _rows_kernel(X, XB, KEYS, ROWS, STATS, R, C, stride_r, stride_rb, shift_t, shift_t2,
                     TILES_PER_SPLIT, WBYTES: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                     FOLD_EVERY: tl.constexpr, LIMBS: tl.constexpr, NCOL: tl.constexpr):
        """Rows ``[pid·BM, (pid+1)·BM)`` of column split ``program_id(1)`` (column tiles
        ``[split · TILES_PER_SPLIT, (split + 1) · TILES_PER_SPLIT)``): the bytes through a
        ``uint8`` view ``XB`` (one int8 product per tile over ``BC · WBYTES`` byte columns, keys
        in memory order), the values through the typed view ``X`` (the summary); folds every
        ``FOLD_EVERY`` tiles. Split ``k`` writes its partial sums at ``ROWS[k]``/``STATS[k]``;
        the ``u − 128`` correction is added by split 0 only."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = pid * BM + tl.arange(0, BM)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        kcol = tl.arange(0, NCOL)
        acc_t = tl.zeros([BM], tl.int64)
        acc_t2 = tl.zeros([BM], tl.int64)
        acc32 = tl.zeros([BM, NCOL], tl.int32)
        # elementwise accumulators of the summary, reduced over the columns once at the end
        sq = tl.zeros([BM, BC], tl.float64)
        mx = tl.full([BM, BC], float("-inf"), tl.float32)
        mn = tl.full([BM, BC], float("inf"), tl.float32)
        bad = tl.zeros([BM, BC], tl.int32)
        nb = C * WBYTES
        first = split * TILES_PER_SPLIT
        for it in range(first, tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(C, BC))):
            bcols = it * (BC * WBYTES) + tl.arange(0, BC * WBYTES)
            bmask = bcols < nb
            u = tl.load(XB + r64[:, None] * stride_rb + bcols[None, :],
                        mask=rmask[:, None] & bmask[None, :], other=128)
            s = (u ^ 0x80).to(tl.int8)  # u − 128 (the low byte of u xor 0x80, as int8)
            k = tl.load(KEYS + bcols[:, None] * NCOL + kcol[None, :], mask=bmask[:, None], other=0)
            acc32 = tl.dot(s, k, acc32, out_dtype=tl.int32)
            cols = it * BC + tl.arange(0, BC)
            m = rmask[:, None] & (cols < C)[None, :]
            x = tl.load(X + r64[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
            xd = x.to(tl.float64)
            sq += xd * xd  # masked elements load as 0.0: no term, and finite
            mx = tl.maximum(mx, tl.where(m, x, float("-inf")))
            mn = tl.minimum(mn, tl.where(m, x, float("inf")))
            bad += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
            if (it + 1) % FOLD_EVERY == 0:
                acc_t, acc_t2 = _fold_into(acc_t, acc_t2, acc32, LIMBS, NCOL)
                acc32 = tl.zeros([BM, NCOL], tl.int32)
        acc_t, acc_t2 = _fold_into(acc_t, acc_t2, acc32, LIMBS, NCOL)
        if split == 0:
            acc_t = _modp(acc_t + shift_t)
            acc_t2 = _modp(acc_t2 + shift_t2)
        out = split.to(tl.int64) * R + r64
        tl.store(ROWS + out * 2, acc_t, mask=rmask)
        tl.store(ROWS + out * 2 + 1, acc_t2, mask=rmask)
        tl.store(STATS + out * 4, tl.sum(sq, axis=1), mask=rmask)
        tl.store(STATS + out * 4 + 1, tl.max(mx, axis=1).to(tl.float64), mask=rmask)
        tl.store(STATS + out * 4 + 2, tl.min(mn, axis=1).to(tl.float64), mask=rmask)
        tl.store(STATS + out * 4 + 3, tl.sum(bad, axis=1).to(tl.float64), mask=rmask)


TILE = {"bm": 16, "bc": 128, "warps": 4, "stages": 3, "split": 4}
"""Rows and element columns per program step, warps, pipeline stages, and column splits (each
split a program of its own, partial sums combined at ``materialize``; more programs in flight for
outputs of few rows). Measured on an H200 (benchmarks/bench_gpu_forward.py ``--sweep``,
docs/benchmarks.md): 4 splits read a 4096 × 3072 bf16 output at 327 GB/s against 245 for one,
and keep the step's partial tables at 4 × 48 bytes per captured row."""


def row_table(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row digests and row summaries of a 2-D CUDA float tensor (see the module docstring).

    Args:
        x: ``[R, C]`` bf16, fp16 or fp32 on a CUDA device; the last axis contiguous (rows may be
            strided).

    Returns:
        ``(rows, stats)``: ``int64 [S, R, 2]`` (``T``, ``T'`` in ``[0, p)``) and ``float64
        [S, R, 4]`` (Σx², max, min, count of NaN/±inf) of the ``S = TILE["split"]`` column
        splits, on ``x``'s device, nothing read back: a row's values are the sums (mod p for
        ``T``, ``T'``), the max and the min over the splits (``combine_splits``).

    Raises:
        ValueError: not a 2-D CUDA bf16/fp16/fp32 tensor with a contiguous last axis.
    """
    if not available(x) or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"row_table needs a 2-D CUDA bf16/fp16/fp32 tensor with contiguous rows, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    r, c = x.shape
    wbytes = _WORD_BYTES[x.dtype]
    splits = max(1, int(TILE["split"]))
    buf = torch.empty(6 * r * splits, dtype=torch.int64, device=x.device)  # one allocation
    rows = buf[:2 * r * splits].view(splits, r, 2)
    stats = buf[2 * r * splits:].view(torch.float64).view(splits, r, 4)
    if r == 0:
        return rows, stats
    s1, s2 = _shift_constants(c, wbytes)
    bm, bc = TILE["bm"], TILE["bc"]
    stride = x.stride(0) if r > 1 else c
    tiles = triton.cdiv(c, bc)
    args = (x, x.view(torch.uint8), _byte_table(x.device, c, wbytes), rows, stats, r, c, stride,
            stride * wbytes, s1, s2, triton.cdiv(tiles, splits))
    opts = dict(WBYTES=wbytes, BM=bm, BC=bc, FOLD_EVERY=max(1, _FOLD_BYTES // (bc * wbytes)),
                LIMBS=_LIMBS, NCOL=_NCOL, num_warps=TILE["warps"], num_stages=TILE["stages"])
    grid = (triton.cdiv(r, bm), splits)
    if x.device.index == torch.cuda.current_device():
        _rows_kernel[grid](*args, **opts)
    else:
        with torch.cuda.device(x.device):
            _rows_kernel[grid](*args, **opts)
    return rows, stats


def combine_splits(rows: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, R, 2]``, ``[S, R, 4]`` split partials → ``[R, 2]``, ``[R, 4]``: ``T``, ``T'`` summed
    mod p, Σx² and the counts summed (in split order: deterministic), max and min over splits.
    Works on any device (the CPU tests build tables of their own)."""
    if rows.shape[0] == 1:
        return rows[0], stats[0]
    t = core.modsum(rows, 0)
    st = torch.stack([stats[..., 0].sum(0), stats[..., 1].amax(0), stats[..., 2].amin(0),
                      stats[..., 3].sum(0)], -1)
    return t, st
