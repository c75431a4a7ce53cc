"""Strict arithmetic primitives: fixed reduction trees, tile-shaped GEMMs, exact-op transcendentals.

Why these exist (measured on the 2-core CI CPU, see docs/strict-arithmetic.md):

* ``F.linear`` / ``torch.matmul`` are not row-invariant: a row's bytes at M=1 differ from M≥2,
  and with varying N. A batched matmul whose every member has one fixed shape (16 rows × K-chunk)
  *was* invariant at every M and position tried. So every GEMM here is computed tile by tile in
  fixed shapes, and K is reduced in the segmented order of contract v2 (8 segments by recursive
  halving, 64-chunks added sequentially within a segment, a depth-3 tree over the segments;
  ``drifttool.ops.strict_trees``), whose subtrees are the TP 2/4/8 shards of every Qwen-Image
  width.
* ``torch.sum`` may pick its reduction order from the tensor size and thread count. Reductions
  here are explicit pairwise trees of elementwise adds (IEEE-exact, so the same bytes whatever
  the vectorisation or threading).
* ``torch.exp``/``tanh``/``sin`` use SIMD (Sleef) code for the body of a buffer and libm for its
  tail, which can differ by an ULP — a row's bytes would depend on where it sits in the batch.
  The transcendentals here are built only from +, −, ×, ÷, round and exact power-of-two scaling,
  evaluated in FP64 and rounded once to FP32; each of those is correctly rounded in both SIMD and
  scalar code, so the result depends on the input value alone.

All functions take and return FP32 (FP64 internally where stated). Nothing here reads global
state; no TF32 (checked by ``drifttool.runtime.check_strict_environment``).
"""

from __future__ import annotations

import math

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_trees import (  # noqa: F401  (the trees are re-exported here)
    CHUNK,
    TreeAccumulator,
    local_spans,
    segment_spans,
    segmented_sum,
    shard_spans,
    tree_finish,
    tree_mean,
    tree_sum,
    tree_sum_stack,
)

ROW_TILE = 16  # GEMM rows per tile
N_TILE = 128  # GEMM output columns per tiled matmul member ([16, c] @ [c, 128])
KEY_TILE = 64  # attention keys per tile (QK columns, AV reduction chunk)

# ----------------------------------------------------------------------------- GEMM


def _pad_rows(x2: torch.Tensor, tile: int) -> tuple[torch.Tensor, int]:
    m = x2.shape[0]
    mp = -(-m // tile) * tile
    if mp != m:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, mp - m))
    return x2, m


EXACT_MAX_WEIGHT = 1 << 16  # GEMMs whose weight has at most this many elements use exact products
LINEAR_KERNEL = "strict_linear.v2[seg8.k64.seq|exact if N*K<=65536 else mm16x128]"  # trace kernel id
_EXACT_BLOCK = 1 << 22  # elements per materialised product block


def exact_matmul(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """``a @ btᵀ`` from correctly rounded FP32 products summed by ``tree_sum`` over K.

    Every output element is tree_sum(fp32(a_ik · b_jk) for k) — only IEEE multiplications and
    additions, each a separate operation — so the bytes are the same on every IEEE-754 machine
    (any CPU vector width, and a GPU), for every M and row position. Used by attention for small
    head dims; the strict GEMMs use ``tiled_linear`` (contract v2), whose exact kernel sums the
    same products in the segmented order instead.

    Args:
        a: [M, K] FP32.  bt: [N, K] FP32.
    Returns:
        [M, N] FP32.
    """
    m, k = a.shape
    n = bt.shape[0]
    rows = max(1, _EXACT_BLOCK // max(1, n * k))
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    for i in range(0, m, rows):
        out[i : i + rows] = tree_sum(a[i : i + rows, None, :] * bt[None, :, :])  # [r, N]
    return out


def linear_is_exact(n: int, k: int) -> bool:
    """The kernel rule of every strict GEMM, from the (unsharded) weight shape [N, K] alone:
    exact products when N·K ≤ ``EXACT_MAX_WEIGHT``, else the tiled kernel."""
    return n * k <= EXACT_MAX_WEIGHT


def _exact_chunks(a: torch.Tensor, bt: torch.Tensor):
    """chunk_partial(lo, hi) of the exact kernel: per output element the pairwise ``tree_sum``
    over the chunk's correctly rounded FP32 products a[:, lo:hi] · bt[:, lo:hi] → [M, N]."""
    m, n = a.shape[0], bt.shape[0]

    def chunk(lo: int, hi: int) -> torch.Tensor:
        rows = max(1, _EXACT_BLOCK // max(1, n * (hi - lo)))
        out = torch.empty(m, n, dtype=torch.float32, device=a.device)
        for i in range(0, m, rows):
            out[i : i + rows] = tree_sum(a[i : i + rows, None, lo:hi] * bt[None, :, lo:hi])
        return out

    return chunk


def _tiled_chunks(a: torch.Tensor, bt: torch.Tensor):
    """chunk_partial(lo, hi) of the tiled kernel: rows zero-padded to tiles of ``ROW_TILE``, the
    output columns zero-padded to tiles of ``N_TILE``; one batched matmul whose members all have
    the shape [M16, c] @ [c, 128] (c = hi − lo ≤ 64), in tile layout [N/128, M16, 128]."""
    a, _ = _pad_rows(a, ROW_TILE)
    bt, _ = _pad_rows(bt, N_TILE)
    wt = bt.reshape(-1, N_TILE, bt.shape[1])  # [Nt, 128, K]

    def chunk(lo: int, hi: int) -> torch.Tensor:
        return torch.matmul(a[:, lo:hi], wt[:, :, lo:hi].transpose(1, 2))  # [Nt, M16, 128]

    return chunk


def linear_partial(x2: torch.Tensor, w: torch.Tensor, spans, *, exact: bool) -> torch.Tensor | None:
    """The contract-v2 partial of ``x2 @ wᵀ`` over the K segments ``spans`` (coordinates of
    x2's K axis; a power-of-two list, contiguous): each segment's 64-chunks added sequentially,
    the segments by ``tree_finish``. No bias. This is what a row-parallel TP rank computes from
    its K shard (``spans = local_spans(shard_spans(segment_spans(K), T, rank))``); the owner adds
    the T rank partials with ``tree_finish`` and then the bias (``finish_linear``).

    In-chunk kernel: ``exact`` (from ``linear_is_exact`` of the unsharded weight) → pairwise tree
    of correctly rounded products (portable bytes); else one fixed-shape matmul member per
    (16-row tile, 128-column tile, chunk) — BLAS bytes, a hardware profile.

    Args:
        x2: [M, Ks] FP32.  w: [N, Ks] FP32.
    Returns:
        [M, N] FP32, or None when every segment is empty (K = 0).
    """
    m, n = x2.shape[0], w.shape[0]
    if all(lo == hi for lo, hi in spans):
        return None
    if exact:
        return segmented_sum(spans, _exact_chunks(x2, w))
    y = segmented_sum(spans, _tiled_chunks(x2, w))
    return y.transpose(0, 1).reshape(y.shape[1], y.shape[0] * N_TILE)[:m, :n]


def finish_linear(partials, b: torch.Tensor | None, shape: tuple[int, int], device=None) -> torch.Tensor:
    """The owner's step of a row-parallel GEMM: ``tree_finish`` over the T rank partials (in
    rank order, T ∈ {1, 2, 4, 8}; None = a rank with only empty segments), then the bias once.
    ``shape`` = (M, N) and ``device`` give the +0 result of an empty K."""
    y = tree_finish(list(partials))
    if y is None:
        y = torch.zeros(shape, dtype=torch.float32, device=device)
    return y if b is None else y + b


def tiled_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
                 weight_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Row-invariant ``x @ wᵀ + b`` in FP32 by strict contract v2 (docs/strict-arithmetic.md).

    K is split into 8 segments by recursive halving, each cut into 64-chunks added sequentially,
    the segments combined by the depth-3 tree, the bias added once. The in-chunk kernel is
    chosen from the weight's shape alone (never the row count): ``weight_shape`` (default
    ``w.shape``; a column-parallel TP rank passes the unsharded [N, K]) with N·K ≤ 65536 → exact
    products (portable bytes, the embedded tiny model); otherwise fixed-shape matmul members
    [16, c] @ [c, 128] (a column shard whose width is a multiple of 128 gives the unsharded
    columns' bytes; see ``column_shard_spans``).

    Args:
        x: [..., K] FP32.  w: [N, K] FP32.  b: [N] FP32 or None.
    Returns:
        [..., N] FP32.
    """
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    exact = linear_is_exact(*(weight_shape or (n, k)))
    x2 = x.reshape(lead.numel(), k)
    y = finish_linear([linear_partial(x2, w, segment_spans(k), exact=exact)], b, (x2.shape[0], n), x.device)
    return y.reshape(*lead, n)


def column_shard_spans(n: int, k: int, shards: int) -> list[tuple[int, int]]:
    """Output-column ranges of a column-parallel TP split of a GEMM with weight [N, K] into
    ``shards`` equal parts; each rank's ``tiled_linear(x, w[lo:hi], b[lo:hi],
    weight_shape=(n, k))`` gives exactly the unsharded output's columns lo:hi.

    Raises UnsupportedConfigError when N is not divisible by ``shards``, or, for the tiled
    kernel, when a shard's width is not a multiple of ``N_TILE`` (its members would differ).
    """
    if shards < 1 or n % shards:
        raise UnsupportedConfigError(f"strict column-parallel: N={n} not divisible into {shards} shards")
    width = n // shards
    if not linear_is_exact(n, k) and width % N_TILE:
        raise UnsupportedConfigError(
            f"strict column-parallel: shard width {width} of the tiled GEMM [{n}, {k}] is not a "
            f"multiple of the {N_TILE}-column tile")
    return [(r * width, (r + 1) * width) for r in range(shards)]


# ----------------------------------------------------------------------------- transcendentals
# FP64 evaluation from exact operations only; callers round once to FP32.

_LN2_HI = 6.93147180369123816490e-01  # 32 significant bits: k * _LN2_HI is exact for |k| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_COEF = [1.0 / math.factorial(i) for i in range(11)]  # Taylor on |r| <= ln2/2: rel. err < 3e-13


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k for integer-valued FP64 ``k`` in [-1022, 1023], built from its exponent bits (exact)."""
    bits = (k.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in FP64 from exact operations (Cody–Waite reduction, degree-10 Taylor).

    Relative error < 3e-13 (about 1/200000 of an FP32 ULP): ample for one rounding to FP32. ``-inf`` → 0, ``+inf`` → inf,
    NaN → NaN (payload of the input kept).
    """
    x = x.to(torch.float64)
    xc = torch.clamp(torch.nan_to_num(x, nan=0.0), -700.0, 700.0)
    k = torch.round(xc * _INV_LN2)
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        p = p * r + c
    y = p * _pow2(k)
    y = torch.where(x > 700.0, torch.full_like(y, math.inf), y)
    y = torch.where(x < -700.0, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


_LOG_COEF = [1.0 / (2 * i + 1) for i in range(12)]  # atanh series: 2s·Σ s^2i/(2i+1), |s| ≤ 0.1716
_SQRT2 = 1.41421356237309514547e00
_TWO54 = 18014398509481984.0  # 2^54: lifts subnormals into the normal range (exact scaling)


def log64(x: torch.Tensor) -> torch.Tensor:
    """ln(x) in FP64 from exact operations: exponent/mantissa split from the bits, then
    ln m = 2·atanh(s), s = (m − 1)/(m + 1), on m ∈ [√2/2, √2) (12-term odd series, truncation
    < 1e-18), recombined as (k·ln2_hi + (k·ln2_lo + ln m)) with k·ln2_hi exact.

    Relative error below 1e-15 (a few FP64 ULPs): the bytes depend on the input value alone,
    never on the SIMD dispatch (no torch/numpy transcendental is used). ``0`` → ``-inf``,
    negative → NaN, ``+inf`` → ``inf``, NaN → NaN.

    Args:
        x: tensor of any floating dtype (upcast to FP64). Returns FP64 of the same shape.
    """
    x = x.to(torch.float64)
    ok = torch.isfinite(x) & (x > 0)
    xs = torch.where(ok, x, torch.ones_like(x))
    tiny = xs < 2.2250738585072014e-308  # subnormal: scale by 2^54 first
    xs = torch.where(tiny, xs * _TWO54, xs)
    bits = xs.view(torch.int64)
    k = (bits >> 52) - 1023 - torch.where(tiny, 54, 0)  # unbiased exponent
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # mantissa in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)  # exact
    k = (k + big.to(torch.int64)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)  # m − 1 is exact (Sterbenz)
    s2 = s * s
    p = torch.full_like(s, _LOG_COEF[-1])
    for c in reversed(_LOG_COEF[:-1]):
        p = p * s2 + c
    y = k * _LN2_HI + (k * _LN2_LO + 2.0 * s * p)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, x, y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, math.nan), y)


def silu64(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x) = x / (1 + exp(−x)) in FP64 (exact-op ``exp64``)."""
    x = x.to(torch.float64)
    return x / (1.0 + exp64(-x))


def tanh64(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = sign(x)·(1 − 2/(exp(2|x|) + 1)) in FP64 (exact-op ``exp64``)."""
    x = x.to(torch.float64)
    a = torch.abs(x)
    t = 1.0 - 2.0 / (exp64(2.0 * a) + 1.0)
    return torch.where(x < 0, -t, t)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximate GELU ½x(1 + tanh(√(2/π)(x + 0.044715x³))) in FP64 (numerics §2.3)."""
    x = x.to(torch.float64)
    inner = _GELU_C * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + tanh64(inner))


_PIO2_1 = 1.57079632673412561417e00  # first 33 bits of pi/2
_PIO2_2 = 6.07710050650619224932e-11  # next 33 bits
_PIO2_3 = 2.02226624879595063154e-21
_INV_PIO2 = 6.36619772367581382433e-01
_SIN_COEF = [(-1) ** i / math.factorial(2 * i + 1) for i in range(10)]
_COS_COEF = [(-1) ** i / math.factorial(2 * i) for i in range(10)]


def _taylor_sincos(r: torch.Tensor, sin_coef: list[float], cos_coef: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin r, cos r) in FP64 by Horner's rule on r² (coefficients lowest order first)."""
    r2 = r * r
    s = torch.full_like(r, sin_coef[-1])
    for c in reversed(sin_coef[:-1]):
        s = s * r2 + c
    s = s * r
    c_ = torch.full_like(r, cos_coef[-1])
    for c in reversed(cos_coef[:-1]):
        c_ = c_ * r2 + c
    return s, c_


def _rotate_quadrant(q: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of r + q·π/2 from (sin r, cos r), q in {0, 1, 2, 3}: exact sign/swap."""
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in FP64 from exact operations: three-part Cody–Waite reduction by π/2
    (exact products for |x| < 2^20), Taylor polynomials on |r| ≤ π/4, quadrant selection.

    Valid for |x| < 2^20 (timestep phases are at most 1000, RoPE angles at most 4096); larger
    |x| raises ValueError.
    """
    x = x.to(torch.float64)
    if x.numel() and torch.nan_to_num(torch.abs(x)).max().item() >= 2.0**20:
        raise ValueError("sincos64 supports |x| < 2^20")
    n = torch.round(x * _INV_PIO2)
    r = ((x - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3
    return _rotate_quadrant(torch.remainder(n, 4.0), *_taylor_sincos(r, _SIN_COEF, _COS_COEF))


_HALF_PI = 1.57079632679489655800e00  # fl64(π/2)
_SIN_COEF_Q = [(-1) ** i / math.factorial(2 * i + 1) for i in range(13)]  # |r| < π/2: < 1e-19
_COS_COEF_Q = [(-1) ** i / math.factorial(2 * i) for i in range(13)]


def sincos_quadrant64(q: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin θ, cos θ) in FP64 for θ = (π/2)·(q + f), given exactly as an integer quadrant and a
    fraction: no argument reduction, no rounding (``torch.round`` wakes the thread pool on
    every call). r = fl64(fl64(π/2)·f); sin r, cos r by 13-term Taylor polynomials on
    [0, π/2) (truncation < 1e-19); the quadrant rotates them exactly.

    Args:
        q: int64, values in {0, 1, 2, 3}.  f: FP64 in [0, 1), same shape.
    Returns:
        (sin, cos), FP64 of that shape; absolute error a few FP64 ULPs.
    """
    r = _HALF_PI * f.to(torch.float64)
    return _rotate_quadrant(q, *_taylor_sincos(r, _SIN_COEF_Q, _COS_COEF_Q))


def sqrt32(v: torch.Tensor) -> torch.Tensor:
    """sqrt in FP64, rounded once to FP32.

    Measured: FP32 ``torch.sqrt`` gave different bytes on an Intel Xeon (torch 2.11) and an AMD
    EPYC (torch 2.13) for the same inputs. Some SIMD builds are not correctly rounded. A FP64
    square root that is off by one FP64 ULP changes the FP32 result only when it straddles an
    FP32 rounding boundary (p ≈ 2^-29 per element).
    """
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def rsqrt64(v: torch.Tensor) -> torch.Tensor:
    """1/sqrt(v) in FP64 (sqrt and division are correctly rounded)."""
    return 1.0 / torch.sqrt(v.to(torch.float64))


_BLOCK = 1 << 16  # elements per block: keeps the ~25 FP64 passes in cache (10x faster)


def pointwise32(fn64, x: torch.Tensor) -> torch.Tensor:
    """Apply an FP64 exact-op function elementwise in cache-sized blocks, rounding each result
    once to FP32. Blocking changes no bytes: every operation is elementwise."""
    flat = x.reshape(-1)
    res = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    for i in range(0, flat.numel(), _BLOCK):
        res[i : i + _BLOCK] = fn64(flat[i : i + _BLOCK])
    return res.view(x.shape)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """exp of ``x`` rounded once to FP32 (see ``exp64``)."""
    return pointwise32(exp64, x)


def silu32(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x`` rounded once to FP32 (see ``silu64``)."""
    return pointwise32(silu64, x)


def gelu_tanh32(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximate GELU of ``x`` rounded once to FP32 (see ``gelu_tanh64``)."""
    return pointwise32(gelu_tanh64, x)
