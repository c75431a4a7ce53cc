"""Strict GEMMs (contract v2): row-invariant ``x @ wᵀ + b`` from fixed-shape tiles and a fixed K order.

    >>> from drifttool.ops.strict_gemm import tiled_linear
    >>> y = tiled_linear(x, w, b)   # x [..., K], w [N, K], b [N] FP32 → [..., N] FP32

Why (measured on the 2-core CI CPU, see docs/strict-arithmetic.md): ``F.linear`` /
``torch.matmul`` are not row-invariant: a row's bytes at M=1 differ from M≥2, and with varying N.
A batched matmul whose every member has one fixed shape (16 rows × K-chunk) *was* invariant at
every M and position tried. So every GEMM here is computed tile by tile in fixed shapes, and K is
reduced in the segmented order of contract v2 (8 segments by recursive halving, 64-chunks added
sequentially within a segment, a depth-3 tree over the segments; ``drifttool.ops.strict_trees``),
whose subtrees are the TP 2/4/8 shards of every Qwen-Image width. Small weights take exact
products instead (portable bytes); ``linear_partial`` / ``finish_linear`` are the row-parallel
TP split of the same order, ``column_shard_spans`` the column-parallel one.

All functions take and return FP32. Nothing here reads global state; no TF32 (checked by
``drifttool.runtime.check_strict_environment``).
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict_trees import segment_spans, segmented_sum, tree_finish, tree_sum

ROW_TILE = 16  # GEMM rows per tile
N_TILE = 128  # GEMM output columns per tiled matmul member ([16, c] @ [c, 128])
KEY_TILE = 64  # attention keys per tile (QK columns, AV reduction chunk)


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
