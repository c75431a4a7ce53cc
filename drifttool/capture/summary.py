"""A captured tensor's summary: the ``nonfinite``, ``l2`` and ``maxabs`` of its record, computed on
the tensor's device next to its digest and read back with it.

    >>> summary(4, stats_vec(torch.tensor([3.0, -4.0, 0.0, 0.0]), numpy=True).numpy())
    (0, 5.0, 4.0)

NaN/Inf are never hidden: they are counted and propagate into ``l2`` and ``maxabs``. The norm is
accumulated in fp64 (not bitwise-defined: a summary, not an identity; the digest is the identity,
``drifttool.capture.digest``). Integer and bool tensors have ``nonfinite = 0``; complex tensors
are summarised by ``|x|``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_STAT_CHUNK = 1 << 22  # elements per fp64 chunk for the norm on a device (32 MiB of scratch)
_NP_STAT_CHUNK = 1 << 16  # elements per chunk on the CPU (stays in cache)
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def stats_vec(t: torch.Tensor, *, numpy: bool) -> torch.Tensor:
    """``float64 [4]`` on ``t``'s device: Σx² (fp64, chunked), max, min, count of NaN/±inf;
    ``numpy``: a CPU tensor takes the numpy path (``_stats_np``; the same values)."""
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    elif x.is_complex():
        x = x.abs()
    elif x.is_floating_point() and x.dtype not in _REDUCIBLE:
        x = x.float()  # fp8: exact in fp32, and max/min have kernels for it
    if x.device.type == "cpu" and numpy:
        return torch.from_numpy(_stats_np(x))
    x = x.reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    if x.numel() == 0:
        return zero.repeat(4)
    sq, bad = zero, zero
    for i in range(0, x.numel(), _STAT_CHUNK):
        c = x[i:i + _STAT_CHUNK].to(torch.float64)
        sq = sq + (c * c).sum()
        if x.is_floating_point():
            bad = bad + (~torch.isfinite(c)).sum()
    return torch.stack([sq, x.max().to(torch.float64), x.min().to(torch.float64), bad])


def _stats_np(x: torch.Tensor) -> np.ndarray:
    """``stats_vec`` of a CPU tensor in single-threaded numpy: no BLAS and no torch intra-op
    threads, which stall on a busy machine (docs/benchmarks.md). bf16 widens to fp32 by its bits.
    Chunks of ``_NP_STAT_CHUNK`` elements keep the scratch small (no fresh pages per call)."""
    bf16 = x.dtype == torch.bfloat16
    v = x.contiguous().reshape(-1)
    v = v.view(torch.uint16).numpy() if bf16 else v.numpy()
    if v.size == 0:
        return np.zeros(4)
    sq, mx, mn, bad = 0.0, -math.inf, math.inf, 0
    for i in range(0, v.size, _NP_STAT_CHUNK):
        c = v[i:i + _NP_STAT_CHUNK]
        if bf16:
            c = (c.astype(np.uint32) << 16).view(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            sq += float(np.einsum("i,i->", c, c, dtype=np.float64))  # fp64 products and sum
        mx, mn = max(mx, float(c.max())), min(mn, float(c.min()))
        if c.dtype.kind == "f" and not math.isfinite(sq):  # only then can an element be NaN/±inf
            bad += int(c.size - np.count_nonzero(np.isfinite(c)))
    return np.array([sq, mx, mn, bad], np.float64)


def summary(numel: int, s: np.ndarray) -> tuple[int, float, float]:
    """``(nonfinite, l2, maxabs)`` of ``numel`` elements from ``stats_vec`` read back."""
    bad, l2, mx = summaries(np.asarray([numel], np.int64), np.asarray(s, np.float64).reshape(1, 4))
    return int(bad[0]), float(l2[0]), float(mx[0])


def summaries(numel: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``summary`` of many records at once: ``numel`` ``int64 [n]``, ``s`` ``float64 [n, 4]``
    (``stats_vec`` of each, read back) → ``nonfinite`` ``int64 [n]``, ``l2`` and ``maxabs``
    ``float64 [n]``. An empty tensor's are 0; a NaN in the sum of squares (a NaN element)
    propagates into ``l2`` and ``maxabs``."""
    sq, mx, mn, bad = np.asarray(s, np.float64).T
    nan, empty = np.isnan(sq), np.asarray(numel) == 0
    with np.errstate(invalid="ignore"):
        l2 = np.where(nan, np.nan, np.sqrt(np.where(nan, 0.0, sq)))
    maxabs = np.where(nan, np.nan, np.where(-mn > mx, -mn, mx))  # max(mx, -mn), ties to mx
    return (np.where(empty, 0, bad).astype(np.int64), np.where(empty, 0.0, l2),
            np.where(empty, 0.0, maxabs))
