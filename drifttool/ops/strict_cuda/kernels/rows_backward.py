"""Strict CUDA backward kernels of the row operators (contract ``grad.cuda1``): the RMSNorm and
LayerNorm input gradients, the per-sample row sums of the parameter gradients, the gate
residual's and RoPE's elementwise gradients.

    >>> dx, xhat = norm_grads(x, go, eps, gain=gain, dx_dtype=x.dtype)    # qk / txt_in RMSNorm
    >>> dx, xhat = norm_grads(x, go, eps, scale=scale, dx_dtype=x.dtype)  # AdaLN LayerNorm
    >>> parts = row_sums(a3, b3, live)      # [B, R, C] (· [B, R, C]) → [B, C], contract v2 rows
    >>> dy = gate_grad(go, gate, y.dtype);  dx = rope_grad(go, freqs, x.dtype)

Orders (the contract; docs/strict-arithmetic.md, "Strict CUDA backward"), each the strict CPU
backward's (``ops.strict.grad``, ``adaln``, ``embed``, ``attention``) operation for operation, so
the bytes equal the CPU's given the same inputs:

* ``norm_grads``: per row, the forward's statistics recomputed by the forward's trees (mean =
  tree(x) ÷ D, xc = x − mean, var = tree(xc·xc) ÷ D for the LayerNorm; var = tree(x·x) ÷ D for
  the RMSNorm; rstd = 1 ÷ sqrt(var + eps) in FP64, rounded once), xhat = xc·rstd (x·rstd);
  g = go·(1 + scale[b]) (go·gain); a = tree(g) ÷ D, c = tree(g·xhat) ÷ D; dx = rstd·((g − a) −
  xhat·c) (RMSNorm: rstd·(g − xhat·c)), one cast. Every tree is ``strict_trees.tree_sum``'s over
  the row zero-padded to P = pow2(D): each aligned 2^CLOG2-element chunk (CLOG2 = min(6, log2 P))
  is a subtree; the chunk sums, tile by tile of ``TILE`` elements, are collected in registers and
  the tree over them finishes it. A program holds ``ROWS`` whole rows; no sum crosses rows.
* ``row_sums`` (dshift, dscale, dgate, dgain): contract v2 over a sample's live rows, as
  ``ops.strict.grad.row_sum``: 64-row blocks, each the pairwise tree over its rows (the last,
  L < 64 rows, over pow2(L) leaves: nodes wholly past them are not added), the block list cut in 8
  segments by recursive halving (``shards.halving_spans``), a segment's blocks added in order
  (the first taken as is), the segments by ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), an empty one
  absent, no live row → +0. The blocks' trees are computed by one program each (64 columns), the
  chains and the tree by one program per (64 columns, sample). The product a·b, when given, is
  one FP32 multiplication.
* ``gate_grad``: go·gate[b] in FP32, one cast. ``rope_grad``: the inverse rotation dx0 = g0·c +
  g1·s, dx1 = g1·c − g0·s, each product rounded before its sum, one cast.

FP32 arithmetic without FMA contraction (``enable_fp_fusion=False``), divisions by ``tl.div_rn``.
Inputs bf16 or FP32; anything else raises ``UnsupportedConfigError``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_cuda.kernels.norms import _f64_scalar, _rstd  # the forward's, so the same rstd
from drifttool.ops.strict_cuda.kernels.rows import ELEMENTS, _launch, _pair_tree, pow2

TILE = 1024
"""Elements of a row a norm program holds at once (a longer row is walked in tiles)."""

SUM_COLS = 64
"""Columns per program of the per-sample row sums."""

KERNEL_ID = (f"triton.rownorm_grad.pairtree.tile{TILE}+rowsum.v2.rows64.bc{SUM_COLS}"
             "+gate_grad.nofma+rope_inverse.nofma")
"""Kernel identity of the row operators' backward kernels."""

_OPERANDS = (torch.float32, torch.bfloat16)


def _check(what: str, *ts: torch.Tensor | None) -> None:
    for t in ts:
        if t is not None and t.dtype not in _OPERANDS:
            raise UnsupportedConfigError(f"strict CUDA {what} backward: {t.dtype}; bf16 or float32 only")


# ----------------------------------------------------------------------------- norms


@triton.jit
def _collect(acc, v, t, ROWS: tl.constexpr, NT: tl.constexpr, CLOG2: tl.constexpr,
             NTILES: tl.constexpr):
    """acc[:, t, :] = the chunk sums of tile v [ROWS, NT·2^CLOG2] (each chunk's pairwise tree)."""
    part = tl.reshape(_pair_tree(tl.reshape(v, (ROWS * NT, 2**CLOG2)), CLOG2), (ROWS, NT))
    return tl.where((tl.arange(0, NTILES) == t)[None, :, None], part[:, None, :], acc)


@triton.jit
def _finish(acc, D: tl.constexpr, ROWS: tl.constexpr, NT: tl.constexpr, NTILES: tl.constexpr,
            TLOG2: tl.constexpr):
    """The tree over a row's chunk sums, ÷ D (FP32, correctly rounded) → [ROWS]."""
    s = _pair_tree(tl.reshape(acc, (ROWS, NTILES * NT)), TLOG2)
    return tl.div_rn(s, tl.full((ROWS,), D, tl.float32))


@triton.jit
def _tile(x_ptr, go_ptr, gain_ptr, scale_ptr, mod_stride, r, rm, t, S, mean, rstd,
          D: tl.constexpr, W: tl.constexpr, LN: tl.constexpr):
    """Tile t of rows r: (xhat or xc, g, mask). xc = x − mean (LN; +0 on padding) or x."""
    k = t * W + tl.arange(0, W)
    m = rm[:, None] & (k[None, :] < D)
    off = r[:, None] * D + k[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    if LN:
        x = tl.where(m, x - mean[:, None], 0.0)
    xhat = x * rstd[:, None]
    gy = tl.load(go_ptr + off, mask=m, other=0.0).to(tl.float32)
    if LN:
        sc = tl.load(scale_ptr + (r // S)[:, None] * mod_stride + k[None, :], mask=m, other=0.0)
        g = gy * (1.0 + sc.to(tl.float32))
    else:
        g = gy * tl.load(gain_ptr + k, mask=k < D, other=0.0).to(tl.float32)[None, :]
    return x, xhat, g, m, off


@triton.jit
def _norm_grad_kernel(x_ptr, go_ptr, gain_ptr, scale_ptr, mod_stride, eps_ptr, dx_ptr, xhat_ptr,
                      rows, S, D: tl.constexpr, LN: tl.constexpr, DX: tl.constexpr,
                      XHAT: tl.constexpr, ROWS: tl.constexpr, CLOG2: tl.constexpr,
                      NT: tl.constexpr, NTILES: tl.constexpr, TLOG2: tl.constexpr):
    """dx and xhat of ROWS rows (module docstring: four walks over the row's tiles)."""
    W: tl.constexpr = NT * 2**CLOG2
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < rows
    zero = tl.zeros((ROWS, NTILES, NT), tl.float32)
    one = tl.full((ROWS,), 1.0, tl.float32)
    mean = tl.zeros((ROWS,), tl.float32)
    if LN:
        acc = zero
        for t in range(NTILES):
            x, _, _, _, _ = _tile(x_ptr, go_ptr, gain_ptr, scale_ptr, mod_stride, r, rm, t, S, mean, one,
                                  D, W, False)
            acc = _collect(acc, x, t, ROWS, NT, CLOG2, NTILES)
        mean = _finish(acc, D, ROWS, NT, NTILES, TLOG2)
    acc = zero
    for t in range(NTILES):
        xc, _, _, _, _ = _tile(x_ptr, go_ptr, gain_ptr, scale_ptr, mod_stride, r, rm, t, S, mean, one, D, W, LN)
        acc = _collect(acc, xc * xc, t, ROWS, NT, CLOG2, NTILES)
    rstd = _rstd(_finish(acc, D, ROWS, NT, NTILES, TLOG2), eps_ptr)
    if DX:
        acc_a = zero
        acc_c = zero
        for t in range(NTILES):
            _, xhat, g, _, _ = _tile(x_ptr, go_ptr, gain_ptr, scale_ptr, mod_stride, r, rm, t, S, mean, rstd,
                                     D, W, LN)
            acc_a = _collect(acc_a, g, t, ROWS, NT, CLOG2, NTILES)
            acc_c = _collect(acc_c, g * xhat, t, ROWS, NT, CLOG2, NTILES)
        a = _finish(acc_a, D, ROWS, NT, NTILES, TLOG2)
        c = _finish(acc_c, D, ROWS, NT, NTILES, TLOG2)
    for t in range(NTILES):
        _, xhat, g, m, off = _tile(x_ptr, go_ptr, gain_ptr, scale_ptr, mod_stride, r, rm, t, S, mean, rstd,
                                   D, W, LN)
        if XHAT:
            tl.store(xhat_ptr + off, xhat, mask=m)
        if DX:
            if LN:
                g = g - a[:, None]
            dx = rstd[:, None] * (g - xhat * c[:, None])
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=m)


def norm_grads(x: torch.Tensor, go: torch.Tensor, eps: float, *, gain: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, dx_dtype: torch.dtype | None,
               want_xhat: bool = False, rows_per_program: int | None = None):
    """dx and xhat of the learned-gain RMSNorm (``gain``) or the modulated LayerNorm (``scale``).

    Args:
        x: the forward input, [..., D] (RMSNorm) or [B, S, D] (LayerNorm), bf16 or FP32.
        go: dL/d(output), x's shape, bf16 or FP32 (for txt_in, the FP32 gradient of the norm's output).
        gain: [D] (RMSNorm) — or scale: [B, D] with unit last stride (LayerNorm; y = xhat·(1 + scale) + shift).
        dx_dtype: dx's dtype, or None for no dx.  want_xhat: also return xhat (FP32, x's shape).
        rows_per_program: overrides ``ROWS`` (tests: the bytes do not depend on it).
    Returns:
        (dx or None, xhat or None).
    Raises:
        UnsupportedConfigError: dtypes other than bf16/FP32, mismatched shapes.
    """
    _check("norm", x, go, gain, scale)
    ln = scale is not None
    if go.shape != x.shape or (ln and (x.dim() != 3 or tuple(scale.shape) != (x.shape[0], x.shape[2]))) \
            or (not ln and (gain is None or tuple(gain.shape) != (x.shape[-1],))):
        raise UnsupportedConfigError(
            f"strict CUDA norm backward: x {tuple(x.shape)}, go {tuple(go.shape)}, "
            f"{'scale' if ln else 'gain'} {tuple((scale if ln else gain).shape) if (scale if ln else gain) is not None else None}"
            " do not match")
    x, go = x.contiguous(), go.contiguous()
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    dx = torch.empty(x.shape, dtype=dx_dtype, device=x.device) if dx_dtype is not None else None
    xhat = torch.empty(x.shape, dtype=torch.float32, device=x.device) if want_xhat else None
    if not rows or not d or (dx is None and xhat is None):
        return dx, xhat
    p = pow2(d)
    clog2 = min(6, p.bit_length() - 1)
    w = min(p, TILE)
    per = rows_per_program or max(1, TILE // p)
    if ln:
        scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    mod = scale if ln else gain.contiguous()
    _launch(_norm_grad_kernel, (triton.cdiv(rows, per),), x, go, mod, mod, mod.stride(0) if ln else 0,
            _f64_scalar(float(eps), x.device), dx if dx is not None else x, xhat if xhat is not None else x,
            rows, x.shape[1] if ln else 1, D=d, LN=ln, DX=dx is not None, XHAT=xhat is not None,
            ROWS=per, CLOG2=clog2, NT=w >> clog2, NTILES=p // w, TLOG2=(p >> clog2).bit_length() - 1)
    return dx, xhat


# ----------------------------------------------------------------------------- per-sample row sums


@triton.jit
def _block_kernel(a_ptr, b_ptr, live_ptr, part_ptr, C, NB, sab, sar, sbb, sbr, PROD: tl.constexpr,
                  BC: tl.constexpr):
    """part[b, blk, cols] = the pairwise tree over block blk's rows of sample b (its L live rows
    zero-padded to pow2(L) leaves: nodes wholly past them are not added); blocks past the live
    rows are not written."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    blk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    live = tl.load(live_ptr + b)
    rr = blk * 64 + tl.arange(0, 64)
    m = (cols < C)[:, None] & (rr < live)[None, :]
    v = tl.load(a_ptr + b * sab + rr[None, :] * sar + cols[:, None], mask=m, other=0.0).to(tl.float32)  # [BC, 64]
    if PROD:
        v = v * tl.load(b_ptr + b * sbb + rr[None, :] * sbr + cols[:, None], mask=m, other=0.0).to(tl.float32)
    n = tl.minimum(live - blk * 64, 64)
    p = tl.full((), 1, tl.int64)
    for _ in tl.static_range(6):
        p = tl.where(p < n, p * 2, p)
    for j in tl.static_range(6):
        lo, hi = tl.split(tl.reshape(v, (BC, 64 >> (j + 1), 2)))
        i = tl.arange(0, 64 >> (j + 1))
        v = tl.where((((2 * i + 1) << j) < p)[None, :], lo + hi, lo)
    tl.store(part_ptr + (b * NB + blk) * C + cols, tl.reshape(v, (BC,)), mask=(cols < C) & (n > 0))


@triton.jit
def _segment(part_ptr, lo, hi, cols, cm, BC: tl.constexpr, C):
    """Blocks [lo, hi) of a sample's partials added in order (the first as is) → (sum, present)."""
    acc = tl.zeros((BC,), tl.float32)
    for blk in range(lo, hi):
        p = tl.load(part_ptr + blk * C + cols, mask=cm, other=0.0)
        acc = tl.where(blk == lo, p, acc + p)
    return acc, hi > lo


@triton.jit
def _join(a, pa, b, pb):
    """A node of the segment tree: a + b, or the present one alone (both absent: b, +0)."""
    return tl.where(pa & pb, a + b, tl.where(pa, a, b)), pa | pb


@triton.jit
def _half(lo, hi):
    return lo + (hi - lo + 1) // 2


@triton.jit
def _segments_kernel(part_ptr, live_ptr, o_ptr, C, NB, BC: tl.constexpr):
    """o[b, cols] = the 8 segments of sample b's block partials (halving), each a chain, then the
    depth-3 tree."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = cols < C
    b = tl.program_id(1).to(tl.int64)
    nb = (tl.load(live_ptr + b) + 63) // 64
    base = part_ptr + b * NB * C
    m = _half(0, nb)
    q0, q1 = _half(0, m), _half(m, nb)
    e0, e1, e2, e3 = _half(0, q0), _half(q0, m), _half(m, q1), _half(q1, nb)
    s0, p0 = _segment(base, 0, e0, cols, cm, BC, C)
    s1, p1 = _segment(base, e0, q0, cols, cm, BC, C)
    s2, p2 = _segment(base, q0, e1, cols, cm, BC, C)
    s3, p3 = _segment(base, e1, m, cols, cm, BC, C)
    s4, p4 = _segment(base, m, e2, cols, cm, BC, C)
    s5, p5 = _segment(base, e2, q1, cols, cm, BC, C)
    s6, p6 = _segment(base, q1, e3, cols, cm, BC, C)
    s7, p7 = _segment(base, e3, nb, cols, cm, BC, C)
    s01, p01 = _join(s0, p0, s1, p1)
    s23, p23 = _join(s2, p2, s3, p3)
    s45, p45 = _join(s4, p4, s5, p5)
    s67, p67 = _join(s6, p6, s7, p7)
    s03, p03 = _join(s01, p01, s23, p23)
    s47, p47 = _join(s45, p45, s67, p67)
    s, _ = _join(s03, p03, s47, p47)
    tl.store(o_ptr + b * C + cols, s, mask=cm)


def row_sums(a3: torch.Tensor, b3: torch.Tensor | None, live: torch.Tensor) -> torch.Tensor:
    """Per-sample contract-v2 sums over rows (module docstring) of a3, or of the product a3·b3.

    Two launches: every 64-row block's tree (one program per (64 columns, block, sample), into an
    FP32 [B, ⌈R/64⌉, C] buffer), then one program per (64 columns, sample) adds that sample's
    block sums by the segments and their tree. The order is the contract's either way.

    Args:
        a3, b3: [B, R, C] bf16 or FP32 (b3 None: a3 alone).  live: [B] int64 on a3's device, the
            rows of each sample that take part (the CPU's ``live_rows`` of what is summed).
    Returns:
        [B, C] FP32 (a sample without live rows: +0).
    """
    _check("row sum", a3, b3)
    if a3.dim() != 3 or (b3 is not None and b3.shape != a3.shape) or live.shape != (a3.shape[0],):
        raise UnsupportedConfigError(f"strict CUDA row sum: a {tuple(a3.shape)}, b "
                                     f"{None if b3 is None else tuple(b3.shape)}, live {tuple(live.shape)}")
    a3 = a3 if a3.stride(2) == 1 else a3.contiguous()
    bb = a3 if b3 is None else (b3 if b3.stride(2) == 1 else b3.contiguous())
    bsz, rows, c = a3.shape
    live = live.to(torch.int64).contiguous()
    o = torch.empty((bsz, c), dtype=torch.float32, device=a3.device)
    nb = -(-rows // 64)
    if not o.numel():
        return o
    if nb == 0:
        return o.zero_()
    if nb > 65535 or bsz > 65535:
        raise UnsupportedConfigError(f"strict CUDA row sum: {rows} rows per sample, {bsz} samples; at most "
                                     f"{65535 * 64} rows and 65535 samples (one launch axis each)")
    part = torch.empty((bsz, nb, c), dtype=torch.float32, device=a3.device)
    cols = triton.cdiv(c, SUM_COLS)
    _launch(_block_kernel, (cols, nb, bsz), a3, bb, live, part, c, nb, a3.stride(0), a3.stride(1),
            bb.stride(0), bb.stride(1), PROD=b3 is not None, BC=SUM_COLS)
    _launch(_segments_kernel, (cols, bsz), part, live, o, c, nb, BC=SUM_COLS)
    return o


# ----------------------------------------------------------------------------- elementwise


@triton.jit
def _gate_grad_kernel(g_ptr, gate_ptr, o_ptr, total, S, D, BLOCK: tl.constexpr):
    """o = go·gate[b] in FP32, one cast."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    g = tl.load(g_ptr + o, mask=m, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + (o // (S * D)) * D + o % D, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + o, (g * gate).to(o_ptr.dtype.element_ty), mask=m)


def gate_grad(go: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dy of x + gate·y: go [B, S, d], gate [B, d] → go·gate [B, S, d] ``out_dtype``."""
    _check("gate residual", go, gate)
    if go.dim() != 3 or tuple(gate.shape) != (go.shape[0], go.shape[2]):
        raise UnsupportedConfigError(f"strict CUDA gate residual backward: go {tuple(go.shape)}, gate {tuple(gate.shape)}")
    go, gate = go.contiguous(), gate.contiguous()
    o = torch.empty(go.shape, dtype=out_dtype, device=go.device)
    if o.numel():
        _launch(_gate_grad_kernel, (triton.cdiv(o.numel(), ELEMENTS),), go, gate, o, o.numel(),
                go.shape[1], go.shape[2], BLOCK=ELEMENTS)
    return o


@triton.jit
def _rope_grad_kernel(g_ptr, f_ptr, o_ptr, pairs, S, HP, P2, BLOCK: tl.constexpr):
    """Pair p = (b, s, h, j): dx0 = g0·c + g1·s, dx1 = g1·c − g0·s (each product rounded)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < pairs
    j = p % P2
    pos = (p // HP) % S
    g0 = tl.load(g_ptr + 2 * p, mask=m, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + 2 * p + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(f_ptr + (pos * P2 + j) * 2, mask=m, other=0.0)
    s = tl.load(f_ptr + (pos * P2 + j) * 2 + 1, mask=m, other=0.0)
    tl.store(o_ptr + 2 * p, (g0 * c + g1 * s).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(o_ptr + 2 * p + 1, (g1 * c - g0 * s).to(o_ptr.dtype.element_ty), mask=m)


def rope_grad(go: torch.Tensor, freqs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dx of the interleaved-pair rotation: go [B, S, H, Dh], freqs [S, Dh/2] complex64 → the
    inverse rotation of go, ``out_dtype``."""
    _check("RoPE", go)
    if go.dim() != 4 or go.shape[-1] % 2 or freqs.dtype != torch.complex64 \
            or tuple(freqs.shape) != (go.shape[1], go.shape[-1] // 2):
        raise UnsupportedConfigError(f"strict CUDA RoPE backward: go {tuple(go.shape)}, freqs "
                                     f"{freqs.dtype} {tuple(freqs.shape)}; complex64 [S, Dh/2] needed")
    go = go.contiguous()
    f = torch.view_as_real(freqs.to(go.device).contiguous()).contiguous()
    _, s, h, dh = go.shape
    o = torch.empty(go.shape, dtype=out_dtype, device=go.device)
    pairs = go.numel() // 2
    if pairs:
        _launch(_rope_grad_kernel, (triton.cdiv(pairs, ELEMENTS),), go, f, o, pairs, s, h * (dh // 2), dh // 2,
                BLOCK=ELEMENTS)
    return o
