"""Bitwise digests of tensors: one xxh3_64 per tensor (dtype + shape + bytes), one per row.

    >>> d = digest_tensor(torch.tensor([[3.0, -0.0], [4.0, 0.0]]), row_axis=0)
    >>> d.dtype, d.shape, hex(d.digest), [hex(r) for r in d.rows.tolist()]
    ('float32', (2, 2), '0x7c21b21f924b7c19', ['0xd36c0a551c02a39c', '0xea1882d8863a9f49'])
    >>> d.nonfinite, d.l2, d.maxabs
    (0, 5.0, 4.0)

Identity (design.md, "Digests"): ``digest = xxh3_64(b"<dtype>|<d0,d1,…>|" + raw bytes)``, so equal
digests <=> equal dtype, shape and bytes (+0 vs -0 differ, NaN payloads differ: it is the bytes
that are hashed, never the values). Row digests hash each row's bytes alone (the record digest
already pins dtype and shape).

Collision bound: xxh3_64 is a 64-bit non-cryptographic hash; treating it as a random function,
the chance that a diff of ``m`` record pairs misses a real difference is at most ``m / 2**64``,
and the chance that any two of ``n`` distinct tensors share a digest is about ``n**2 / 2**65``
(1e6 records: ~3e-8). It is not collision-resistant against an adversary.

Device: a GPU tensor is copied to the host (``.cpu()``) before hashing — a host sync per call.
Design.md asks for an on-device digest read back once per step; that is left for the GPU backend.
The digest is a function of the bytes only, so it will not change when that lands.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

_CHUNK = 1 << 22  # elements per fp64 chunk for the norm (32 MiB of scratch)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling stored in artifacts)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; raises ``ValueError`` for an unknown name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` in row-major order as a flat ``uint8`` array (no copy when ``t`` is a
    contiguous CPU tensor; a GPU tensor is copied to the host)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def digest(t: torch.Tensor) -> int:
    """xxh3_64 of ``t``'s dtype, shape and bytes, as an int in ``[0, 2**64)``."""
    h = xxhash.xxh3_64(f"{dtype_name(t.dtype)}|{','.join(map(str, t.shape))}|".encode())
    h.update(memoryview(raw_bytes(t)))
    return h.intdigest()


def row_digests(t: torch.Tensor, axis: int = 0) -> np.ndarray:
    """One xxh3_64 per index along ``axis`` over that slice's bytes (row-major, ``axis`` first).

    Returns:
        ``uint64 [t.shape[axis]]``.
    """
    if axis:
        t = t.movedim(axis, 0)
    n = t.shape[0]
    buf = memoryview(raw_bytes(t))
    rb = len(buf) // n if n else 0
    h = xxhash.xxh3_64_intdigest
    return np.fromiter((h(buf[i * rb : (i + 1) * rb]) for i in range(n)), np.uint64, count=n)


def _as_numpy_values(t: torch.Tensor) -> np.ndarray:
    """Flat numpy values, exact: bf16/fp8 widen to fp32, bool to uint8, complex as is."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return t.contiguous().reshape(-1).numpy()


def stats(t: torch.Tensor) -> tuple[int, float, float]:
    """``(nonfinite, l2, maxabs)`` of ``t``: count of NaN/Inf elements, fp64 L2 norm, max |x|.

    NaN/Inf are never hidden: they propagate into ``l2`` and ``maxabs`` and are counted. The norm
    is accumulated in fp64 chunk by chunk (not bitwise-defined; a summary, not an identity).
    Integer and bool tensors have ``nonfinite = 0``.
    """
    x = _as_numpy_values(t)
    if x.size == 0:
        return 0, 0.0, 0.0
    if np.iscomplexobj(x):
        x = np.abs(x)
    sq = 0.0
    for i in range(0, x.size, _CHUNK):
        c = x[i : i + _CHUNK].astype(np.float64)
        sq += float(np.square(c).sum())  # not np.dot: BLAS threads stall on a busy machine
    l2 = float(np.sqrt(sq))
    maxabs = max(float(x.max()), -float(x.min())) if not np.isnan(sq) else float("nan")
    nonfinite = 0
    if not np.isfinite(l2) and x.dtype.kind in "fc":
        nonfinite = int(x.size - np.count_nonzero(np.isfinite(x)))
    return nonfinite, l2, maxabs


@dataclass(frozen=True)
class TensorDigest:
    """Everything a record keeps about one canonical tensor (never the tensor itself).

    Attributes:
        dtype: e.g. ``"bfloat16"``. shape: the canonical shape.
        digest: xxh3_64 over dtype, shape and bytes (``digest``).
        rows: ``uint64 [n_rows]`` row digests, or ``None`` when not requested.
        nonfinite, l2, maxabs: see ``stats``.
    """

    dtype: str
    shape: tuple[int, ...]
    digest: int
    rows: np.ndarray | None
    nonfinite: int
    l2: float
    maxabs: float


def digest_tensor(t: torch.Tensor, *, row_axis: int | None = None) -> TensorDigest:
    """Digest ``t`` (and its rows along ``row_axis`` when given) and summarise it."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # one host copy serves the digest, the rows and the stats
    t = t.contiguous()
    rows = None if row_axis is None else row_digests(t, row_axis)
    nonfinite, l2, maxabs = stats(t)
    return TensorDigest(dtype_name(t.dtype), tuple(t.shape), digest(t), rows, nonfinite, l2, maxabs)
