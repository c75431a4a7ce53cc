"""Triton kernels of the strict CUDA norms (contract ``cuda1``): the learned-gain RMSNorm
(``rms_norm``) and the AdaLN LayerNorm with modulation (``ln_modulation``), under
``kernels.rows``' conventions: each row's sums are the pairwise tree of ``strict_trees.tree_sum``,
in registers for rows up to ``SHORT_ROW`` (padded) and in aligned 64-element chunks for longer
ones ("long rows"), the same additions either way; rstd in FP64, rounded once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

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


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float, out_dtype: torch.dtype, *,
             rows_per_program: int | None = None) -> torch.Tensor:
    """Learned-gain RMSNorm over the last axis (``strict.embed.rms_parts`` then ·gain):
    x [..., D] → [..., D] ``out_dtype`` (FP32 for the seam before a GEMM)."""
    x = x.contiguous()
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if rows and d and pow2(d) > SHORT_ROW and rows_per_program is None:
        rms_norm_long(x, gain.contiguous(), _f64_scalar(eps, x.device), o, rows, d)
    elif rows and d:
        per = rows_per_program or _rows_per_program(d)
        _launch(_rms_kernel, (triton.cdiv(rows, per),), x, gain.contiguous(), _f64_scalar(eps, x.device), o,
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
                  out_dtype: torch.dtype, *, rows_per_program: int | None = None) -> torch.Tensor:
    """Parameter-free LayerNorm over d, then ·(1 + scale) + shift (``strict.adaln``): x [B,S,d];
    shift, scale [B,d] with a common row stride (views into one [B,2d] tensor allowed) →
    [B,S,d] ``out_dtype``."""
    x = x.contiguous()
    bsz, s, d = x.shape
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = bsz * s
    if rows and d and pow2(d) > SHORT_ROW and rows_per_program is None:
        ln_modulation_long(x, shift, scale, _f64_scalar(eps, x.device), o, rows, s, d)
    elif rows and d:
        per = rows_per_program or _rows_per_program(d)
        _launch(_ln_mod_kernel, (triton.cdiv(rows, per),), x, shift, scale, shift.stride(0),
                _f64_scalar(eps, x.device), o, rows, s, D=d, LOG2=pow2(d).bit_length() - 1, ROWS=per)
    return o


# ----------------------------------------------------------------------------- long rows
# A row longer than SHORT_ROW is reduced in two steps, with the same additions as the in-register
# tree: each aligned chunk of CHUNK elements is one subtree of the row's P-leaf tree (its sum is
# written to a [rows, P/CHUNK] buffer; chunks past the row sum to +0, as the tree's padding), then
# the tree over the chunk sums (P/CHUNK ≤ 256 leaves) finishes it. Each program holds TILE_CHUNKS
# chunks; the kernels' code (and compile time) stays that of a 1024-element tile.

SHORT_ROW = 1024
"""Rows up to this length (padded) are reduced in registers by one program; longer ones in chunks."""
CHUNK_LOG2 = 6
TILE_CHUNKS = 16


@triton.jit
def _row_total(part_ptr, r, NLOG2: tl.constexpr):
    """tree_sum of row r's 2**NLOG2 chunk sums."""
    p = tl.load(part_ptr + r * (2**NLOG2) + tl.arange(0, 2**NLOG2))
    return tl.reshape(_pair_tree(tl.reshape(p, (1, 2**NLOG2)), NLOG2), ())


@triton.jit
def _chunk_sums_kernel(x_ptr, part_ptr, mpart_ptr, D: tl.constexpr, NLOG2: tl.constexpr,
                       SQUARE: tl.constexpr, CENTER: tl.constexpr, CLOG2: tl.constexpr,
                       TILE: tl.constexpr):
    """Program (row r, tile t): for its TILE chunks c, part[r, c] = tree_sum over the chunk of x,
    x·x, or (x − mean)·(x − mean) with mean = tree_sum(mpart[r]) ÷ D (padded lanes +0)."""
    W: tl.constexpr = 2**CLOG2
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    k = c[:, None] * W + tl.arange(0, W)[None, :]
    m = k < D
    x = tl.load(x_ptr + r * D + k, mask=m, other=0.0).to(tl.float32)
    if CENTER:
        mean = tl.div_rn(_row_total(mpart_ptr, r, NLOG2), tl.full((), D, tl.float32))
        x = tl.where(m, x - mean, 0.0)
    if SQUARE:
        x = x * x
    tl.store(part_ptr + r * (2**NLOG2) + c, _pair_tree(x, CLOG2))


@triton.jit
def _rms_out_kernel(x_ptr, gain_ptr, part_ptr, eps_ptr, o_ptr, D: tl.constexpr, NLOG2: tl.constexpr,
                    CLOG2: tl.constexpr, TILE: tl.constexpr):
    """var = tree_sum(x·x) ÷ D from the chunk sums; y = (x·rstd)·gain over the program's tile."""
    W: tl.constexpr = 2**CLOG2
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * (TILE * W) + tl.arange(0, TILE * W)
    m = k < D
    var = tl.div_rn(_row_total(part_ptr, r, NLOG2), tl.full((), D, tl.float32))
    rstd = _rstd(var, eps_ptr)
    x = tl.load(x_ptr + r * D + k, mask=m, other=0.0).to(tl.float32)
    gain = tl.load(gain_ptr + k, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + r * D + k, ((x * rstd) * gain).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_out_kernel(x_ptr, shift_ptr, scale_ptr, mod_stride, mpart_ptr, vpart_ptr, eps_ptr, o_ptr, S,
                   D: tl.constexpr, NLOG2: tl.constexpr, CLOG2: tl.constexpr, TILE: tl.constexpr):
    """mean and var from the chunk sums; y = ((x − mean)·rstd)·(1 + scale[b]) + shift[b]."""
    W: tl.constexpr = 2**CLOG2
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * (TILE * W) + tl.arange(0, TILE * W)
    m = k < D
    mean = tl.div_rn(_row_total(mpart_ptr, r, NLOG2), tl.full((), D, tl.float32))
    var = tl.div_rn(_row_total(vpart_ptr, r, NLOG2), tl.full((), D, tl.float32))
    rstd = _rstd(var, eps_ptr)
    x = tl.load(x_ptr + r * D + k, mask=m, other=0.0).to(tl.float32)
    mod = (r // S) * mod_stride + k
    scale = tl.load(scale_ptr + mod, mask=m, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + mod, mask=m, other=0.0).to(tl.float32)
    y = ((x - mean) * rstd) * (1.0 + scale) + shift
    tl.store(o_ptr + r * D + k, y.to(o_ptr.dtype.element_ty), mask=m)


def _long_geometry(d: int) -> tuple[int, int, int]:
    """(NLOG2, tiles per row, chunks per tile) of a long row of d elements."""
    nch = pow2(d) >> CHUNK_LOG2
    tile = min(TILE_CHUNKS, nch)
    return nch.bit_length() - 1, nch // tile, tile


def _chunk_sums(x, rows, d, *, square, mean_part=None):
    nlog2, tiles, tile = _long_geometry(d)
    part = torch.empty(rows, 1 << nlog2, dtype=torch.float32, device=x.device)
    _launch(_chunk_sums_kernel, (rows, tiles), x, part, mean_part if mean_part is not None else part,
            D=d, NLOG2=nlog2, SQUARE=square, CENTER=mean_part is not None, CLOG2=CHUNK_LOG2, TILE=tile)
    return part


def rms_norm_long(x, gain, eps_t, o, rows, d):
    """``rms_norm`` for rows longer than SHORT_ROW (same bytes: the same tree, in chunks)."""
    part = _chunk_sums(x, rows, d, square=True)
    nlog2, tiles, tile = _long_geometry(d)
    _launch(_rms_out_kernel, (rows, tiles), x, gain, part, eps_t, o, D=d, NLOG2=nlog2, CLOG2=CHUNK_LOG2, TILE=tile)


def ln_modulation_long(x, shift, scale, eps_t, o, rows, s, d):
    """``ln_modulation`` for rows longer than SHORT_ROW (same bytes: the same trees, in chunks)."""
    mpart = _chunk_sums(x, rows, d, square=False)
    vpart = _chunk_sums(x, rows, d, square=True, mean_part=mpart)
    nlog2, tiles, tile = _long_geometry(d)
    _launch(_ln_out_kernel, (rows, tiles), x, shift, scale, shift.stride(0), mpart, vpart, eps_t, o, s,
            D=d, NLOG2=nlog2, CLOG2=CHUNK_LOG2, TILE=tile)
