"""Triton kernels of the strict CUDA family's row operators: latent pack/unpack and normalize,
the gate residual, RoPE, the RMS norms and the AdaLN LayerNorm (contract ``cuda1``).

Every kernel does the strict CPU family's arithmetic (``drifttool.ops.strict``) in the same order,
so its bytes equal the CPU's:

* elementwise work is one IEEE FP32 operation per step, in the CPU's written order, launched with
  ``enable_fp_fusion=False`` (no FMA contraction: each product is rounded before its sum), FP32
  divisions by ``tl.div_rn`` (correctly rounded; Triton's ``/`` on FP32 is not);
* a row reduction (over d, Dh or Dj) zero-pads the row to the next power of two P and adds it by
  the canonical pairwise tree of ``strict_trees.tree_sum``: adjacent pairs (element 2i + element
  2i+1), level after level, until one element is left (``_pair_tree``). Short rows (P ≤
  ``SHORT_ROW``) are held whole by one program; long rows are summed as aligned 64-element
  subtrees, then the tree over those sums (section "long rows") — the same additions. The tree
  depends on the row length alone; padded lanes are +0 and are made +0 again before every sum
  that follows an operation on them;
* mean = sum ÷ D (FP32, correctly rounded); rstd = 1 ÷ sqrt(var + eps) in FP64 (eps an FP64
  value, sqrt and division correctly rounded), rounded once to FP32;
* inputs are widened to FP32 in the kernel and the output is cast once (round to nearest even).

A program owns ``ROWS`` whole rows (a fixed constexpr per operator); no reduction crosses rows,
so a row's bytes depend on its own inputs only, never on the batch, position or launch geometry
(``rows_per_program`` overrides ``ROWS`` for tests that prove it).

Wrappers take and return torch tensors on any device (outputs on the input's device), so
``TRITON_INTERPRET=1`` runs them on CPU tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ELEMENTS = 1024
"""Elements per program of the elementwise kernels."""

MAX_ROW = 16384
"""Longest reduced row held in one program's registers (d = 3072, Dj = 3584, Dh = 128 fit)."""


def _launch(kernel, grid, *args, **meta):
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def pow2(n: int) -> int:
    """The next power of two ≥ n (≥ 1): the padded width P of the pairwise tree."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


# ----------------------------------------------------------------------------- shared pieces


@triton.jit
def _pair_tree(x, LOG2: tl.constexpr):
    """Pairwise tree over axis 1 of ``x`` [R, 2**LOG2] → [R]: adjacent pairs, level by level
    (``strict_trees.tree_sum``'s order)."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = a + b
    return tl.reshape(x, (x.shape[0],))


@triton.jit
def _rstd(var, eps_ptr):
    """1 / sqrt(var + eps): FP64 (eps read as FP64; FP64 sqrt and division lower to the correctly
    rounded ``sqrt.rn.f64``/``div.rn.f64``), rounded once to FP32."""
    eps = tl.load(eps_ptr)
    v = var.to(tl.float64) + eps
    one = tl.full(v.shape, 1.0, tl.float64)
    return (one / tl.sqrt(v)).to(tl.float32)


# ----------------------------------------------------------------------------- latent


@triton.jit
def _pack_kernel(z_ptr, o_ptr, total, C, h, w, BLOCK: tl.constexpr):
    """o[b, i·w + j, c·4 + dy·2 + dx] = z[b, c, 2i + dy, 2j + dx] (a pure copy)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    c4 = 4 * C
    n = (o // c4) % (h * w)
    b = o // (c4 * h * w)
    ch = o % c4
    i = n // w
    j = n % w
    src = ((b * C + ch // 4) * (2 * h) + 2 * i + (ch // 2) % 2) * (2 * w) + 2 * j + ch % 2
    tl.store(o_ptr + o, tl.load(z_ptr + src, mask=m), mask=m)


@triton.jit
def _unpack_kernel(x_ptr, o_ptr, total, C, h, w, BLOCK: tl.constexpr):
    """o[b, c, 0, 2i + dy, 2j + dx] = x[b, i·w + j, c·4 + dy·2 + dx] (a pure copy)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    xx = o % (2 * w)
    yy = (o // (2 * w)) % (2 * h)
    c = (o // (4 * h * w)) % C
    b = o // (4 * h * w * C)
    src = (b * (h * w) + (yy // 2) * w + xx // 2) * (4 * C) + c * 4 + (yy % 2) * 2 + xx % 2
    tl.store(o_ptr + o, tl.load(x_ptr + src, mask=m), mask=m)


def pack(z: torch.Tensor) -> torch.Tensor:
    """[B,C,H',W'] (even H', W'; shape checked by the caller) → [B,(H'/2)(W'/2),4C], same dtype
    and bytes as ``strict.latent.pack``."""
    z = z.contiguous()
    b, c, hh, ww = z.shape
    h, w = hh // 2, ww // 2
    o = torch.empty(b, h * w, 4 * c, dtype=z.dtype, device=z.device)
    total = o.numel()
    if total:
        _launch(_pack_kernel, (triton.cdiv(total, ELEMENTS),), z, o, total, c, h, w, BLOCK=ELEMENTS)
    return o


def unpack(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[B,h·w,4C] → [B,C,1,2h,2w] (shape checked by the caller), the exact inverse of ``pack``."""
    x = x.contiguous()
    b, _, c4 = x.shape
    h, w = grid
    o = torch.empty(b, c4 // 4, 1, 2 * h, 2 * w, dtype=x.dtype, device=x.device)
    total = o.numel()
    if total:
        _launch(_unpack_kernel, (triton.cdiv(total, ELEMENTS),), x, o, total, c4 // 4, h, w, BLOCK=ELEMENTS)
    return o


@triton.jit
def _normalize_kernel(z_ptr, mean_ptr, std_ptr, o_ptr, total, C, inner, INVERSE: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Per channel c = (flat ÷ inner) mod C: std_inv = 1 ÷ std (FP32); forward (z − mean)·std_inv,
    inverse z ÷ std_inv + mean."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    ch = (o // inner) % C
    z = tl.load(z_ptr + o, mask=m, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + ch, mask=m, other=0.0)
    std = tl.load(std_ptr + ch, mask=m, other=1.0)
    std_inv = tl.div_rn(tl.full(std.shape, 1.0, tl.float32), std)
    if INVERSE:
        y = tl.div_rn(z, std_inv) + mean
    else:
        y = (z - mean) * std_inv
    tl.store(o_ptr + o, y.to(o_ptr.dtype.element_ty), mask=m)


def normalize(z: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``strict.latent.latent_normalize``'s forward: z [B,C,...] (FP32/BF16), mean/std [C] (taken
    as FP32) → z's shape and dtype."""
    z = z.contiguous()
    mean = mean.to(device=z.device, dtype=torch.float32).contiguous()
    std = std.to(device=z.device, dtype=torch.float32).contiguous()
    o = torch.empty_like(z)
    total = z.numel()
    if total:
        inner = z[0, 0].numel()
        _launch(_normalize_kernel, (triton.cdiv(total, ELEMENTS),), z, mean, std, o, total, z.shape[1],
                inner, INVERSE=bool(inverse), BLOCK=ELEMENTS)
    return o


# ----------------------------------------------------------------------------- elementwise


@triton.jit
def _gate_residual_kernel(x_ptr, g_ptr, y_ptr, o_ptr, total, S, D, BLOCK: tl.constexpr):
    """o = x + gate[b]·y, FP32, the product rounded before the sum."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    b = o // (S * D)
    x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + o, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * D + o % D, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + o, (x + g * y).to(o_ptr.dtype.element_ty), mask=m)


def gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x + gate·y: x, y [B,S,d], gate [B,d] → [B,S,d] ``out_dtype``."""
    x, gate, y = x.contiguous(), gate.contiguous(), y.contiguous()
    bsz, s, d = x.shape
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = o.numel()
    if total:
        _launch(_gate_residual_kernel, (triton.cdiv(total, ELEMENTS),), x, gate, y, o, total, s, d,
                BLOCK=ELEMENTS)
    return o


@triton.jit
def _rope_kernel(x_ptr, f_ptr, o_ptr, pairs, S, HP, P2, BLOCK: tl.constexpr):
    """Pair p = (b, s, h, j): (x0, x1) = x[2p], x[2p+1]; (c, s) = freqs[s, j];
    y0 = x0·c − x1·s, y1 = x0·s + x1·c (each product rounded)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < pairs
    j = p % P2
    pos = (p // HP) % S
    x0 = tl.load(x_ptr + 2 * p, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + 2 * p + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(f_ptr + (pos * P2 + j) * 2, mask=m, other=0.0)
    s = tl.load(f_ptr + (pos * P2 + j) * 2 + 1, mask=m, other=0.0)
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    tl.store(o_ptr + 2 * p, y0.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(o_ptr + 2 * p + 1, y1.to(o_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation: x [B,S,H,Dh], freqs [S,Dh/2] complex64 → x's shape and dtype."""
    x = x.contiguous()
    f = torch.view_as_real(freqs.to(device=x.device, dtype=torch.complex64).contiguous()).contiguous()
    _, s, h, dh = x.shape
    o = torch.empty_like(x)
    pairs = x.numel() // 2
    if pairs:
        _launch(_rope_kernel, (triton.cdiv(pairs, ELEMENTS),), x, f, o, pairs, s, h * (dh // 2), dh // 2,
                BLOCK=ELEMENTS)
    return o


# ----------------------------------------------------------------------------- norms


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
