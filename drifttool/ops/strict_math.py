"""Strict arithmetic primitives: fixed reduction trees, tile-shaped GEMMs, exact-op transcendentals.

Why these exist (measured on the 2-core CI CPU, see docs/strict-arithmetic.md):

* ``F.linear`` / ``torch.matmul`` are not row-invariant: a row's bytes at M=1 differ from M≥2,
  and with varying N. A batched matmul whose every member has one fixed shape (16 rows × K-chunk)
  *was* invariant at every M and position tried. So every GEMM here is computed tile by tile in
  fixed shapes, and K is split into fixed chunks summed in a fixed pairwise tree.
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

ROW_TILE = 16  # GEMM rows per tile
K_CHUNK = 128  # GEMM reduction chunk (summed in the pairwise tree)
KEY_TILE = 64  # attention keys per tile (QK columns, AV reduction chunk)

# ----------------------------------------------------------------------------- reduction trees


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along ``dim`` with the canonical pairwise tree.

    The tree: zero-pad the axis to the next power of two P, then repeatedly add adjacent pairs
    (element 2i + element 2i+1) until one element is left. It depends on the axis length only,
    never on the other dimensions, the batch or the thread count. Trailing zeros beyond the data
    leave the result unchanged for non-negative data (x + 0 = x), which is what makes key-masked
    softmax sums invariant to prompt padding once valid keys are moved to the front.

    Args:
        x: FP32/FP64 tensor. Returns the same dtype with ``dim`` removed.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = _next_pow2(n)
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        pairs = x.unflatten(-1, (-1, 2))
        x = pairs[..., 0] + pairs[..., 1]
    return x[..., 0]


def tree_sum_stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum same-shape partials ``parts[0] + … + parts[n-1]`` with the canonical pairwise tree
    (zero-padded to a power of two, adjacent pairs). Contiguous power-of-two groups of partials
    form subtrees, so K shards aligned to them (tensor parallelism) reproduce the same bytes."""
    p = _next_pow2(len(parts))
    level = list(parts) + [torch.zeros_like(parts[0])] * (p - len(parts))
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


class TreeAccumulator:
    """Streaming ``tree_sum_stack``: add equal-shape partials one at a time, in order; ``result``
    returns the bytes ``tree_sum_stack(all partials)`` would (the same additions in the same
    pairing: leaf i with leaf i xor 1, and so on up, zero leaves up to a power of two), while
    holding at most log2(n) + 1 partials instead of n.

        >>> acc = TreeAccumulator()
        >>> for part in parts: acc.add(part)
        >>> total = acc.result()      # == tree_sum_stack(parts), byte for byte
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []
        self._count = 0

    def add(self, t: torch.Tensor) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            t = left + t
            level += 1
        self._stack.append((level, t))
        self._count += 1

    def result(self) -> torch.Tensor:
        if not self._count:
            raise ValueError("TreeAccumulator: nothing was added")
        zero = torch.zeros_like(self._stack[0][1])
        for _ in range(_next_pow2(self._count) - self._count):  # the zero padding of the tree
            self.add(zero)
        (_, total), = self._stack
        return total


def tree_mean(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``tree_sum(x, dim) / n`` (true division by the axis length)."""
    return tree_sum(x, dim) / x.shape[dim]


# ----------------------------------------------------------------------------- GEMM


def _pad_rows(x2: torch.Tensor, tile: int) -> tuple[torch.Tensor, int]:
    m = x2.shape[0]
    mp = -(-m // tile) * tile
    if mp != m:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, mp - m))
    return x2, m


EXACT_MAX_WEIGHT = 1 << 16  # GEMMs whose weight has at most this many elements use exact products
LINEAR_KERNEL = "strict_linear[exact if N*K<=65536 else bmm16.k128.tree]"  # trace kernel id
_EXACT_BLOCK = 1 << 22  # elements per materialised product block


def exact_matmul(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """``a @ btᵀ`` from correctly rounded FP32 products summed by ``tree_sum`` over K.

    Every output element is tree_sum(fp32(a_ik · b_jk) for k) — only IEEE multiplications and
    additions, each a separate operation — so the bytes are the same on every IEEE-754 machine
    (any CPU vector width, and a GPU), for every M and row position. Used where the operands are
    small enough to materialise the products block by block.

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


def tiled_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Row-invariant ``x @ wᵀ + b`` in FP32, the bias added once at the end.

    The kernel is chosen from the weight's shape alone (never from the number of rows):

    * ``N·K ≤ EXACT_MAX_WEIGHT``: ``exact_matmul`` — portable bytes (the embedded tiny model).
    * otherwise: rows zero-padded to tiles of ``ROW_TILE``, K zero-padded to chunks of
      ``K_CHUNK``; per chunk one batched matmul with fixed member shape [16, 128] @ [128, N];
      chunk partials summed by the ``tree_sum_stack`` tree (streamed with ``TreeAccumulator``,
      so at most log2(chunks) + 1 partials are alive). Bytes inside a member come from the BLAS
      kernel: invariant on one machine and library build, pinned per hardware profile.

    Args:
        x: [..., K] FP32.  w: [N, K] FP32.  b: [N] FP32 or None.
    Returns:
        [..., N] FP32.
    """
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = w.shape[0]
    if n * k <= EXACT_MAX_WEIGHT:
        y = exact_matmul(x.reshape(-1, k), w)
    else:
        x2, m = _pad_rows(x.reshape(-1, k), ROW_TILE)
        kp = -(-k // K_CHUNK) * K_CHUNK
        if kp != k:
            x2 = torch.nn.functional.pad(x2, (0, kp - k))
            w = torch.nn.functional.pad(w, (0, kp - k))
        xt = x2.view(-1, ROW_TILE, kp)  # [T, 16, Kp]
        wt = w.t()  # [Kp, N]
        acc = TreeAccumulator()  # = tree_sum_stack of the chunk partials, log2 of the memory
        for c in range(0, kp, K_CHUNK):
            acc.add(torch.matmul(xt[:, :, c : c + K_CHUNK], wt[c : c + K_CHUNK]))  # [T, 16, N]
        y = acc.result().reshape(-1, n)[:m]
    if b is not None:
        y = y + b
    return y.reshape(*lead, n)


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
