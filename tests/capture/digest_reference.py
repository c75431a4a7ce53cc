"""Digest v2 straight from its definition (docs/digest.md), in Python ints: slow, obviously right.

Independent of the implementation: nothing is imported from drifttool. Words come from the
tensor's little-endian bytes; keys from SplitMix64 written out here; sums are exact ints mod p.
"""

from __future__ import annotations

P = 2**61 - 1
M64 = 2**64 - 1
SEEDS = {"col": 0x6A09E667F3BCC908, "col2": 0xBB67AE8584CAA73B, "row": 0x3C6EF372FE94F82B,
         "row2": 0xA54FF53A5F1D36F1, "header": 0x510E527FADE682D1}
CODES = {"bool": 1, "uint8": 2, "int8": 3, "int16": 4, "uint16": 5, "int32": 6, "uint32": 7,
         "int64": 8, "uint64": 9, "float16": 10, "bfloat16": 11, "float32": 12, "float64": 13,
         "complex64": 14, "complex128": 15, "float8_e4m3fn": 16, "float8_e5m2": 17}


def key(family: str, i: int) -> int:
    z = (SEEDS[family] + i + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) % P


def words(row_bytes: bytes, itemsize: int) -> list[int]:
    """One word per 1/2-byte element, else one per 4 bytes (little-endian, low word first)."""
    w = min(itemsize, 4)
    return [int.from_bytes(row_bytes[i:i + w], "little") for i in range(0, len(row_bytes), w)]


def reference(data: bytes, dtype: str, shape: tuple[int, ...], itemsize: int,
              row_axis: int | None = None) -> tuple[int, list[int]]:
    """``(V, [T[r]])`` of the C-order tensor ``data`` of ``shape``; rows along ``row_axis``."""
    n = len(data) // itemsize
    assert n * itemsize == len(data)
    elems = [data[i * itemsize:(i + 1) * itemsize] for i in range(n)]
    if row_axis is None or not shape:
        rows = [elems]
    else:
        strides = [1] * len(shape)
        for a in range(len(shape) - 2, -1, -1):
            strides[a] = strides[a + 1] * shape[a + 1]
        others = [a for a in range(len(shape)) if a != row_axis]
        rows = []
        for r in range(shape[row_axis]):
            idx, cnt = [], 1
            for a in others:
                cnt *= shape[a]
            for k in range(cnt):  # row-major over the other axes
                off, rest = r * strides[row_axis], k
                for a in reversed(others):
                    off += (rest % shape[a]) * strides[a]
                    rest //= shape[a]
                idx.append(off)
            rows.append([elems[i] for i in idx])
    v, ts = 0, []
    for r, row in enumerate(rows):
        w = words(b"".join(row), itemsize)
        t = sum(key("col", c) * x for c, x in enumerate(w)) % P
        t2 = sum(key("col2", c) * x for c, x in enumerate(w)) % P
        ts.append(t)
        v += key("row", r) * t + key("row2", r) * t2
    header = [CODES[dtype], len(shape), *shape]
    v += sum(key("header", c) * x for c, x in enumerate(header))
    return v % P, ts
