"""Triton kernels of the strict CUDA elementwise row operators (contract ``cuda1``): the gate
residual ``x + gate·y`` and the interleaved-pair RoPE rotation, each product rounded before its
sum (``kernels.rows``' conventions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drifttool.capture import gpu_rows, produced
from drifttool.capture.gpu_rows_kernels import _add_terms, _no_terms, _store_tile_digest, _tile_digest
from drifttool.ops.strict_cuda.kernels.rows import ELEMENTS, _launch


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


@triton.jit
def _gate_residual_tile_kernel(x_ptr, g_ptr, y_ptr, o_ptr, R, S, D, tiles_per_split, KT, ktab, DR, DS,
                               shift_t, shift_t2, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr):
    """``_gate_residual_kernel``'s arithmetic on rows ``[pid·BM, (pid+1)·BM)`` of the
    ``[R = B·S, D]`` rows, column tiles ``[split·tiles_per_split, …)`` of ``BC`` columns
    (``split = program_id(1)``), and digest v2's row terms of the values stored, summed over the
    tiles and written as column split ``split`` of the row table ``DR``/``DS``
    (``capture.gpu_rows_kernels._tile_digest``)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    b = (rm // S).to(tl.int64)
    split = tl.program_id(1)
    first = split * tiles_per_split
    terms = _no_terms(BM)
    for it in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(D, BC))):
        rn = it * BC + tl.arange(0, BC)
        m = (rm[:, None] < R) & (rn[None, :] < D)
        at = rm.to(tl.int64)[:, None] * D + rn[None, :]
        x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + at, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b[:, None] * D + rn[None, :], mask=m, other=0.0).to(tl.float32)
        o = (x + g * y).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + at, o, mask=m)
        terms = _add_terms(terms, _tile_digest(o, it * BC, (rn < D)[None, :], KT, ktab, BM, BC, WBYTES))
    _store_tile_digest(DR, DS, rm, R, split, shift_t, shift_t2, terms)


TILE = (16, 128, 2)
"""Rows per program, columns per tile and column splits of a digesting elementwise launch: each
program walks its split's tiles (a row table of ``TILE[2]`` splits). Offline sm_90a at 4 warps:
255 registers, no spills (the int64 fold of each tile's limb sums); not yet timed on a device."""


_DIGESTED = (torch.bfloat16, torch.float16, torch.float32)


def _digest_launch(o: torch.Tensor, rows: int, cols: int) -> tuple[tuple[int, int], int, tuple]:
    """A digesting tile launch of ``o`` as ``[rows, cols]``: its grid, column tiles per split and
    the row-table arguments (keys, their width, the table, the ``u − 128`` corrections); the
    table is offered to ``o``'s capture (``capture.produced``) before the launch, which writes it
    on ``o``'s stream."""
    bm, bc, splits = TILE
    tiles = triton.cdiv(cols, bc)
    splits = min(splits, tiles)
    table = gpu_rows.empty_table(rows, splits, o.device)
    keys = gpu_rows.byte_key_table(o.device, tiles * bc, o.element_size())
    produced.offer(o, table)
    return ((triton.cdiv(rows, bm), splits), triton.cdiv(tiles, splits),
            (keys, keys.shape[1], *table, *gpu_rows.shift_constants(cols, o.element_size())))


def gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype, *,
                  digest: bool = False) -> torch.Tensor:
    """x + gate·y: x, y [B,S,d], gate [B,d] → [B,S,d] ``out_dtype``. ``digest``: also write the
    output's row table (digest v2, rows B·S) from the values stored and offer it to the output's
    capture (``capture.produced``; a bf16, fp16 or FP32 output): the same output bytes."""
    x, gate, y = x.contiguous(), gate.contiguous(), y.contiguous()
    bsz, s, d = x.shape
    o = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = o.numel()
    if total and digest and out_dtype in _DIGESTED:
        rows = bsz * s
        grid, tiles, args = _digest_launch(o, rows, d)
        _launch(_gate_residual_tile_kernel, grid, x, gate, y, o, rows, s, d, tiles, *args, BM=TILE[0],
                BC=TILE[1], WBYTES=o.element_size())
    elif total:
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


@triton.jit
def _rope_tile_kernel(x_ptr, f_ptr, o_ptr, R, S, C, DH, tiles_per_split, KT, ktab, DR, DS, shift_t,
                      shift_t2, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr):
    """``_rope_kernel``'s arithmetic on rows ``[pid·BM, (pid+1)·BM)`` of the ``[R = B·S, C = H·Dh]``
    rows, column tiles ``[split·tiles_per_split, …)`` of ``BC`` (even) columns, and digest v2's
    row terms of the values stored, written as column split ``split = program_id(1)`` of the row
    table ``DR``/``DS`` (as ``_gate_residual_tile_kernel``)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    pos = (rm % S).to(tl.int64)
    split = tl.program_id(1)
    first = split * tiles_per_split
    terms = _no_terms(BM)
    P2 = DH // 2
    for it in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(C, BC))):
        pc = it * (BC // 2) + tl.arange(0, BC // 2)  # pair columns of the tile
        m = (rm[:, None] < R) & (pc[None, :] < C // 2)
        at = rm.to(tl.int64)[:, None] * C + 2 * pc[None, :]
        x0 = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + at + 1, mask=m, other=0.0).to(tl.float32)
        fj = (pos[:, None] * P2 + pc[None, :] % P2) * 2
        c = tl.load(f_ptr + fj, mask=m, other=0.0)
        s = tl.load(f_ptr + fj + 1, mask=m, other=0.0)
        y0 = (x0 * c - x1 * s).to(o_ptr.dtype.element_ty)
        y1 = (x0 * s + x1 * c).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + at, y0, mask=m)
        tl.store(o_ptr + at + 1, y1, mask=m)
        y = tl.reshape(tl.join(y0, y1), [BM, BC])  # the pairs in memory order
        ok = (it * BC + tl.arange(0, BC) < C)[None, :]
        terms = _add_terms(terms, _tile_digest(y, it * BC, ok, KT, ktab, BM, BC, WBYTES))
    _store_tile_digest(DR, DS, rm, R, split, shift_t, shift_t2, terms)


def rope(x: torch.Tensor, freqs: torch.Tensor, *, digest: bool = False) -> torch.Tensor:
    """Interleaved-pair rotation: x [B,S,H,Dh], freqs [S,Dh/2] complex64 → x's shape and dtype.
    ``digest``: as ``gate_residual``'s (rows B·S of H·Dh elements)."""
    x = x.contiguous()
    f = torch.view_as_real(freqs.to(device=x.device, dtype=torch.complex64).contiguous()).contiguous()
    bsz, s, h, dh = x.shape
    o = torch.empty_like(x)
    pairs = x.numel() // 2
    if pairs and digest and o.dtype in _DIGESTED:
        rows, c = bsz * s, h * dh
        grid, tiles, args = _digest_launch(o, rows, c)
        _launch(_rope_tile_kernel, grid, x, f, o, rows, s, c, dh, tiles, *args, BM=TILE[0], BC=TILE[1],
                WBYTES=o.element_size())
    elif pairs:
        _launch(_rope_kernel, (triton.cdiv(pairs, ELEMENTS),), x, f, o, pairs, s, h * (dh // 2), dh // 2,
                BLOCK=ELEMENTS)
    return o
