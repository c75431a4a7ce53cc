"""Where the shards of a parallel layout lie — the torch-free arithmetic shared by the strict
trees, the SP rules and the diff (which imports no torch: tests/cli/test_import_cost.py).

    >>> halving_spans(108)                 # 6889 image tokens = 108 blocks of 64
    [(0, 14), (14, 27), (27, 41), (41, 54), (54, 68), (68, 81), (81, 95), (95, 108)]
    >>> sp_row_spans(6889, 2)              # each SP rank's image rows
    [(0, 3456), (3456, 6889)]
    >>> mesh_rank(2, 2, {"cfg": 1, "sp": 0, "tp": 1})
    5

Contract v2 (docs/strict-arithmetic.md) splits every reduction axis into 8 segments by recursive
halving; a layout of 2, 4 or 8 ranks gives each rank 8/ranks whole segments, a subtree of the
fixed depth-3 tree. SP shards the image rows on the 64-row blocks of the attention's 8 image
segments, so shards may be unequal (6889 tokens) or empty (fewer than 8 blocks), never padded.
The mesh is ``("cfg", "sp", "tp")``, row-major, TP innermost (``distributed.plan.MESH_DIMS``).
"""

from __future__ import annotations

from collections.abc import Mapping

from drifttool.errors import UnsupportedConfigError

SEGMENT_LEVELS = 3  # 2**3 = 8 segments
BLOCK = 64  # image rows per attention block (and rows per gradient block)
SHARD_COUNTS = (1, 2, 4, 8)  # degrees whose shards are subtrees of the 8-segment tree

Span = tuple[int, int]


def halving_spans(n: int, levels: int = SEGMENT_LEVELS) -> list[Span]:
    """The 2^levels spans of [0, n) by recursive halving: [lo, hi) splits at
    mid = lo + ceil((hi − lo)/2). Spans may be empty (n < 2^levels); they are contiguous and
    ascending. ``halving_spans(3072)`` → eight spans of 384; ``halving_spans(108)`` → spans of
    14, 13, 14, 13, 14, 13, 14, 13.

    Raises:
        ValueError: ``n`` < 0.
    """
    if n < 0:
        raise ValueError(f"halving_spans: negative length {n}")
    spans = [(0, n)]
    for _ in range(levels):
        spans = [half for lo, hi in spans
                 for mid in (lo + (hi - lo + 1) // 2,)
                 for half in ((lo, mid), (mid, hi))]
    return spans


def sp_row_spans(n_img: int, sp: int) -> list[Span]:
    """Each SP rank's image rows [lo, hi) for ``n_img`` image positions over ``sp`` ranks: rank r
    holds the 64-row blocks of image segments [r·8/sp, (r+1)·8/sp) of ``halving_spans(⌈n_img/64⌉)``.
    The spans are contiguous, in rank order and cover [0, n_img); a rank may get an empty span.

        >>> sp_row_spans(333, 4)    # 6 blocks; the ranks hold 2, 1, 2 and 1 of them
        [(0, 128), (128, 192), (192, 320), (320, 333)]

    Raises:
        UnsupportedConfigError: ``sp`` not in {1, 2, 4, 8}, or ``n_img`` not an int ≥ 0.
    """
    if sp not in SHARD_COUNTS:
        raise UnsupportedConfigError(f"SP degree must be one of {SHARD_COUNTS} (shards must be "
                                     f"subtrees of contract v2's 8-segment tree), got {sp!r}")
    if isinstance(n_img, bool) or not isinstance(n_img, int) or n_img < 0:
        raise UnsupportedConfigError(f"SP: the image length must be an int >= 0, got {n_img!r}")
    segs, per = halving_spans(-(-n_img // BLOCK)), len(halving_spans(0)) // sp
    return [(min(segs[r * per][0] * BLOCK, n_img), min(segs[(r + 1) * per - 1][1] * BLOCK, n_img))
            for r in range(sp)]


def mesh_rank(tp: int, sp: int, coords: Mapping[str, int]) -> int:
    """The global rank at ``coords`` (``{"cfg": c, "sp": s, "tp": t}``, missing = 0) of a mesh
    with TP degree ``tp`` and SP degree ``sp``: ``(c·sp + s)·tp + t``."""
    return (coords.get("cfg", 0) * sp + coords.get("sp", 0)) * tp + coords.get("tp", 0)
