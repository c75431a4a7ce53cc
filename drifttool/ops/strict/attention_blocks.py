"""Strict attention contract v2: fixed key blocks in global key order and the fixed merge of
their partial states (docs/strict-arithmetic.md, "Attention (contract v2)").

These are the pieces the unfused operators, the fused operator, Ring attention (a rank holds
some image key segments) and SP (a rank holds some image query segments) share, so that each of
them computes the same bytes.

Joint sequence [text (padded length L = ``text_len``), image (N)], diffusers' order. Blocks of
``BLOCK`` = 64 positions: text blocks from text position 0, image blocks from image position 0
(so the prompt's length and padding never move an image key between blocks). The *blocked
layout* pads the text part and the image part each to a multiple of 64 with absent slots, so that
every block is one contiguous run of 64 slots: text blocks 0..Tb−1, then image blocks
Tb..Tb+Ib−1. Absent slots and masked keys contribute +0.

Merge structure over the blocks of one axis (keys; for dK/dV the queries):

* a block whose positions are all masked (or absent) is skipped — not merged;
* text blocks merged sequentially in order → text state;
* image blocks split into 8 segments by recursive halving (``image_segments``: 3 levels, split
  at mid = lo + ⌈n/2⌉; empty segments absent); blocks within a segment merged sequentially;
  segments merged by the depth-3 tree ((g0⊕g1)⊕(g2⊕g3))⊕((g4⊕g5)⊕(g6⊕g7)) → image state;
* result = text state ⊕ image state.

⊕ is ``softmax_combine`` for softmax states (m, l) and ``add_combine`` (plain FP32 +) for
value / gradient partials.

The kernels that compute the per-block partials (``rowdot``, ``block_weighted``) are in
``drifttool.ops.strict.attention_kernels``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drifttool.ops.strict_gemm import KEY_TILE
from drifttool.ops.strict_math import exp32, tree_sum

BLOCK = KEY_TILE  # positions per key (query) block
SEGMENT_LEVELS = 3  # image blocks form 2**3 = 8 segments
SEGMENTS = 1 << SEGMENT_LEVELS


# ----------------------------------------------------------------------------- layout


def image_segments(n_blocks: int, levels: int = SEGMENT_LEVELS) -> tuple[tuple[int, int], ...]:
    """The 2**levels image segments [lo, hi) of block indices 0..n_blocks−1, by recursive
    halving: a range [lo, hi) of n blocks splits at mid = lo + ⌈n/2⌉. Empty segments (lo == hi)
    are kept in the tuple (they are absent in the merge).

        >>> image_segments(108)   # 6889 image tokens
        ((0, 14), (14, 27), (27, 41), (41, 54), (54, 68), (68, 81), (81, 95), (95, 108))
    """

    def split(lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        if depth == 0:
            return [(lo, hi)]
        mid = lo + -(-(hi - lo) // 2)
        return split(lo, mid, depth - 1) + split(mid, hi, depth - 1)

    return tuple(split(0, n_blocks, levels))


@dataclass(frozen=True)
class JointLayout:
    """Where each position of a joint sequence of ``length`` positions, the first ``text_len``
    of them text, sits in the blocked layout (see the module docstring).

    Attributes:
        length: S = L + N.  text_len: L (the padded text length; 0: every position is image).
    """

    length: int
    text_len: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.text_len <= self.length:
            raise ValueError(f"JointLayout: text_len {self.text_len} outside [0, {self.length}]")

    @property
    def n_image(self) -> int:
        return self.length - self.text_len

    @property
    def text_blocks(self) -> int:
        """Tb = ⌈L / 64⌉."""
        return -(-self.text_len // BLOCK)

    @property
    def image_blocks(self) -> int:
        """Ib = ⌈N / 64⌉ (6889 image tokens: 108)."""
        return -(-self.n_image // BLOCK)

    @property
    def n_blocks(self) -> int:
        return self.text_blocks + self.image_blocks

    @property
    def padded(self) -> int:
        """Length of the blocked layout, 64·(Tb + Ib)."""
        return BLOCK * self.n_blocks

    def segments(self) -> tuple[tuple[int, int], ...]:
        """The 8 image segments as [lo, hi) ranges of *global* block indices (Tb added)."""
        tb = self.text_blocks
        return tuple((tb + lo, tb + hi) for lo, hi in image_segments(self.image_blocks))

    def index(self, device=None) -> torch.Tensor:
        """Blocked position of each sequence position: int64 [S]."""
        pos = torch.arange(self.length, device=device)
        return torch.where(pos < self.text_len, pos, pos - self.text_len + BLOCK * self.text_blocks)

    def to_blocked(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Axis ``dim`` (length S) of ``x`` → the blocked layout (length 64·nb), absent slots +0."""
        dim = dim % x.dim()
        shape = list(x.shape)
        shape[dim] = self.padded
        return x.new_zeros(shape).index_copy_(dim, self.index(x.device), x)

    def from_blocked(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of ``to_blocked``: axis ``dim`` (length 64·nb) → sequence order (length S)."""
        return x.index_select(dim, self.index(x.device))

    def valid(self, key_mask: torch.Tensor | None, batch: int, device=None) -> torch.Tensor:
        """Validity of the blocked slots: bool [B, 64·nb]; absent slots False; ``None`` mask:
        every sequence position valid."""
        if key_mask is None:
            key_mask = torch.ones(batch, self.length, dtype=torch.bool, device=device)
        return self.to_blocked(key_mask.bool(), 1)

    def present(self, valid: torch.Tensor) -> torch.Tensor:
        """Which blocks hold at least one valid position: bool [B, nb] from ``valid`` [B, 64·nb]."""
        return valid.view(valid.shape[0], self.n_blocks, BLOCK).any(-1)


# ----------------------------------------------------------------------------- merge


@dataclass(frozen=True)
class Partial:
    """A partial state of one block (or a merged range of blocks): ``values`` (tensors of one
    shape) and ``present`` (bool, broadcastable against the values: per sample, whether any
    valid position went into it). Where ``present`` is False the values are ignored."""

    values: tuple[torch.Tensor, ...]
    present: torch.Tensor


Combine = Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


def softmax_combine(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(m1, l1) ⊕ (m2, l2), the first the earlier: m = max(m1, m2);
    l = fp32(l1 · e1) + fp32(l2 · e2) with e_i = fp32(exp64(fp32(m_i − m))); every operation one
    correctly rounded FP32 operation (FP64 inside ``exp64``). FP32 [...] each."""
    (m1, l1), (m2, l2) = a, b
    m = torch.maximum(m1, m2)
    return m, l1 * exp32(m1 - m) + l2 * exp32(m2 - m)


def add_combine(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Plain FP32 addition, earlier + later (value and gradient partials)."""
    return tuple(x + y for x, y in zip(a, b))


def merge(a: Partial | None, b: Partial | None, combine: Combine) -> Partial | None:
    """a ⊕ b where both are present; the present one where only one is (a skipped block is not
    merged); ``None`` stands for an empty range."""
    if a is None:
        return b
    if b is None:
        return a
    both = a.present & b.present
    c = combine(a.values, b.values)
    vals = tuple(torch.where(both, cv, torch.where(a.present, av, bv)) for cv, av, bv in zip(c, a.values, b.values))
    return Partial(vals, a.present | b.present)


def merge_sequential(parts: Sequence[Partial | None], combine: Combine) -> Partial | None:
    """((p0 ⊕ p1) ⊕ p2) ⊕ … in order (text blocks; the blocks of one image segment)."""
    acc = None
    for p in parts:
        acc = merge(acc, p, combine)
    return acc


def merge_tree(parts: Sequence[Partial | None], combine: Combine) -> Partial | None:
    """The balanced tree over a power-of-two list: tree(first half) ⊕ tree(second half). Over the
    8 image segments this is ((g0⊕g1)⊕(g2⊕g3))⊕((g4⊕g5)⊕(g6⊕g7)); a rank holding an aligned
    power-of-two group of segments computes that group's subtree, and ``merge_tree`` of the
    ranks' subtrees (in rank order) finishes the same tree."""
    n = len(parts)
    if n == 0 or n & (n - 1):
        raise ValueError(f"merge_tree needs a power-of-two number of parts, got {n}")
    if n == 1:
        return parts[0]
    return merge(merge_tree(parts[: n // 2], combine), merge_tree(parts[n // 2 :], combine), combine)


def merge_segments(layout: JointLayout, blocks: Sequence[Partial | None], combine: Combine) -> list[Partial | None]:
    """The 8 image segment states, each its blocks merged sequentially (``blocks`` indexed by
    global block index; an empty segment is ``None``)."""
    return [merge_sequential(blocks[lo:hi], combine) for lo, hi in layout.segments()]


def merge_blocks(layout: JointLayout, blocks: Sequence[Partial | None], combine: Combine) -> Partial | None:
    """The whole fixed order over one axis: text blocks sequentially, image segments
    sequentially inside and by the depth-3 tree across, then text ⊕ image.

    Args:
        blocks: one partial per global block index 0..nb−1 (``None`` or not present: skipped).
    """
    text = merge_sequential(blocks[: layout.text_blocks], combine)
    image = merge_tree(merge_segments(layout, blocks, combine), combine)
    return merge(text, image, combine)


def rank_segments(layout: JointLayout, ranks: int) -> list[tuple[tuple[int, int], ...]]:
    """The image segments (global block ranges) each of ``ranks`` ∈ {1, 2, 4, 8} SP/Ring ranks
    holds: rank r holds segments [r·8/ranks, (r+1)·8/ranks) — an aligned subtree of the
    segment tree. Text blocks are replicated on every rank.

    Raises:
        ValueError: ``ranks`` does not divide 8 into a power-of-two group.
    """
    if ranks not in (1, 2, 4, 8):
        raise ValueError(f"rank_segments: ranks must be 1, 2, 4 or 8, got {ranks}")
    segs, per = layout.segments(), SEGMENTS // ranks
    return [segs[r * per : (r + 1) * per] for r in range(ranks)]


def rank_subtree(segments: Sequence[tuple[int, int]], blocks: Callable[[list[int]], Sequence[Partial | None]],
                 combine: Combine) -> Partial | None:
    """What one rank contributes: for each of its segments the partials of its blocks
    (``blocks(list of global block indices)``, in order) merged sequentially, then the tree over
    its segments."""
    return merge_tree([merge_sequential(blocks(list(range(lo, hi))), combine) if hi > lo else None
                       for lo, hi in segments], combine)


def finish_ranks(text: Partial | None, subtrees: Sequence[Partial | None], combine: Combine) -> Partial | None:
    """The fixed finishing order from the text state and the ranks' subtrees (rank order):
    text ⊕ merge_tree(subtrees) — the same bytes as ``merge_blocks`` on the whole axis."""
    return merge(text, merge_tree(subtrees, combine), combine)


def block_partials(values: Sequence[torch.Tensor], present: torch.Tensor, dim: int = 0) -> list[Partial]:
    """Split per-block tensors into ``Partial`` s: ``values`` carry the block axis at ``dim``,
    ``present`` [B, nb] is reshaped to broadcast against one block's values (leading batch axis)."""
    nb = values[0].shape[dim]
    ndim = values[0].dim() - 1
    res = []
    for j in range(nb):
        vals = tuple(v.select(dim, j) for v in values)
        res.append(Partial(vals, present[:, j].view(-1, *([1] * (ndim - 1)))))
    return res


# ----------------------------------------------------------------------------- softmax


def softmax_block_states(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block softmax states of FP32 scores in the blocked key layout.

    m_b = exact max of the block's valid scores; l_b = ``tree_sum`` over the block's 64 slots of
    fp32(exp64(fp32(s − m_b))), masked and absent slots +0.

    Args:
        x: [..., nb, 64] FP32.  valid: bool broadcastable to x.
    Returns:
        (m_b, l_b), FP32 [..., nb]; a block without a valid slot has m_b = −inf, l_b = +0 (and
        must be skipped by the merge: ``present`` false).
    """
    xm = torch.where(valid, x, -math.inf)
    m = torch.amax(xm, dim=-1)
    ms = torch.where(torch.isinf(m) & (m < 0), torch.zeros(()), m)  # empty blocks: no −inf − −inf
    e = torch.where(valid, exp32(xm - ms.unsqueeze(-1)), torch.zeros(()))
    return m, tree_sum(e, dim=-1)


def softmax_probs(x: torch.Tensor, valid: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """P = fp32(exp64(fp32(s − m))) / l (one FP32 division) at valid slots, +0 elsewhere.

    Args:
        x: [..., nb, 64] FP32 scores.  valid: broadcastable bool.  m, l: [...] the merged state.
    """
    mm, ll = m[..., None, None], l[..., None, None]
    return torch.where(valid, exp32(x - mm) / ll, torch.zeros(()))


def softmax_state(layout: JointLayout, x: torch.Tensor, valid: torch.Tensor, present: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The merged (m, l) of every row: block states merged in the fixed order.

    Args:
        x: [B, H, M, nb, 64] FP32.  valid: [B, 1, 1, nb, 64].  present: [B, nb].
    Returns:
        (m, l) FP32 [B, H, M].
    """
    m_b, l_b = softmax_block_states(x, valid)
    st = merge_blocks(layout, block_partials((m_b, l_b), present, dim=-1), softmax_combine)
    return st.values


def row_sums(layout: JointLayout, t: torch.Tensor, valid: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Σ over the key axis of ``t`` by the block structure: per block ``tree_sum`` over its 64
    slots (invalid +0), blocks merged in the fixed order by plain FP32 adds.

    Args:
        t: [B, H, M, nb, 64] FP32.  valid: [B, 1, 1, nb, 64].  present: [B, nb].
    Returns:
        [B, H, M] FP32.
    """
    s_b = tree_sum(torch.where(valid, t, torch.zeros(())), dim=-1)  # [B, H, M, nb]
    (r,) = merge_blocks(layout, block_partials((s_b,), present, dim=-1), add_combine).values
    return r
