"""Triton kernels of the strict CUDA norms (contract ``cuda1``): the learned-gain RMSNorm
(``rms_norm``) and the AdaLN LayerNorm with modulation (``ln_modulation``), under
``kernels.rows``' conventions: each row's sums are the pairwise tree of ``strict_trees.tree_sum``,
in registers for rows up to ``SHORT_ROW`` (padded); a longer row ("long rows") is one program's,
walked in aligned tiles whose first three tree levels are sums of stride-8 loads, in one launch —
the same additions either way; rstd in FP64, rounded once. Raises ``ValueError`` for a long-row
configuration (``LongRows``) with tiles under 16 elements or no rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from drifttool.capture import gpu_rows, produced
from drifttool.capture.gpu_rows_kernels import _add_terms, _no_terms, _store_tile_digest, _tile_digest
from drifttool.ops.strict_cuda.kernels.rows import _launch, _pair_tree, pow2


def _rows_per_program(width: int) -> int:
    """The fixed rows per program of a norm kernel: about 1024 padded elements per program (the
    pairwise tree's reshapes make the kernel's code grow with the elements a program holds)."""
    return max(1, 1024 // pow2(width))


@functools.lru_cache(maxsize=64)
def _f64_scalar(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a 1-element FP64 tensor on ``device`` (a Python float kernel argument would be
    FP32), made once per (value, device): a host-to-device copy from pageable memory synchronises
    the stream, and the norms ran 4 per block. Kernels only read it."""
    return torch.tensor([value], dtype=torch.float64, device=device)


@triton.jit
def _rstd(var, eps_ptr):
    """1 / sqrt(var + eps): FP64 (eps read as FP64; FP64 sqrt and division lower to the correctly
    rounded ``sqrt.rn.f64``/``div.rn.f64``), rounded once to FP32."""
    eps = tl.load(eps_ptr)
    v = var.to(tl.float64) + eps
    one = tl.full(v.shape, 1.0, tl.float64)
    return (one / tl.sqrt(v)).to(tl.float32)


@triton.jit
def _rms_kernel(x_ptr, gain_ptr, eps_ptr, o_ptr, rows, D: tl.constexpr, LOG2: tl.constexpr,
                ROWS: tl.constexpr):
    """Per row: var = tree_sum(x·x) ÷ D; rstd (``_rstd``); y = (x·rstd)·gain."""
    P: tl.constexpr = 2**LOG2
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, P)
    m = (r[:, None] < rows) & (k[None, :] < D)
    x = tl.load(x_ptr + r[:, None] * D + k[None, :], mask=m, other=0.0).to(tl.float32)
    ssq = _pair_tree(x * x, LOG2)
    var = tl.div_rn(ssq, tl.full(ssq.shape, D, tl.float32))
    rstd = _rstd(var, eps_ptr)
    gain = tl.load(gain_ptr + k, mask=k < D, other=0.0).to(tl.float32)
    y = (x * rstd[:, None]) * gain[None, :]
    tl.store(o_ptr + r[:, None] * D + k[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_heads_kernel(x_ptr, gain_ptr, eps_ptr, o_ptr, R, H, KT, ktab, DR, DS, shift_t, shift_t2,
                      D: tl.constexpr, LOG2: tl.constexpr, BM: tl.constexpr, WBYTES: tl.constexpr):
    """``_rms_kernel``'s arithmetic on the heads of rows ``[pid·BM, (pid+1)·BM)`` of ``[R, H·D]``
    (each head's ``D`` elements a norm row), and digest v2's row terms of the values stored, summed
    over the heads, written as the one column split of the row table ``DR``/``DS``
    (``capture.gpu_rows_kernels._tile_digest``)."""
    P: tl.constexpr = 2**LOG2
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.arange(0, P)
    gain = tl.load(gain_ptr + k, mask=k < D, other=0.0).to(tl.float32)
    terms = _no_terms(BM)
    for h in range(0, H):
        m = (rm[:, None] < R) & (k[None, :] < D)
        at = (rm.to(tl.int64)[:, None] * H + h) * D + k[None, :]
        x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        ssq = _pair_tree(x * x, LOG2)
        var = tl.div_rn(ssq, tl.full(ssq.shape, D, tl.float32))
        rstd = _rstd(var, eps_ptr)
        y = ((x * rstd[:, None]) * gain[None, :]).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + at, y, mask=m)
        terms = _add_terms(terms, _tile_digest(y, h * D, (k < D)[None, :], KT, ktab, BM, P, WBYTES))
    _store_tile_digest(DR, DS, rm, R, 0, shift_t, shift_t2, terms)


HEADS_ROWS = 16
"""Rows (tokens) per program of the digesting head-wise RMSNorm (``rms_norm_heads``)."""


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float, out_dtype: torch.dtype, *,
             rows_per_program: int | None = None, long_rows: LongRows | None = None,
             in_register: bool = False, digest: bool = False) -> torch.Tensor:
    """Learned-gain RMSNorm over the last axis (``strict.embed.rms_parts`` then ·gain):
    x [..., D] → [..., D] ``out_dtype`` (FP32 for the seam before a GEMM). Rows longer than
    ``SHORT_ROW`` (padded) take the tile kernel under ``long_rows`` (default ``LONG_ROWS``);
    ``rows_per_program`` overrides the rows per program of either kernel; ``in_register`` holds a
    long row whole in one program's registers (for the interpreter tests: Triton gives every
    thread the whole tree there, so on a GPU its code and compile time grow with the row).
    ``digest`` (x [B, S, H, D], short rows, a bf16, fp16 or FP32 output): also write the output's
    row table (digest v2, rows B·S of H·D elements) from the values stored and offer it to its
    capture (``capture.produced``); the same output bytes."""
    x = x.contiguous()
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    eps_t = _f64_scalar(eps, x.device) if rows and d else None
    if (digest and rows and d and x.dim() == 4 and pow2(d) <= SHORT_ROW
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32) and pow2(d) * o.element_size() >= 16):
        tokens, heads, wbytes = x.shape[0] * x.shape[1], x.shape[2], o.element_size()
        table = gpu_rows.empty_table(tokens, 1, x.device)
        keys = gpu_rows.byte_key_table(x.device, heads * d + pow2(d), wbytes)
        produced.offer(o, table)
        _launch(_rms_heads_kernel, (triton.cdiv(tokens, HEADS_ROWS),), x, gain.contiguous(), eps_t, o, tokens,
                heads, keys, keys.shape[1], *table, *gpu_rows.shift_constants(heads * d, wbytes), D=d,
                LOG2=pow2(d).bit_length() - 1, BM=HEADS_ROWS, WBYTES=wbytes)
    elif rows and d and pow2(d) > SHORT_ROW and not in_register:
        rms_norm_long(x, gain.contiguous(), eps_t, o, rows, d, _long_config(long_rows, rows_per_program))
    elif rows and d:
        per = rows_per_program or _rows_per_program(d)
        _launch(_rms_kernel, (triton.cdiv(rows, per),), x, gain.contiguous(), eps_t, o,
                rows, D=d, LOG2=pow2(d).bit_length() - 1, ROWS=per)
    return o


@triton.jit
def _ln_mod_kernel(x_ptr, shift_ptr, scale_ptr, mod_stride, eps_ptr, o_ptr, rows, S,
                   D: tl.constexpr, LOG2: tl.constexpr, ROWS: tl.constexpr):
    """Per row (sample b = row ÷ S): mean = tree_sum(x) ÷ D; xc = x − mean; var = tree_sum(xc·xc)
    ÷ D; rstd (``_rstd``); y = (xc·rstd)·(1 + scale[b]) + shift[b]."""
    P: tl.constexpr = 2**LOG2
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, P)
    live = r[:, None] < rows
    m = live & (k[None, :] < D)
    x = tl.load(x_ptr + r[:, None] * D + k[None, :], mask=m, other=0.0).to(tl.float32)
    mean = tl.div_rn(_pair_tree(x, LOG2), tl.full((ROWS,), D, tl.float32))
    xc = tl.where(m, x - mean[:, None], 0.0)
    var = tl.div_rn(_pair_tree(xc * xc, LOG2), tl.full((ROWS,), D, tl.float32))
    rstd = _rstd(var, eps_ptr)
    mod = (r // S)[:, None] * mod_stride + k[None, :]
    scale = tl.load(scale_ptr + mod, mask=m, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + mod, mask=m, other=0.0).to(tl.float32)
    y = (xc * rstd[:, None]) * (1.0 + scale) + shift
    tl.store(o_ptr + r[:, None] * D + k[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


def ln_modulation(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                  out_dtype: torch.dtype, *, rows_per_program: int | None = None,
                  long_rows: LongRows | None = None, in_register: bool = False,
                  digest: bool = False) -> torch.Tensor:
    """Parameter-free LayerNorm over d, then ·(1 + scale) + shift (``strict.adaln``): x [B,S,d];
    shift, scale [B,d] with a common row stride (views into one [B,2d] tensor allowed) →
    [B,S,d] ``out_dtype``. ``rows_per_program``, ``long_rows``, ``in_register``: as ``rms_norm``.
    ``digest`` (long rows, a bf16, fp16 or FP32 output): as ``rms_norm``'s, rows B·S (the long
    rows' trees, then the output in ``LN_DIGEST`` tiles)."""
    x = x.contiguous()
    bsz, s, d = x.shape
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = bsz * s
    eps_t = _f64_scalar(eps, x.device) if rows and d else None
    if (digest and rows and d and pow2(d) > SHORT_ROW and not in_register
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32)):
        bm, bc, warps = LN_DIGEST
        bc = bc * 2 // o.element_size()  # the same bytes a tile for an FP32 output (no spills)
        meta = _long_meta(d, _long_config(long_rows, None))
        table = gpu_rows.empty_table(rows, 1, x.device)
        keys = gpu_rows.byte_key_table(x.device, triton.cdiv(d, bc) * bc, o.element_size())
        produced.offer(o, table)
        _launch(_ln_digest_kernel, (triton.cdiv(rows, bm),), x, shift, scale, shift.stride(0), eps_t, o, rows, s,
                keys, keys.shape[1], *table, *gpu_rows.shift_constants(d, o.element_size()), D=d,
                NT_LOG2=meta["NT_LOG2"], TLOG2=meta["TLOG2"], BM=bm, BC=bc, WBYTES=o.element_size(),
                num_warps=warps)
    elif rows and d and pow2(d) > SHORT_ROW and not in_register:
        ln_modulation_long(x, shift, scale, eps_t, o, rows, s, d, _long_config(long_rows, rows_per_program))
    elif rows and d:
        per = rows_per_program or _rows_per_program(d)
        _launch(_ln_mod_kernel, (triton.cdiv(rows, per),), x, shift, scale, shift.stride(0),
                eps_t, o, rows, s, D=d, LOG2=pow2(d).bit_length() - 1, ROWS=per)
    return o


# ----------------------------------------------------------------------------- long rows
# A row longer than SHORT_ROW is walked by one program in aligned tiles of 2**tile_log2 elements,
# in one launch per operator: the program reads its row for the sum, again for the centred sum
# (LayerNorm), and once more for the output; the re-reads hit the cache, so the row crosses HBM
# once each way. The sum is the row's P-leaf pairwise tree taken as aligned subtrees: within a
# tile, the first three levels are elementwise sums of eight stride-8 loads (octet i's leaves
# 8i .. 8i+7, paired as the tree pairs them), then ``_pair_tree`` over the tile's octet sums, then
# the tree over the tile sums: the same additions as the in-register tree. Tiles past the row sum
# to +0, as the tree's padding. Why stride-8 loads: Triton lays a reshape/split chain out by
# holding the whole chain's input in every thread (each thread redoes the tile's tree), so the
# first levels are taken before any reshape and the replicated part is an eighth of the tile.
# A program holds one tile at a time and its rows are a loop, so the code (and compile time)
# stays that of one tile, whatever the row length or rows per program.

SHORT_ROW = 1024
"""Rows up to this length (padded) are reduced in registers by one program; longer ones by tiles."""


class LongRows(NamedTuple):
    """A launch configuration of the long-row kernels: the tile (2**tile_log2 elements, ≥ 16;
    capped at the padded row), warps per program and rows per program (a loop). It changes the
    speed, never the bytes."""

    tile_log2: int
    num_warps: int
    rows: int


LONG_ROWS = LongRows(tile_log2=10, num_warps=1, rows=1)
"""The registered configuration: 1024-element tiles, one warp, one row per program — the fastest
of ``benchmarks/sweep_strict_norms.py`` on an H200 (2026-12-02: LayerNorm [1, 6889, 3072] bf16
0.057 ms, 0.39× of ``F.layer_norm`` + modulation; every configuration gives the same bytes)."""


@triton.jit
def _leaf(x_ptr, r, live, mean, e, J: tl.constexpr, D: tl.constexpr, SQUARE: tl.constexpr, CENTER: tl.constexpr):
    """Elements e + J of row r (e = 8i: leaf J of each octet): x, x·x or (x − mean)², +0 past the row."""
    m = live & (e + J < D)
    v = tl.load(x_ptr + r * D + e + J, mask=m, other=0.0).to(tl.float32)
    if CENTER:
        v = tl.where(m, v - mean, 0.0)
    if SQUARE:
        v = v * v
    return v


@triton.jit
def _pair(x_ptr, r, live, mean, e, J: tl.constexpr, D: tl.constexpr, SQUARE: tl.constexpr, CENTER: tl.constexpr):
    """Leaves e + J and e + J + 1 (J even) added: one pair of the tree's first level."""
    a = _leaf(x_ptr, r, live, mean, e, J, D, SQUARE, CENTER)
    return a + _leaf(x_ptr, r, live, mean, e, J + 1, D, SQUARE, CENTER)


@triton.jit
def _octet(x_ptr, r, live, mean, e, D: tl.constexpr, SQUARE: tl.constexpr, CENTER: tl.constexpr):
    """Leaves e .. e + 7 by the tree's first three levels: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))."""
    lo = _pair(x_ptr, r, live, mean, e, 0, D, SQUARE, CENTER) + _pair(x_ptr, r, live, mean, e, 2, D, SQUARE, CENTER)
    hi = _pair(x_ptr, r, live, mean, e, 4, D, SQUARE, CENTER) + _pair(x_ptr, r, live, mean, e, 6, D, SQUARE, CENTER)
    return lo + hi


@triton.jit
def _row_sum(x_ptr, r, live, mean, D: tl.constexpr, NT_LOG2: tl.constexpr, TLOG2: tl.constexpr,
             SQUARE: tl.constexpr, CENTER: tl.constexpr):
    """tree_sum over row r of x, x·x or (x − mean)·(x − mean) (padded lanes +0) → [1]. Per tile,
    the first three levels are elementwise sums of eight stride-8 loads (element 8i + j is leaf j
    of octet i), the rest of the tile's tree runs over the octet sums; then the tree over the tile
    sums."""
    i8 = tl.arange(0, 2 ** (TLOG2 - 3)) * 8
    t_idx = tl.arange(0, 2**NT_LOG2)
    sums = tl.zeros((2**NT_LOG2,), tl.float32)
    for t in range(2**NT_LOG2):
        e = t * 2**TLOG2 + i8
        o = _octet(x_ptr, r, live, mean, e, D, SQUARE, CENTER)
        tile = _pair_tree(tl.reshape(o, (1, 2 ** (TLOG2 - 3))), TLOG2 - 3)
        sums = tl.where(t_idx == t, tile, sums)
    return _pair_tree(tl.reshape(sums, (1, 2**NT_LOG2)), NT_LOG2)


@triton.jit
def _rms_long_kernel(x_ptr, gain_ptr, eps_ptr, o_ptr, rows, D: tl.constexpr, NT_LOG2: tl.constexpr,
                     TLOG2: tl.constexpr, ROWS: tl.constexpr):
    """Per row: var = tree_sum(x·x) ÷ D; rstd (``_rstd``); y = (x·rstd)·gain, tile by tile."""
    k = tl.arange(0, 2**TLOG2)
    for i in range(ROWS):
        r = tl.program_id(0).to(tl.int64) * ROWS + i
        live = r < rows
        ssq = _row_sum(x_ptr, r, live, 0.0, D, NT_LOG2, TLOG2, True, False)
        rstd = _rstd(tl.div_rn(ssq, tl.full((1,), D, tl.float32)), eps_ptr)
        for t in range(2**NT_LOG2):
            kt = t * 2**TLOG2 + k
            m = live & (kt < D)
            x = tl.load(x_ptr + r * D + kt, mask=m, other=0.0).to(tl.float32)
            gain = tl.load(gain_ptr + kt, mask=m, other=0.0).to(tl.float32)
            tl.store(o_ptr + r * D + kt, ((x * rstd) * gain).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_row_stats(x_ptr, r, live, eps_ptr, D: tl.constexpr, NT_LOG2: tl.constexpr, TLOG2: tl.constexpr):
    """Row r's LayerNorm statistics → (mean, rstd), each [1] FP32: mean = tree_sum(x) ÷ D;
    var = tree_sum((x − mean)²) ÷ D; rstd (``_rstd``)."""
    total = _row_sum(x_ptr, r, live, 0.0, D, NT_LOG2, TLOG2, False, False)
    mean = tl.div_rn(total, tl.full((1,), D, tl.float32))
    ssq = _row_sum(x_ptr, r, live, mean, D, NT_LOG2, TLOG2, True, True)
    return mean, _rstd(tl.div_rn(ssq, tl.full((1,), D, tl.float32)), eps_ptr)


@triton.jit
def _ln_long_kernel(x_ptr, shift_ptr, scale_ptr, mod_stride, eps_ptr, o_ptr, rows, S, D: tl.constexpr,
                    NT_LOG2: tl.constexpr, TLOG2: tl.constexpr, ROWS: tl.constexpr):
    """Per row (sample b = row ÷ S): mean = tree_sum(x) ÷ D; var = tree_sum(xc·xc) ÷ D with
    xc = x − mean; rstd (``_rstd``); y = (xc·rstd)·(1 + scale[b]) + shift[b], tile by tile."""
    k = tl.arange(0, 2**TLOG2)
    for i in range(ROWS):
        r = tl.program_id(0).to(tl.int64) * ROWS + i
        live = r < rows
        mean, rstd = _ln_row_stats(x_ptr, r, live, eps_ptr, D, NT_LOG2, TLOG2)
        for t in range(2**NT_LOG2):
            kt = t * 2**TLOG2 + k
            m = live & (kt < D)
            x = tl.load(x_ptr + r * D + kt, mask=m, other=0.0).to(tl.float32)
            mod = (r // S) * mod_stride + kt
            scale = tl.load(scale_ptr + mod, mask=m, other=0.0).to(tl.float32)
            shift = tl.load(shift_ptr + mod, mask=m, other=0.0).to(tl.float32)
            y = ((x - mean) * rstd) * (1.0 + scale) + shift
            tl.store(o_ptr + r * D + kt, y.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_digest_kernel(x_ptr, shift_ptr, scale_ptr, mod_stride, eps_ptr, o_ptr, rows, S, KT, ktab, DR, DS,
                      shift_t, shift_t2, D: tl.constexpr, NT_LOG2: tl.constexpr, TLOG2: tl.constexpr,
                      BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr):
    """``_ln_long_kernel``'s arithmetic for rows ``[pid·BM, (pid+1)·BM)`` — each row's mean and
    rstd by the same trees, one row at a time — then the output in ``[BM, BC]`` tiles, and
    digest v2's row terms of the values stored, summed over the tiles, written as the one column
    split of the row table ``DR``/``DS`` (``capture.gpu_rows_kernels._tile_digest``)."""
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    at = tl.arange(0, BM)
    mean = tl.zeros([BM], tl.float32)
    rstd = tl.zeros([BM], tl.float32)
    for i in range(BM):
        r = tl.program_id(0).to(tl.int64) * BM + i
        mean_r, rstd_r = _ln_row_stats(x_ptr, r, r < rows, eps_ptr, D, NT_LOG2, TLOG2)
        mean = tl.where(at == i, mean_r, mean)
        rstd = tl.where(at == i, rstd_r, rstd)
    b = rm // S
    terms = _no_terms(BM)
    for it in range(0, (D + BC - 1) // BC):
        cols = it * BC + tl.arange(0, BC)
        m = (rm < rows)[:, None] & (cols < D)[None, :]
        x = tl.load(x_ptr + rm[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        mod = b[:, None] * mod_stride + cols[None, :]
        scale = tl.load(scale_ptr + mod, mask=m, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + mod, mask=m, other=0.0).to(tl.float32)
        y = (((x - mean[:, None]) * rstd[:, None]) * (1.0 + scale) + shift).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + rm[:, None] * D + cols[None, :], y, mask=m)
        terms = _add_terms(terms, _tile_digest(y, it * BC, (cols < D)[None, :], KT, ktab, BM, BC, WBYTES))
    _store_tile_digest(DR, DS, rm, rows, 0, shift_t, shift_t2, terms)


LN_DIGEST = (16, 256, 4)
"""Rows per program, output tile width (of a 16-bit output; half as many FP32 columns) and warps
of the digesting LayerNorm (``ln_modulation``'s ``digest``). Offline sm_90a: 220 registers, no
spills (FP32 at 256 columns spilled 64 bytes)."""


def _long_config(cfg: LongRows | None, rows_per_program: int | None) -> LongRows:
    cfg = cfg or LONG_ROWS
    return cfg._replace(rows=rows_per_program) if rows_per_program else cfg


def _long_meta(d: int, cfg: LongRows) -> dict:
    """Grid-independent constexprs of a long row of d elements under ``cfg``."""
    if cfg.tile_log2 < 4 or cfg.rows < 1:
        raise ValueError(f"long-row configuration {cfg}: tiles of at least 16 elements, rows ≥ 1")
    tlog2 = min(cfg.tile_log2, pow2(d).bit_length() - 1)
    return dict(D=d, NT_LOG2=pow2(d).bit_length() - 1 - tlog2, TLOG2=tlog2, ROWS=cfg.rows, num_warps=cfg.num_warps)


def rms_norm_long(x, gain, eps_t, o, rows, d, cfg: LongRows = LONG_ROWS):
    """``rms_norm`` for rows longer than SHORT_ROW (same bytes: the same tree, by tiles)."""
    _launch(_rms_long_kernel, (triton.cdiv(rows, cfg.rows),), x, gain, eps_t, o, rows, **_long_meta(d, cfg))


def ln_modulation_long(x, shift, scale, eps_t, o, rows, s, d, cfg: LongRows = LONG_ROWS):
    """``ln_modulation`` for rows longer than SHORT_ROW (same bytes: the same trees, by tiles)."""
    _launch(_ln_long_kernel, (triton.cdiv(rows, cfg.rows),), x, shift, scale, shift.stride(0), eps_t, o, rows, s,
            **_long_meta(d, cfg))
