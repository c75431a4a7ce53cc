"""Digest v2 core, torch-free: key tables, exact arithmetic mod p = 2**61 - 1, and the numpy path.

    >>> v, rows = digest_array(np.array([[1.0, -0.0]], np.float32), "float32", row_axis=0)
    >>> 0 <= v < P, rows.dtype, rows.shape
    (True, dtype('uint64'), (1,))

The definition, its collision bound and the shard rules are in ``drifttool.capture.digest`` (the
torch implementation, computed on the tensor's device) and ``docs/digest.md``. This module holds
what both implementations share, and the numpy implementation that ``drifttool.artifact.raw``
uses (reading artifacts must not import torch). Both give identical values: every step is exact
integer arithmetic, so neither the summation order nor the BLAS / SIMD dispatch can change a bit.

Arithmetic (all values are int64; every intermediate stays below 2**63):
    * a word ``w`` (< 2**32) is split into 16-bit halves ``h0 + 2**16 h1``; a key ``k`` (< p) into
      three 21-bit limbs ``k0 + 2**21 k1 + 2**42 k2``;
    * level 1: ``Σ_c h[r, c] · limb[c]`` over at most ``2**16`` columns is below
      ``2**16 · 2**16 · 2**21 = 2**53``, so an FP64 matmul of integers computes it exactly in any
      order (each product is exact; each partial sum is an integer < 2**53); column chunks are
      added as int64 and folded mod p at least every 512 chunks;
    * ``fold`` maps ``[0, 2**63)`` to ``[0, p)`` with ``2**61 ≡ 1``; ``rot(x, k)`` is ``x · 2**k
      mod p`` as a 61-bit rotation; ``modsum`` adds up to ``2**31`` values below ``2**61`` exactly
      by splitting them at bit 30;
    * level 2: ``Σ_r a_i[r] · t_j[r]`` with 21-bit limbs of the row key and the row digest, at
      most ``2**16`` rows per block (``< 2**59``), then rotated by ``21 (i + j)`` and added mod p.

The generic helpers (``fold``, ``rot``, ``addmod``, ``modsum``, ``finish_rows``, ``level2``)
take numpy arrays or torch tensors alike: they use only ``& | << >> + - *``, comparison,
``reshape`` and ``sum``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from drifttool.errors import UnsupportedConfigError

P = (1 << 61) - 1
"""The Mersenne prime 2**61 - 1: the digest's modulus."""

SEEDS = {
    "col": 0x6A09E667F3BCC908,   # B[c]   (SHA-512 initial hash words: fixed, nothing chosen)
    "col2": 0xBB67AE8584CAA73B,  # B'[c]
    "row": 0x3C6EF372FE94F82B,   # A[r]
    "row2": 0xA54FF53A5F1D36F1,  # A'[r]
    "header": 0x510E527FADE682D1,  # H[c], the keys of the header row (r = -1)
}
"""64-bit seed of each key family: ``key = splitmix64(seed + index) mod p``."""

DTYPE_CODES = {
    "bool": 1, "uint8": 2, "int8": 3, "int16": 4, "uint16": 5, "int32": 6, "uint32": 7,
    "int64": 8, "uint64": 9, "float16": 10, "bfloat16": 11, "float32": 12, "float64": 13,
    "complex64": 14, "complex128": 15, "float8_e4m3fn": 16, "float8_e5m2": 17,
    "float8_e4m3fnuz": 18, "float8_e5m2fnuz": 19, "complex32": 20,
}
"""Header word 0: the dtype (torch's spelling, as stored in artifacts)."""

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
    "uint32": 4, "float32": 4, "complex32": 4, "int64": 8, "uint64": 8, "float64": 8,
    "complex64": 8, "complex128": 16,
}
"""Bytes per element: 1 and 2 are one word, 4·k bytes are k 32-bit words (low word first)."""

COL_CHUNK = 1 << 16
"""Columns per exact FP64 product: ``2**16 · (2**16 - 1) · (2**21 - 1) < 2**53``."""
ROW_CHUNK = 1 << 16
"""Rows per exact level-2 block: ``2 · 2**16 · 2**21 · 2**21 · 3 < 2**63`` (two key families)."""
_FOLD_EVERY = 512  # column chunks added into one int64 before folding: 512 · 2**53 = 2**62
_M21 = (1 << 21) - 1
_M30 = (1 << 30) - 1


def words_per_element(dtype: str) -> int:
    """32-bit words per element (1 for 1- and 2-byte dtypes, whose element is one word).

    Raises:
        UnsupportedConfigError: a dtype without a digest code.
    """
    if dtype not in DTYPE_CODES:
        raise UnsupportedConfigError(f"digest v2 has no code for dtype {dtype!r} "
                                     f"(supports {sorted(DTYPE_CODES)})")
    return max(1, ITEMSIZE[dtype] // 4)


# -- keys ------------------------------------------------------------------------------------
def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of state ``x`` (uint64, wrapping): Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators" (OOPSLA 2014), as in Java's SplittableRandom."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def keys(family: str, start: int, stop: int) -> np.ndarray:
    """``int64 [stop - start]``: ``splitmix64(seed + i) mod p`` for ``i`` in ``[start, stop)``."""
    with np.errstate(over="ignore"):
        i = np.arange(start, stop, dtype=np.uint64) + np.uint64(SEEDS[family])
    return (splitmix64(i) % np.uint64(P)).astype(np.int64)


def limbs21(k: np.ndarray) -> np.ndarray:
    """``int64 [3, n]``: the 21-bit limbs of keys ``k`` (``k = l0 + 2**21 l1 + 2**42 l2``)."""
    return np.stack([(k >> s) & _M21 for s in (0, 21, 42)])


def col_limbs(n: int) -> np.ndarray:
    """``float64 [6, n]``: limbs of ``B[0:n]`` then of ``B'[0:n]`` (the level-1 matmul operand)."""
    return np.concatenate([limbs21(keys("col", 0, n)), limbs21(keys("col2", 0, n))]).astype(np.float64)


def row_limbs(n: int) -> np.ndarray:
    """``int64 [2, 3, n]``: limbs of ``A[0:n]`` and ``A'[0:n]`` (level 2)."""
    return np.stack([limbs21(keys("row", 0, n)), limbs21(keys("row2", 0, n))])


_NP_TABLES: dict[str, np.ndarray] = {}


def np_table(kind: str, n: int) -> np.ndarray:
    """Cached ``col_limbs`` / ``row_limbs`` of at least ``n`` entries, grown by doubling."""
    have = _NP_TABLES.get(kind)
    if have is None or have.shape[-1] < n:
        size = max(1024, 1 << max(0, n - 1).bit_length(), 2 * (0 if have is None else have.shape[-1]))
        _NP_TABLES[kind] = have = (col_limbs if kind == "col" else row_limbs)(size)
    return have


# -- header ----------------------------------------------------------------------------------
def header_words(dtype: str, shape: tuple[int, ...]) -> list[int]:
    """``[dtype code, ndim, d0, d1, …]``: the header row (r = -1).

    Raises:
        UnsupportedConfigError: unknown dtype, or a dim of 2**32 or more.
    """
    words_per_element(dtype)
    if any(int(d) >= 1 << 32 for d in shape):
        raise UnsupportedConfigError(f"digest v2 header words are 32-bit; shape {tuple(shape)}")
    return [DTYPE_CODES[dtype], len(shape), *map(int, shape)]


@lru_cache(maxsize=4096)
def header_value(dtype: str, shape: tuple[int, ...]) -> int:
    """``Σ_c H[c] · header_words[c] mod p`` (Python ints): the header term, added once."""
    hw = header_words(dtype, shape)
    return sum(int(k) * w for k, w in zip(keys("header", 0, len(hw)).tolist(), hw)) % P


# -- exact arithmetic mod p (numpy arrays or torch tensors, int64) ---------------------------
def fold(x: Any) -> Any:
    """``x mod p`` for ``0 <= x < 2**63``: ``2**61 ≡ 1``, so ``x ≡ (x & p) + (x >> 61) <= p + 3``."""
    y = (x & P) + (x >> 61)
    return y - P * (y >= P)


def rot(x: Any, k: Any, mask: Any) -> Any:
    """``x · 2**k mod p`` for ``0 <= x < p``, ``0 <= k < 61``: a 61-bit rotation (``mask`` is
    ``2**(61-k) - 1``; ints or arrays broadcasting against ``x``)."""
    return ((x & mask) << k) | (x >> (61 - k))


def addmod(a: Any, b: Any) -> Any:
    """``(a + b) mod p`` for ``a, b`` in ``[0, p)``."""
    s = a + b
    return s - P * (s >= P)


def modsum(x: Any, dims: Any) -> Any:
    """``Σ x mod p`` over ``dims`` for ``0 <= x < 2**61``, at most ``2**31`` terms: the low 30
    and high 31 bits are summed apart (each sum < 2**62) and recombined with a rotation by 30."""
    lo = (x & _M30).sum(dims)
    hi = (x >> 30).sum(dims)
    return addmod(fold(lo), rot(fold(hi), 30, (1 << 31) - 1))


def shift_consts(asarray) -> dict[str, Any]:
    """Shift amounts (and their masks ``2**(61-k) - 1``) of ``finish_rows`` / ``level2``, built
    with ``asarray(numpy int64 array)`` (the identity, or a move to a torch device)."""
    s1 = np.array([[[16 * h + 21 * (l % 3)] for h in range(2)] for l in range(6)], np.int64)  # [6, 2, 1]
    s2 = np.array([[(21 * (i + j)) % 61 for j in range(3)] for i in range(3)], np.int64)  # [3, 3]
    m = lambda s: (np.int64(1) << (61 - s)) - 1
    return {"s1": asarray(s1), "m1": asarray(m(s1)), "s2": asarray(s2), "m2": asarray(m(s2)),
            "s3": asarray(np.array([[[0], [21], [42]]], np.int64))}


def finish_rows(acc: Any, c: dict[str, Any]) -> Any:
    """Row digests from level-1 sums.

    Args:
        acc: ``int64 [6, H, R]``, each ``< 2**63``: ``Σ_c half_h[r, c] · limb_l[c]`` for limbs
            ``l = 0..2`` of ``B`` and ``3..5`` of ``B'`` and halves ``h < H`` (H = 1 or 2).
        c: ``shift_consts``.

    Returns:
        ``int64 [2, R]`` in ``[0, p)``: ``T`` and ``T'`` (``Σ 2**(16h + 21l) · acc``).
    """
    h = acc.shape[1]
    x = rot(fold(acc), c["s1"][:, :h], c["m1"][:, :h])
    return modsum(x.reshape(2, 3, h, acc.shape[2]), (1, 2))


def level2(rows: Any, a: Any, c: dict[str, Any]) -> Any:
    """``Σ_r A[r] T[r] + A'[r] T'[r] mod p`` over at most ``ROW_CHUNK`` rows.

    Args:
        rows: ``int64 [2, R]`` in ``[0, p)``: ``T``, ``T'``.
        a: ``int64 [2, 3, R]``: limbs of ``A``, ``A'`` of the same (global) rows.

    Returns:
        ``int64`` 0-dim, in ``[0, p)``.
    """
    t = (rows.reshape(2, 1, -1) >> c["s3"]) & _M21  # [2, 3 (limb j), R]
    u = (a.reshape(2, 3, 1, -1) * t.reshape(2, 1, 3, -1)).sum((0, 3))  # [3 (i), 3 (j)] < 2**59
    return modsum(rot(fold(u), c["s2"], c["m2"]), (0, 1))


# -- numpy implementation --------------------------------------------------------------------
_NP_CONSTS = shift_consts(lambda v: v)
_NP_BLOCK = 1 << 16  # halves per FP64 block (stays in L2 cache)


def halves_np(array: np.ndarray, dtype: str, row_axis: int | None) -> np.ndarray:
    """The words of ``array`` as ``[R, C, H]`` unsigned halves: ``H = 1`` (uint8 / uint16 words
    of 1- and 2-byte dtypes) or ``H = 2`` (16-bit halves of 32-bit words, low half first).

    ``array`` holds the elements (or, for bf16/fp8, their bits) in a native little-endian numpy
    dtype of ``ITEMSIZE[dtype]`` bytes. A copy is made only when ``row_axis`` is not 0 or the
    array is not C-contiguous.
    """
    wpe = words_per_element(dtype)
    if array.dtype.itemsize != ITEMSIZE[dtype]:
        raise ValueError(f"{dtype} array of itemsize {array.dtype.itemsize}")
    if row_axis is not None and array.ndim:
        array = np.moveaxis(array, row_axis, 0)
        r = array.shape[0]
    else:
        r = 1
    array = np.ascontiguousarray(array)
    n = int(np.prod(array.shape[1:] if row_axis is not None and array.ndim else array.shape))
    raw = array.reshape(-1).view(np.uint8 if ITEMSIZE[dtype] == 1 else np.uint16)
    return raw.reshape(r, n * wpe, 1 if ITEMSIZE[dtype] <= 2 else 2)


def row_sums_np(halves: np.ndarray, col_offset: int = 0) -> np.ndarray:
    """``int64 [2, R]``: ``T``, ``T'`` of each row over its columns ``col_offset + [0, C)``."""
    r, n, h = halves.shape
    acc = np.zeros((6, h, r), np.int64)
    kt = np_table("col", col_offset + n)
    for ci, c0 in enumerate(range(0, n, COL_CHUNK)):
        c1 = min(n, c0 + COL_CHUNK)
        rb = max(1, _NP_BLOCK // ((c1 - c0) * h))
        k = kt[:, col_offset + c0:col_offset + c1]  # [6, cb]
        for r0 in range(0, r, rb):
            r1 = min(r, r0 + rb)
            buf = np.empty((h, r1 - r0, c1 - c0))
            for j in range(h):
                buf[j] = halves[r0:r1, c0:c1, j]
            acc[:, :, r0:r1] += (k @ buf.reshape(-1, c1 - c0).T).reshape(6, h, r1 - r0).astype(np.int64)
        if ci % _FOLD_EVERY == _FOLD_EVERY - 1:
            acc = fold(acc)
    return finish_rows(acc, _NP_CONSTS)


def level2_np(rows: np.ndarray, row_offset: int = 0) -> int:
    """``Σ_r A[r] T[r] + A'[r] T'[r] mod p`` for ``rows`` ``int64 [2, R]`` of global rows
    ``row_offset + [0, R)``."""
    n = rows.shape[1]
    a = np_table("row", row_offset + n)
    parts = [level2(rows[:, r0:r0 + ROW_CHUNK], a[:, :, row_offset + r0:row_offset + min(n, r0 + ROW_CHUNK)],
                    _NP_CONSTS) for r0 in range(0, n, ROW_CHUNK)]
    return int(modsum(np.array(parts, np.int64), 0)) if parts else 0


def level2_segments_np(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``level2_np`` of many records at once: ``rows`` ``int64 [2, ΣR]`` holds ``T``, ``T'`` of
    each record's rows, the records one after another, ``lengths`` their row counts (each in
    ``[1, ROW_CHUNK]``, rows numbered from 0 within each record). Returns ``int64 [n]``: each
    record's ``Σ_r A[r] T[r] + A'[r] T'[r] mod p`` (sums of at most ``ROW_CHUNK`` products of
    21-bit limbs per record stay below ``2**59``, as in ``level2``)."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    local = np.arange(rows.shape[1], dtype=np.int64) - np.repeat(starts, lengths)
    a = np_table("row", int(lengths.max(initial=1)))[:, :, local]  # [2, 3, ΣR]: limbs of A, A'
    c = _NP_CONSTS
    t = (rows.reshape(2, 1, -1) >> c["s3"]) & _M21  # [2, 3 (limb j), ΣR]
    prod = (a.reshape(2, 3, 1, -1) * t.reshape(2, 1, 3, -1)).sum(0)  # [3 (i), 3 (j), ΣR] < 2**43
    u = np.add.reduceat(prod, starts, axis=2)  # [3, 3, n] < 2**59
    return modsum(rot(fold(u), c["s2"].reshape(3, 3, 1), c["m2"].reshape(3, 3, 1)), (0, 1))


def partial_np(array: np.ndarray, dtype: str, *, row_axis: int | None = None, row_offset: int = 0,
               col_offset: int = 0) -> tuple[np.ndarray, int]:
    """A shard's part: ``(int64 [2, R_shard] partial T, T' over its columns, partial V over its
    rows)``; ``col_offset`` counts elements of the flattened row (see ``capture.digest.partial``)."""
    halves = halves_np(array, dtype, row_axis)
    rows = row_sums_np(halves, col_offset * words_per_element(dtype))
    return rows, level2_np(rows, row_offset)


def digest_array(array: np.ndarray, dtype: str, row_axis: int | None = None) -> tuple[int, np.ndarray]:
    """Digest v2 of a whole tensor: ``(V, uint64 [R] row digests T)``.

    Args:
        array: the elements, C-order, native little-endian; bf16 and fp8 as uint16 / uint8 bits.
        dtype: torch's spelling (``"bfloat16"``). row_axis: the row axis, or ``None`` (one row).
    """
    rows, v = partial_np(array, dtype, row_axis=row_axis)
    return (v + header_value(dtype, tuple(array.shape))) % P, rows[0].astype(np.uint64)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}


def digest_bytes(data: bytes, dtype: str, shape: tuple[int, ...] | list[int],
                 row_axis: int | None = None) -> int:
    """``V`` of the tensor whose row-major little-endian bytes are ``data`` (a step record's
    ``data`` column, a safetensors buffer).

    Raises:
        ValueError: ``data`` does not hold ``shape`` elements of ``dtype``.
        UnsupportedConfigError: a dtype without a digest code.
    """
    words_per_element(dtype)
    size = ITEMSIZE[dtype]
    a = np.frombuffer(data, np.dtype(_UINT[size]).newbyteorder("<"))
    if size == 16:  # complex128: two uint64 per element
        a = a.reshape(-1, 2)
        a = a.view([("re", "<u8"), ("im", "<u8")]).reshape(-1)
    return digest_array(a.reshape(tuple(shape)), dtype, row_axis)[0]


def label(v: int) -> str:
    """How a digest v2 value is written into the manifest (``input_digests``, sigma table)."""
    return f"digest_v2:{v:016x}"
