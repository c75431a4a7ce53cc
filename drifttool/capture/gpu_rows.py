"""Digest v2 row sums of a float tensor on a CUDA device in one Triton kernel: read once, exact.

    >>> rows, stats = combine_splits(*row_table(x2d))   # x2d: CUDA [R, C] bf16/fp16/fp32
    >>> rows.shape, rows.dtype, stats.shape     # T and T' per row (in [0, p)); Σx², max, min, #bad
    ((R, 2), torch.int64, (R, 4))

What it computes is digest v2's level 1 (``drifttool.capture.digest``, docs/digest.md), the row
digests ``T[r] = Σ_c B[c] w[r, c]`` and ``T'[r] = Σ_c B'[c] w[r, c]`` mod ``p = 2**61 − 1``,
plus the per-row summary (fp64 Σx², max, min, count of NaN/±inf), in one pass over the tensor.

Exactness. A word ``w`` (one element of 2 or 4 bytes) is ``Σ_j 256**j u_j`` over its bytes, so
``T[r] = Σ_k E[k] u[r, k]`` over byte columns ``k = c·W + j`` with ``E[k] = B[c]·2**(8j) mod p``.
The kernel feeds the signed bytes ``s = u − 128`` and the limbs of ``E`` to an int8 × int8 →
int32 tensor-core product: kernel 2 (the default for rows of whole tiles) uses 8 signed 8-bit limbs per key
(``E = Σ_l d_l 256**l``, ``d_l`` in ``[−128, 127]``), kernel 1 9 unsigned 7-bit limbs. Each term
is at most ``2**14`` in magnitude, so ``2**16`` byte columns add below ``2**30`` in int32, and
the kernel folds its int32 accumulator into int64 mod p before that bound (``FOLD_BYTES``). The
``u − 128`` shift is undone by the constant ``128 · Σ_k E[k]``, added once per row (by column
split 0). Integer sums do not depend on the order of addition, so the result equals the CPU's
digest bit for bit (tested in ``tests/gpu``; in Triton's interpreter in ``tests/capture``).
``row_table`` returns the partial sums of ``TILE["split"]`` column splits; ``combine_splits``
adds them, and ``gather_rows`` does the same for a whole step's records at once, in one launch
that reads every table in place (``digest.materialize``). The kernels are in
``gpu_rows_kernels``.

The summary is a summary: Σx² is accumulated in fp64 per row in the kernel's order (not the
CPU's), max/min/count are exact.

Cost: one read of the tensor (the int8 products run on the tensor cores and the keys stay in L2).
Kernel 1 measured on an H200 at about 600 GB/s, bound by its per-element work rather than memory;
kernel 2's loop issues about a sixth of kernel 1's instructions per element (compiled for
sm_90a; docs/benchmarks.md, "Full-size forward on one GPU", and
``benchmarks/sweep_digest_rows.py`` for its speed on a device).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from drifttool import digestcore as core
from drifttool.capture import produced

try:  # Triton ships with CUDA builds of torch; the CPU never needs it
    import triton

    from drifttool.capture import gpu_rows_kernels as kernels
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

FOLD_BYTES = 1 << 16  # byte columns added in int32 before a fold (2**16 · 2**14 <= 2**30)
_WORD_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}
_FLOAT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_DEFERRAL = threading.local()
# Triton's interpreter (read when the kernels are decorated, at import) runs no inline assembly
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

TILE = {"kernel": 2, "bm": 64, "bc": 128, "warps": 4, "stages": 4, "split": 4, "v": 8, "regs": 1}
"""The row kernel's settings: ``kernel`` (2, or 1: the first version), rows and element columns
per program step (``bc`` a power of two up to 4096; kernel 2 takes half as many columns of a
4-byte type, the same bytes), warps, pipeline stages, column splits (each
split a program of its own, partial sums combined at ``materialize``; more programs in flight for
outputs of few rows) and, for kernel 2, ``v``: columns summed within a thread into one fp64 Σx²
accumulator (0: one per row, reduced every tile), and ``regs``: 1 passes the product's operand
from registers through a swizzled shared buffer, 0 lets the compiler read it from the pipelined
tile's unswizzled buffer (``gpu_rows_kernels._tile``). Kernel 1 measured on an H200
(docs/benchmarks.md): 16 × 128, 4 warps, 4 splits, 0.58–0.73 TB/s. Kernel 2's setting is the
fastest of ``benchmarks/sweep_digest_rows.py`` on an H200 (2026-12-02: 2.0–2.9 TB/s read, the
same T, T'; ``tests/gpu/test_digest_cuda.py`` runs both kernels).

The last, partial tile of a row is loaded with ``other=0`` and then set to 128 (``tl.where``):
on an H200 (2026-12-03, Triton 3.6) a masked ``uint8`` load with ``other=128`` was compiled
wrongly once vectorised (row strides of a multiple of 16 bytes: rows of 24, 40, 64 or 240 bf16
elements gave wrong T, T'; Triton's interpreter was right). ``tests/gpu/test_digest_cuda.py``
checks kernel 2 against kernel 1 and the CPU digest on those shapes."""


def float_code(dtype: torch.dtype) -> int:
    """The row kernels' ``FLOAT`` of ``dtype``: 0 bf16, 1 fp16, 2 fp32."""
    return _FLOAT[dtype]


def defer_to(batch: Any) -> Any:
    """Make ``batch`` (a ``gpu_row_batch.RowBatch``, or None) take this thread's ``row_table``
    launches of the tensors it ``takes``; returns the one it replaces."""
    before = getattr(_DEFERRAL, "batch", None)
    _DEFERRAL.batch = batch
    return before


def available(t: torch.Tensor) -> bool:
    """Whether ``row_table`` can digest ``t``: a CUDA float tensor (bf16, fp16, fp32), Triton
    importable."""
    return triton is not None and t.is_cuda and t.dtype in _WORD_BYTES


# -- key tables -----------------------------------------------------------------------------------
def _byte_keys(family: str, n: int, wbytes: int) -> np.ndarray:
    """``int64 [wbytes, n]``: ``E_j[c] = key[c] · 2**(8j) mod p`` (a 61-bit rotation)."""
    k = core.keys(family, 0, n)
    out = np.empty((wbytes, n), np.int64)
    for j in range(wbytes):
        s = 8 * j
        out[j] = core.rot(k, s, (1 << (61 - s)) - 1) if s else k
    return out


def _signed_limbs(e: np.ndarray) -> np.ndarray:
    """``int8 [8, ...]``: ``d_l`` in ``[−128, 127]`` with ``e = Σ_l d_l 256**l`` exactly, for
    ``0 <= e < 2**61``."""
    out = np.empty((8,) + e.shape, np.int8)
    rest = e.astype(np.int64)
    for l in range(8):
        d = ((rest + 128) & 255) - 128
        out[l] = d
        rest = (rest - d) >> 8
    if rest.any():  # pragma: no cover - 8 signed limbs hold every value below 2**63
        raise AssertionError("a key needs more than 8 signed limbs")
    return out


def _limb_table(n: int, wbytes: int) -> np.ndarray:
    """Kernel 1's ``int8 [wbytes, n, 32]``: the 7-bit limbs of ``E_j[c]`` of ``B`` (columns 0–8)
    and ``B'`` (9–17); columns 18–31 are zero."""
    t = np.zeros((wbytes, n, 32), np.int8)
    for f, family in enumerate(("col", "col2")):
        e = _byte_keys(family, n, wbytes)
        for l in range(9):
            t[:, :, f * 9 + l] = (e >> (7 * l)) & 127
    return t


def _signed_table(n: int, wbytes: int) -> np.ndarray:
    """Kernel 2's ``int8 [16, n · wbytes]``: row ``8f + l`` is limb ``l`` of ``E[k]`` of family
    ``f`` (``B``, ``B'``) at byte column ``k = c · wbytes + j`` (memory order, little endian)."""
    e = np.stack([_byte_keys(f, n, wbytes).T.reshape(-1) for f in ("col", "col2")])  # [2, n·W]
    return _signed_limbs(e).transpose(1, 0, 2).reshape(16, -1)


_TABLES: dict[tuple[int, torch.device, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
"""Key tables replaced by a larger one, kept alive: a CUDA graph captured before the growth reads
the old table at its address at every replay (``model.graphs``)."""
_SHIFT: dict[tuple[int, int], tuple[int, int]] = {}


def _key_table(kernel: int, device: torch.device, n: int, wbytes: int) -> torch.Tensor:
    """The kernel's key table on ``device`` for at least ``n`` element columns (cached, grown by
    doubling; ``N`` a power of two >= 4096, so a whole number of tiles): kernel 1 ``int8
    [N · wbytes, 32]``, kernel 2 ``int8 [16, N · wbytes]``."""
    have = _TABLES.get((kernel, device, wbytes))
    if have is None or have.numel() < n * wbytes * (32 if kernel == 1 else 16):
        size = max(4096, 1 << max(0, n - 1).bit_length())
        if kernel == 1:
            table = _limb_table(size, wbytes).transpose(1, 0, 2).reshape(-1, 32)
        else:
            table = _signed_table(size, wbytes)
        if (kernel, device, wbytes) in _TABLES:
            _RETIRED.append(_TABLES[(kernel, device, wbytes)])
        have = torch.from_numpy(np.ascontiguousarray(table)).to(device)
        _TABLES[(kernel, device, wbytes)] = have
    return have


def byte_key_table(device: torch.device, n: int, wbytes: int) -> torch.Tensor:
    """Kernel 2's key table (int8 ``[16, N · wbytes]``, ``N >= n`` element columns) on
    ``device``: what a producing kernel's digest reads (``gpu_rows_kernels._tile_digest``)."""
    return _key_table(2, device, n, wbytes)


def shift_constants(n: int, wbytes: int) -> tuple[int, int]:
    """The ``u − 128`` corrections of ``T`` and ``T'`` for rows of ``n`` elements of
    ``wbytes`` bytes, added once per row (by column split 0)."""
    return _shift_constants(n, wbytes)


def empty_table(rows: int, splits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An unwritten row table: ``(int64 [splits, rows, 2], float64 [splits, rows, 4])`` in one
    allocation (``row_table``'s format)."""
    buf = torch.empty(6 * rows * splits, dtype=torch.int64, device=device)
    return (buf[:2 * rows * splits].view(splits, rows, 2),
            buf[2 * rows * splits:].view(torch.float64).view(splits, rows, 4))


def _shift_constants(n: int, wbytes: int) -> tuple[int, int]:
    """``128 · Σ_{c<n, j} E_j[c] mod p`` for ``B`` and ``B'``: undoes the ``u − 128`` shift."""
    key = (n, wbytes)
    if key not in _SHIFT:
        _SHIFT[key] = tuple(128 * int(_byte_keys(f, n, wbytes).astype(object).sum()) % core.P
                            for f in ("col", "col2"))
    return _SHIFT[key]


# -- launch ---------------------------------------------------------------------------------------
def row_table(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row digests and row summaries of a 2-D CUDA float tensor (see the module docstring).

    Args:
        x: ``[R, C]`` bf16, fp16 or fp32 on a CUDA device; the last axis contiguous (rows may be
            strided).

    Returns:
        ``(rows, stats)``: ``int64 [S, R, 2]`` (``T``, ``T'`` in ``[0, p)``) and ``float64
        [S, R, 4]`` (Σx², max, min, count of NaN/±inf) of the ``S = TILE["split"]`` column
        splits, on ``x``'s device, nothing read back: a row's values are the sums (mod p for
        ``T``, ``T'``), the max and the min over the splits (``combine_splits``). The table the
        kernel that wrote ``x`` offered, when there is one (``capture.produced``: its own number
        of splits), without reading ``x``. Inside a ``gpu_row_batch.RowBatch`` the table is
        written by the batch's later launch (``defer_to``).

    Raises:
        ValueError: not a 2-D CUDA bf16/fp16/fp32 tensor with a contiguous last axis, or a
            ``TILE`` naming no kernel.
    """
    if not available(x) or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"row_table needs a 2-D CUDA bf16/fp16/fp32 tensor with contiguous rows, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    made = produced.table(x)
    if made is not None:
        return made
    batch = getattr(_DEFERRAL, "batch", None)
    if batch is not None and batch.takes(x):
        if batch.defers:
            return batch.add(x)
        batch.count(x)  # a warm-up: measured, launched now
    if x.device.type != "cuda" or x.device.index == torch.cuda.current_device():  # (CPU: the interpreter)
        return launch(x, TILE)
    with torch.cuda.device(x.device):
        return launch(x, TILE)


def launch(x: torch.Tensor, tile: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_table`` of ``x`` with the settings ``tile`` (keys as ``TILE``), on any device Triton
    runs on: CUDA, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests). No checks of ``x``
    beyond its dtype; ``row_table`` is the entry point.

    Raises:
        ValueError: ``tile["kernel"]`` is not 1 or 2, ``tile["bc"]`` not a power of two up to
            4096, or ``tile["v"]`` neither 0 nor a power of two (it is capped at the tile's
            columns).
    """
    kernel, bm, bc = int(tile.get("kernel", 2)), int(tile["bm"]), int(tile["bc"])
    if kernel not in (1, 2):
        raise ValueError(f"row kernel {kernel} does not exist (1 or 2)")
    if bc < 16 or bc > 4096 or bc & (bc - 1):
        raise ValueError(f"row kernel tile width {bc} is not a power of two in [16, 4096]")
    r, c = x.shape
    wbytes = _WORD_BYTES[x.dtype]
    if kernel == 2:
        if wbytes == 4:
            bc = max(16, bc // 2)  # the same bytes per tile (and registers) as a 2-byte type
        # rows past R re-read row R − 1: fewer rows per program for outputs of few rows
        bm = min(bm, max(16, 1 << max(0, r - 1).bit_length()))
    v = min(int(tile.get("v", 8)), bc)
    if v < 0 or v & (v - 1):
        raise ValueError(f"row kernel Σx² width {v} is not 0 or a power of two")
    splits = max(1, int(tile["split"]))
    rows, stats = empty_table(r, splits, x.device)
    if r == 0:
        return rows, stats
    s1, s2 = _shift_constants(c, wbytes)
    stride = x.stride(0) if r > 1 else c
    tiles = triton.cdiv(c, bc)
    keys = _key_table(kernel, x.device, c, wbytes)
    grid = (triton.cdiv(r, bm), splits)
    fold = max(1, FOLD_BYTES // (bc * wbytes))
    opts = dict(num_warps=int(tile["warps"]), num_stages=int(tile["stages"]))
    if kernel == 1:
        kernels._rows_kernel_v1[grid](
            x, x.view(torch.uint8), keys, rows, stats, r, c, stride, stride * wbytes, s1, s2,
            triton.cdiv(tiles, splits), WBYTES=wbytes, BM=bm, BC=bc, FOLD_EVERY=fold, LIMBS=9,
            NCOL=32, **opts)
    else:
        kernels._rows_kernel[grid](
            x.view(torch.uint8), keys, rows, stats, r, c, stride * wbytes, keys.shape[1], s1, s2,
            triton.cdiv(tiles, splits), WBYTES=wbytes, FLOAT=_FLOAT[x.dtype], BM=bm, BC=bc,
            FOLD_EVERY=fold, V=v, ASM=not INTERPRETED, REGS=int(tile.get("regs", 1)), **opts)
    return rows, stats


# -- combining the splits -------------------------------------------------------------------------
def combine_splits(rows: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, R, 2]``, ``[S, R, 4]`` split partials → ``[R, 2]``, ``[R, 4]``, in torch ops on any
    device (the CPU tests build tables of their own; ``gather_rows`` computes the same in one
    launch): ``T``, ``T'`` summed mod p (exact); Σx² and the counts added split after split
    (``((s0 + s1) + s2) + …`` in fp64: the same bits on every device); max and min taken split
    after split as torch's ``max``/``min`` reductions do: a NaN propagates (the first in split
    order), ties (±0) keep the earlier split's value. The row kernels' max and min never hold NaN
    (their elementwise max/min drop NaN and start from −inf/+inf: a split of only NaN, or of no
    columns, gives −inf/+inf); tables built otherwise (the CPU tests') may."""
    if rows.shape[0] == 1:
        return rows[0], stats[0]
    t = core.modsum(rows, 0)
    sq, mx, mn, bad = stats[0].unbind(-1)  # [R] each
    for x in stats[1:]:
        sq, bad = sq + x[:, 0], bad + x[:, 3]
        mx = torch.where((mx >= x[:, 1]) | mx.isnan(), mx, x[:, 1])
        mn = torch.where((mn <= x[:, 2]) | mn.isnan(), mn, x[:, 2])
    return t, torch.stack([sq, mx, mn, bad], -1)


GATHER_BLOCK = 512
"""Output rows per program of ``gather_rows`` (a segment's rows are cut into programs of at most
this many)."""


@dataclass(frozen=True)
class GatherPlan:
    """What ``gather_rows`` reads, planned once (``gather_plan``).

    Attributes:
        tables: the row tables, held so that their memory stays theirs: the plan knows them by
            address only.
        tab: ``int64 [n_tables, 4]``: each table's rows address, stats address, ``R``, ``S``.
        items: ``int64 [n_items, 4]``: one program each: table, first row, first output row,
            rows (at most ``GATHER_BLOCK``).
        total: output rows.
    """

    tables: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    tab: torch.Tensor
    items: torch.Tensor
    total: int


def gather_plan(tables: list[tuple[torch.Tensor, torch.Tensor]],
                segments: list[tuple[int, int, int]]) -> GatherPlan:
    """Plan ``gather_rows``: the tables' addresses and the programs' row segments, moved to the
    tables' device once. The tables are read at their addresses of now, at every call: they must
    be rewritten in place (a CUDA graph's replay does, ``drifttool.model.replay``), never
    reallocated.

    Args:
        tables: ``(rows int64 [S, R, 2], stats float64 [S, R, 4])`` split partials
            (``row_table``), contiguous, all on one device (CUDA, or the CPU under Triton's
            interpreter); ``S >= 1`` may differ between tables.
        segments: ``(table, first row, rows)`` in output order: rows ``[first, first + rows)``
            of ``tables[table]``.

    Returns:
        A ``GatherPlan``.

    Raises:
        ValueError: a table of other dtypes, shapes or devices, or not contiguous; a segment
            naming no table or rows outside its table.
    """
    dev = tables[0][0].device if tables else torch.device("cpu")
    tab = np.zeros((len(tables), 4), np.int64)
    for i, (rows, stats) in enumerate(tables):
        s_, r = rows.shape[:2] if rows.dim() == 3 else (0, 0)
        if (rows.dtype, stats.dtype) != (torch.int64, torch.float64) or s_ < 1 \
                or tuple(rows.shape) != (s_, r, 2) or tuple(stats.shape) != (s_, r, 4) \
                or not (rows.is_contiguous() and stats.is_contiguous()) \
                or rows.device != dev or stats.device != dev:
            raise ValueError(f"row table {i} is not a contiguous pair int64 [S, R, 2], float64 "
                             f"[S, R, 4] on {dev}: {rows.dtype} {tuple(rows.shape)}, {stats.dtype} "
                             f"{tuple(stats.shape)} on {rows.device}, {stats.device}")
        tab[i] = rows.data_ptr(), stats.data_ptr(), r, s_
    seg = np.asarray(segments, np.int64).reshape(-1, 3)
    which, first, n = seg.T
    r_of = np.append(tab[:, 2], -1)[np.where((which >= 0) & (which < len(tables)), which, -1)]
    bad = (first < 0) | (n < 0) | (first + n > r_of)  # a segment of no table: R = −1
    if bad.any():
        raise ValueError(f"segment {int(np.argmax(bad))} {tuple(seg[np.argmax(bad)])} is outside "
                         f"its table")
    chunks = -(-n // GATHER_BLOCK)  # programs per segment
    at = np.repeat(np.arange(len(seg)), chunks)  # each program's segment
    off = np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    off *= GATHER_BLOCK  # each program's first row within its segment
    dst = np.cumsum(n) - n  # each segment's first output row
    items = np.stack([which[at], first[at] + off, dst[at] + off,
                      np.minimum(GATHER_BLOCK, n[at] - off)], 1)  # [n_items, 4]
    meta = torch.from_numpy(np.concatenate([tab.reshape(-1), items.reshape(-1)]))
    if dev.type == "cuda":  # pinned, asynchronous: a pageable copy would block the host
        meta = meta.pin_memory().to(dev, non_blocking=True)
    else:
        meta = meta.to(dev)
    return GatherPlan(tuple(tables), meta[:tab.size].view(-1, 4), meta[tab.size:].view(-1, 4),
                      int(n.sum()))


def gather_rows(plan: GatherPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The planned segments' rows with their splits combined, in one Triton launch (one program
    per item, no atomics): what ``combine_splits`` of each table, its rows taken segment after
    segment, gives, bit for bit (T, T' exact mod p; Σx², counts, max and min in split order).
    Reads the tables through their addresses (``gather_plan``), so nothing is concatenated.

    Args:
        plan: ``gather_plan``'s.

    Returns:
        ``(t_rows, stats)``: ``int64 [total, 2]`` (``T``, ``T'`` in ``[0, p)``) and ``float64
        [total, 4]`` (Σx², max, min, count of NaN/±inf), on the tables' device.
    """
    dev = plan.tab.device
    t_rows = torch.empty(plan.total, 2, dtype=torch.int64, device=dev)
    stats = torch.empty(plan.total, 4, dtype=torch.float64, device=dev)
    if plan.items.shape[0]:
        kernels._gather_kernel[(plan.items.shape[0],)](plan.tab, plan.items, t_rows, stats,
                                                       BLOCK=GATHER_BLOCK, num_warps=4)
    return t_rows, stats


# -- level 2 --------------------------------------------------------------------------------------
LEVEL2_BLOCK = 256
"""Rows per step of ``level2_products``'s loop (one program per record)."""


def level2_products(t: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                    lengths: torch.Tensor) -> torch.Tensor:
    """Level 2's limb products of every record, summed over its rows, in one Triton launch (one
    program per record): ``u[3i + j, r] = Σ_k Σ_h A_h,i[k] · limb_j(T_h[start_r + k])``, ``k <
    lengths_r``: what ``digest_rows.RowTables`` otherwise forms as a ``[3, 3, rows]`` product
    and its segment sums. Exact (int64 sums below ``2**59``), so equal to that bit for bit.

    Args:
        t: ``int64 [total, 2]`` contiguous: ``T``, ``T'`` (in ``[0, p)``) of the records' rows,
            record after record.
        keys: ``int64 [2, 3, L]`` contiguous: the row keys' 21-bit limbs (``digest_rows.key_table``),
            ``L`` at least the longest record.
        start, lengths: ``int64 [n]``: each record's first row in ``t`` and its row count (at most
            ``digestcore.ROW_CHUNK``).

    Returns:
        ``int64 [9, n]`` on ``t``'s device.
    """
    n = int(start.numel())
    out = torch.empty(9, n, dtype=torch.int64, device=t.device)
    if n:
        kernels._level2_kernel[(n,)](t, keys, start, lengths, out, keys.shape[-1], n,
                                     BLOCK=LEVEL2_BLOCK, num_warps=4)
    return out
