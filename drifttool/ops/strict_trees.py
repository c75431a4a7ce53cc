"""Strict reduction trees: the pairwise tree, and the segmented tree of contract v2.

Two families of fixed orders (docs/strict-arithmetic.md, "Reduction trees" and "Contract v2"):

* ``tree_sum`` / ``tree_sum_stack`` / ``TreeAccumulator``: the canonical pairwise tree (zero-pad
  to a power of two, add adjacent pairs). Used inside small fixed units (a GEMM chunk's exact
  products, a block of gradient rows, a norm's D axis) and over the samples of a batch.
* The **segmented tree** of contract v2, for every strict GEMM K axis and every per-sample row
  reduction of a gradient: the axis (or its list of 64-row blocks) is split into ``SEGMENTS`` = 8
  segments by recursive halving (``halving_spans``), each segment is cut into chunks of
  ``CHUNK`` = 64 from its start whose partials are added sequentially (``chain_sum``), and the 8
  segment partials are combined by the fixed depth-3 tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))
  (``tree_finish``), an empty segment being absent. For an axis divisible by 8 the segments are
  equal, so a TP/SP shard of T ∈ {2, 4, 8} contiguous parts owns whole subtrees
  (``shard_spans``): each rank finishes its own subtree and the owner finishes the tree over the
  T rank partials — the same additions in the same order, hence the same bytes.

All functions are pure arithmetic (no collectives); tensors are FP32/FP64 on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.shards import halving_spans  # noqa: F401  (contract v2's segments; re-exported)

SEGMENTS = 8  # segments of a contract-v2 reduction axis (three levels of halving)
SEGMENT_LEVELS = 3
CHUNK = 64  # elements of a GEMM K chunk, rows of a gradient block
SHARD_COUNTS = (1, 2, 4, 8)  # TP/SP shard counts whose shards are subtrees of the segment tree

Span = tuple[int, int]

# ----------------------------------------------------------------------------- pairwise tree


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
    (zero-padded to a power of two, adjacent pairs). The order over the samples of a batch:
    contiguous power-of-two groups of samples (aligned microbatches) form subtrees."""
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


# ----------------------------------------------------------------------------- contract v2: segments


def segment_spans(k: int) -> list[Span]:
    """The 8 segments of a GEMM reduction axis of length ``k`` (K forward, N for dX)."""
    return halving_spans(k)


def row_segment_spans(rows: int, block: int = CHUNK) -> list[Span]:
    """The 8 row segments of a per-sample gradient reduction over ``rows`` rows: the rows are cut
    into blocks of ``block`` (the last shorter), the block list is split by ``halving_spans``, and
    each segment is returned as its row span. 6889 rows → 108 blocks → segments of 14 or 13
    blocks (896 or 832 rows; the last 768 + 41)."""
    nb = -(-rows // block)
    return [(min(lo * block, rows), min(hi * block, rows)) for lo, hi in halving_spans(nb)]


def _check_shards(shards: int, rank: int) -> None:
    if shards not in SHARD_COUNTS:
        raise UnsupportedConfigError(
            f"strict contract v2: {shards} shards of a reduction axis are unsupported "
            f"(shards must be one of {SHARD_COUNTS} so that each is a subtree of the 8-segment tree)")
    if not 0 <= rank < shards:
        raise UnsupportedConfigError(f"strict contract v2: rank {rank} outside 0..{shards - 1}")


def shard_spans(spans: Sequence[Span], shards: int, rank: int) -> list[Span]:
    """The segments a rank of ``shards`` owns: the contiguous 8/shards segments
    [rank·8/shards, (rank+1)·8/shards) — a subtree of the depth-3 tree. Spans are in the
    unsharded axis' coordinates; the rank's element range is (first lo, last hi).

    Raises UnsupportedConfigError unless shards ∈ {1, 2, 4, 8} and 0 ≤ rank < shards.
    """
    _check_shards(shards, rank)
    per = len(spans) // shards
    return list(spans[rank * per : (rank + 1) * per])


def local_spans(spans: Sequence[Span]) -> list[Span]:
    """``spans`` shifted so the first starts at 0: the spans inside a rank's shard."""
    base = spans[0][0]
    return [(lo - base, hi - base) for lo, hi in spans]


def chain_sum(parts: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Sequential sum acc = p0; acc = acc + p1; …: how a fixed-tile kernel's K loop accumulates.
    None when there are no parts."""
    acc = None
    for p in parts:
        acc = p if acc is None else acc + p
    return acc


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b with None absent."""
    return a if b is None else b if a is None else a + b


def tree_finish(partials: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The fixed pairwise tree over a power-of-two list of partials (8 segment partials →
    ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))). ``None`` is an absent (empty) partial: a node with one
    absent child is the other child, with two is absent. Applied to the 8/T segment partials of a
    rank's shard it gives that rank's subtree partial; applied to the T rank partials it finishes
    the same tree (what the owner does after gathering).

    Raises ValueError unless len(partials) is a power of two.
    """
    level = list(partials)
    if not level or _next_pow2(len(level)) != len(level):
        raise ValueError(f"tree_finish: needs a power-of-two number of partials, got {len(level)}")
    while len(level) > 1:
        level = [_add(a, b) for a, b in zip(level[::2], level[1::2])]
    return level[0]


def segmented_sum(spans: Sequence[Span], chunk_partial: Callable[[int, int], torch.Tensor],
                  chunk: int = CHUNK) -> torch.Tensor | None:
    """Contract-v2 reduction over ``spans`` (a power-of-two list of contiguous segments): each
    segment's chunks [lo, lo+chunk), … (the last shorter) give ``chunk_partial(a, b)``, added by
    ``chain_sum``; the segment partials are combined by the ``tree_finish`` tree, streamed (a
    pair is added as soon as both exist: at most log2(len(spans)) + 1 partials alive, the same
    additions). None if every segment is empty."""
    if not spans or _next_pow2(len(spans)) != len(spans):
        raise ValueError(f"segmented_sum: needs a power-of-two number of segments, got {len(spans)}")
    stack: list[tuple[int, torch.Tensor | None]] = []
    for lo, hi in spans:
        node = chain_sum(chunk_partial(a, min(a + chunk, hi)) for a in range(lo, hi, chunk))
        level = 0
        while stack and stack[-1][0] == level:
            node = _add(stack.pop()[1], node)
            level += 1
        stack.append((level, node))
    return stack[0][1]
