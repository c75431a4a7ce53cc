"""Canonical layout: one contiguous tensor per logical sample, padding and batch position removed.

    >>> site = {"stream": "joint", "samples": [4, 7], "txt_lens": [3, 5], "img_grid": (2, 3)}
    >>> out = torch.randn(2, 5 + 6, 8)              # [B, L_pad + h*w, C], L_pad = 5
    >>> parts = canonicalize(site, out, "BS.")
    >>> [(p.sample, tuple(p.tensor.shape)) for p in parts]
    [(4, (9, 8)), (7, (11, 8))]                     # 3 + 6 and 5 + 6 valid rows
    >>> parts[0].rows.row_id(4)
    ('img', 0, 1)

Layout tags (docs/architecture.md, "Layout tags"), one character per tensor axis:

=====  =============================================================================================
``B``  batch row b -> logical sample ``site["samples"][b]`` (``None``: sample b); one part per row
``S``  sequence rows of the call's stream. img: all ``h*w + Nc`` rows; txt: the valid text rows
       ``[t0, t0 + txt_lens[b])`` with ``t0 = txt_starts[b]`` (0 when ``txt_starts`` is None:
       right padding); joint: those and ``[L_pad, L_pad + h*w + Nc)`` with
       ``L_pad = size - h*w - Nc``; stream ``none``: all rows
``K``  key axis over the joint sequence: the joint ``S`` selection, whatever the stream
``.``  any other axis, kept whole
=====  =============================================================================================

A layout without ``B`` gives one part with ``sample = -1`` and no text selection (``txt_lens`` is
per batch row). ``txt_lens=None`` means every text row is valid. ``txt_starts`` (per batch row,
or None) is where the valid prompt begins in the padded text axis: prompts padded on the left
(masked) start after their padding; the sampler derives both from the prompt mask
(``drifttool.sampling.rollout``). Canonical text row k is the prompt's k-th valid token.
Row digests (capture level L2) are taken along the first ``S`` axis; ``RowMap`` maps a row back
to ("txt", position) or
("img", i, j) with ``(i, j) = divmod(n, w)`` (design.md, "Digests": row-resolvable).

Condition images (edit pipelines, ``drifttool.model.conditions``): the site's ``cond_grids``
(the (h_k, w_k) of each condition image, or None) adds ``Nc = Σ h_k·w_k`` rows after the
``h*w`` image rows of the image and joint streams; they are kept (they are computed rows) and
named ``("cond", k, i, j)``: patch (i, j) of condition image k (1-based, as its RoPE frame
position). Where only the generated grid is known (an op record's ``img_h``/``img_w``),
``row_id`` names them ``("cond", m)``, the m-th condition row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

TAGS = frozenset("BSK.")


@dataclass(frozen=True)
class RowMap:
    """How the rows of a canonical tensor's row axis map back to tokens.

    Attributes:
        txt_len: the first ``txt_len`` rows are text positions 0..txt_len-1.
        img_grid: ``(h, w)`` patch grid of the rows after the text rows, or ``None`` when they
            are plain rows without a grid (stream ``none``, or an image stream without a grid).
        cond_grids: ``(h_k, w_k)`` of each condition image whose rows follow the grid's.
    """

    txt_len: int
    img_grid: tuple[int, int] | None
    cond_grids: tuple[tuple[int, int], ...] = ()

    def row_id(self, r: int) -> tuple:
        """Row ``r`` as ``("txt", pos)``, ``("img", i, j)``, ``("cond", k, i, j)`` or ``("row", r)``."""
        if self.img_grid is None:
            return row_id(r, self.txt_len, None)
        return row_id(r, self.txt_len, self.img_grid[1], self.img_grid[0], self.cond_grids)


def row_id(r: int, txt_len: int, img_w: int | None, img_h: int | None = None,
           cond_grids: Sequence[Sequence[int]] = ()) -> tuple:
    """Map canonical row ``r`` to ``("txt", pos)``, ``("img", i, j)``, ``("cond", k, i, j)``
    (patch (i, j) of condition image k, from 1; with ``cond_grids``), ``("cond", m)`` (the m-th
    condition row, when only ``img_h`` is known) or ``("row", r)``.

    The same rule the diff applies to the ``txt_len``/``img_h``/``img_w`` columns of an op record.
    """
    if r < txt_len:
        return ("txt", r)
    if img_w is None:
        return ("row", r)
    n = r - txt_len
    if img_h is None or n < img_h * img_w:
        i, j = divmod(n, img_w)
        return ("img", i, j)
    m = n - img_h * img_w
    for k, (h, w) in enumerate(cond_grids, start=1):
        if m < h * w:
            i, j = divmod(m, w)
            return ("cond", k, i, j)
        m -= h * w
    return ("cond", n - img_h * img_w) if not cond_grids else ("row", r)


@dataclass(frozen=True)
class Part:
    """One logical sample's canonical view of an operator output.

    Attributes:
        sample: logical sample id (``-1`` when the layout has no ``B`` axis).
        tensor: contiguous, same dtype and device as the output, batch axis removed, padding rows
            dropped. Shares storage with the output when no copy was needed.
        row_axis: axis of ``tensor`` that row digests run along (the first ``S``), or ``None``.
        rows: how that axis maps back to tokens (``None`` when ``row_axis`` is ``None``).
    """

    sample: int
    tensor: torch.Tensor
    row_axis: int | None
    rows: RowMap | None

    def without_tensor(self) -> "PartId":
        """What a capture record keeps of this part once its digest has started."""
        return PartId(self.sample, self.row_axis, self.rows)


@dataclass(frozen=True)
class PartId:
    """A ``Part`` without its tensor: sample, row axis and row map, what ``recorder.record_parts``
    returns beside each started digest. Those pairs are kept until the digests are read back (a
    CUDA graph's log of its recorded forward for the life of the graph, a chain's held records
    for the stage); with the tensors, every captured output (a view shares its storage) or its
    canonical copy would stay alive with them: at L2 of a full-size forward, more than the GPU
    holds."""

    sample: int
    row_axis: int | None
    rows: RowMap | None


def cond_grids_of(site: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """The site's ``cond_grids`` as int pairs (empty when absent or None)."""
    return tuple((int(g[0]), int(g[1])) for g in (site.get("cond_grids") or ()))


def _segments(
    tag: str, stream: str, size: int, txt_len: int | None, grid: tuple[int, int] | None,
    txt_start: int = 0, cond: tuple[tuple[int, int], ...] = (),
) -> tuple[list[tuple[int, int]], RowMap]:
    """Row ranges ``[(start, stop)]`` kept along one S/K axis of ``size`` rows, and their map
    (``cond``: the condition images' grids, whose rows follow the image rows)."""
    t0 = txt_start
    nc = sum(h * w for h, w in cond)
    if tag == "K" or stream == "joint":
        if grid is None:
            raise ValueError(f"layout tag {tag!r} on stream {stream!r} needs site['img_grid']")
        hw = grid[0] * grid[1] + nc
        pad = size - hw
        n = pad - t0 if txt_len is None else txt_len
        if pad < 0 or t0 < 0 or n < 0 or t0 + n > pad:
            raise ValueError(
                f"joint axis of {size} rows cannot hold {n} text rows from row {t0} and {hw} "
                f"image rows (img_grid={grid}, cond_grids={list(cond)})"
            )
        return [(t0, t0 + n), (pad, size)], RowMap(n, grid, cond)
    if stream == "img":
        if grid is not None and grid[0] * grid[1] + nc != size:
            raise ValueError(f"img axis has {size} rows, img_grid {grid} needs {grid[0] * grid[1]}"
                             + (f" plus {nc} condition rows (cond_grids {list(cond)})" if cond else ""))
        return [(0, size)], RowMap(0, grid, cond if grid is not None else ())
    if stream == "txt":
        n = size - t0 if txt_len is None else txt_len
        if t0 < 0 or n < 0 or t0 + n > size:
            raise ValueError(f"txt axis has {size} rows, text rows are [{t0}, {t0 + n})")
        return [(t0, t0 + n)], RowMap(n, None)
    return [(0, size)], RowMap(0, None)


def _take(t: torch.Tensor, axis: int, segs: list[tuple[int, int]]) -> torch.Tensor:
    segs = [(a, b) for a, b in segs if b > a] or [(0, 0)]
    if len(segs) == 1:
        a, b = segs[0]
        return t if (a, b) == (0, t.shape[axis]) else t.narrow(axis, a, b - a)
    import torch  # here, not at the top: row_id serves the torch-free diff

    return torch.cat([t.narrow(axis, a, b - a) for a, b in segs], dim=axis)


def canonicalize(site: dict[str, Any], tensor: torch.Tensor, layout: str) -> list[Part]:
    """Split an operator output into per-sample canonical parts.

    Args:
        site: identity of the call (``Runtime.site``); reads ``stream``, ``samples``,
            ``txt_lens``, ``txt_starts`` (optional) and ``img_grid``.
        tensor: the output, any dtype and device, ``len(layout)`` axes.
        layout: one tag per axis, from ``BSK.``, at most one ``B``.

    Returns:
        One ``Part`` per batch row (in batch order), or one part with ``sample=-1`` without ``B``.

    Raises:
        ValueError: the layout does not match the tensor, or the site's samples, text lengths or
            grid do not fit the tensor's axes (a caller bug, not a user error).
    """
    if len(layout) != tensor.dim() or not set(layout) <= TAGS or layout.count("B") > 1:
        raise ValueError(f"layout {layout!r} does not fit a {tensor.dim()}-axis tensor (tags BSK.)")
    stream = site.get("stream", "none")
    grid = site.get("img_grid")
    grid = None if grid is None else (int(grid[0]), int(grid[1]))
    cond = cond_grids_of(site)
    samples: Sequence[int] | None = site.get("samples")
    txt_lens: Sequence[int] | None = site.get("txt_lens")
    txt_starts: Sequence[int] | None = site.get("txt_starts")
    tags = layout
    if "B" in layout:
        bax = layout.index("B")
        nb = tensor.shape[bax]
        for name, seq in (("samples", samples), ("txt_lens", txt_lens), ("txt_starts", txt_starts)):
            if seq is not None and len(seq) != nb:
                raise ValueError(f"site[{name!r}] has {len(seq)} entries for batch size {nb}")
        rows = [(tensor.select(bax, b), b) for b in range(nb)]
        tags = layout[:bax] + layout[bax + 1 :]
    else:
        rows = [(tensor, None)]
    row_axis = tags.find("S")
    parts = []
    for t, b in rows:
        txt_len = None if b is None or txt_lens is None else int(txt_lens[b])
        txt_start = 0 if b is None or txt_starts is None else int(txt_starts[b])
        rowmap = None
        for axis, tag in enumerate(tags):
            if tag in "SK":
                segs, m = _segments(tag, stream, t.shape[axis], txt_len, grid, txt_start, cond)
                t = _take(t, axis, segs)
                if axis == row_axis:
                    rowmap = m
        sample = -1 if b is None else (int(samples[b]) if samples is not None else b)
        parts.append(Part(sample, t.contiguous(), row_axis if row_axis >= 0 else None, rowmap))
    return parts


@dataclass(frozen=True)
class FlatPart:
    """One logical sample's canonical part as row ranges of the output viewed as ``[rows, C]``
    (``flat_parts``): the part is the concatenation of those rows, in order.

    Attributes:
        sample, row_axis, rows: as ``Part``.
        ranges: ``[(start, stop)]`` rows of the flat view.
        shape: the canonical part's shape (what ``Part.tensor.shape`` would be).
    """

    sample: int
    ranges: tuple[tuple[int, int], ...]
    row_axis: int | None
    rows: RowMap | None
    shape: tuple[int, ...]


def table_parts(site: dict[str, Any], shape: tuple[int, ...], layout: str) -> list[FlatPart]:
    """The canonical parts of a ``[B, ., S, K]`` output (layout ``B.SK``: the attention's scores
    and probabilities) as row ranges of its row table, whose rows are ``b·S + query row`` and
    whose columns are the canonical ones (per ``.`` index, the ``K`` selection): what
    ``canonicalize`` would give, without the tensor (``shape`` alone; the kernel that computed the
    values wrote the table). Each part's shape is ``(H, S rows kept, K keys kept)``, its row axis 1.

    Raises:
        ValueError: another layout, or as ``canonicalize``."""
    if layout != "B.SK" or len(shape) != 4:
        raise ValueError(f"table_parts: layout 'B.SK' of a 4-D output, got {layout!r} {tuple(shape)}")
    nb, heads, sq, sk = (int(v) for v in shape)
    stream, samples = site.get("stream", "none"), site.get("samples")
    txt_lens, txt_starts, grid = site.get("txt_lens"), site.get("txt_starts"), site.get("img_grid")
    grid = None if grid is None else (int(grid[0]), int(grid[1]))
    cond = cond_grids_of(site)
    parts = []
    for b in range(nb):
        sample = int(samples[b]) if samples is not None else b
        txt_len = None if txt_lens is None else int(txt_lens[b])
        t0 = 0 if txt_starts is None else int(txt_starts[b])
        segs, rowmap = _segments("S", stream, sq, txt_len, grid, t0, cond)
        keys, _ = _segments("K", stream, sk, txt_len, grid, t0, cond)
        ranges = tuple((b * sq + a, b * sq + z) for a, z in segs if z > a)
        parts.append(FlatPart(sample, ranges, 1, rowmap,
                              (heads, sum(z - a for a, z in ranges), sum(z - a for a, z in keys))))
    return parts


def _tuple(v: Any) -> tuple | None:
    return None if v is None else tuple(v)


_FLAT_CACHE: dict[tuple, list[FlatPart] | None] = {}
_FLAT_CACHE_MAX = 4096


def flat_parts(site: dict[str, Any], tensor: "torch.Tensor", layout: str
               ) -> tuple["torch.Tensor", list[FlatPart]] | None:
    """``canonicalize`` without copies, when the output allows it: a contiguous tensor whose
    layout is an optional leading ``B``, an optional ``S`` right after it and ``.`` tags after
    that. Returns the flat view ``[rows, C]`` (rows = batch × sequence rows, or batch rows) and
    one ``FlatPart`` per batch row; ``None`` when the layout or memory order does not allow it
    (the caller then uses ``canonicalize``). Raises as ``canonicalize``.

    The parts depend only on the layout, the shape and the site's stream, samples, text rows
    and grid: they are cached on those (a forward repeats a few dozen of them per block)."""
    if not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    shape = tuple(tensor.shape)
    key = (layout, shape, site.get("stream", "none"), _tuple(site.get("samples")),
           _tuple(site.get("txt_lens")), _tuple(site.get("txt_starts")), _tuple(site.get("img_grid")),
           cond_grids_of(site))
    parts = _FLAT_CACHE.get(key, False)
    if parts is False:
        parts = _flat_parts(key)
        if len(_FLAT_CACHE) >= _FLAT_CACHE_MAX:
            _FLAT_CACHE.clear()
        _FLAT_CACHE[key] = parts
    if parts is None:
        return None
    rows = shape[0] * (shape[1] if layout[:2] == "BS" else 1) if layout[:1] == "B" else (
        shape[0] if layout[:1] == "S" else 1)
    return tensor.view(rows, -1), parts


def _flat_parts(key: tuple) -> list[FlatPart] | None:
    layout, shape, stream, samples, txt_lens, txt_starts, grid, cond = key
    tags = layout[1:] if layout[:1] == "B" else layout
    if (len(layout) != len(shape) or not set(layout) <= TAGS or "K" in layout
            or "B" in tags or "S" in tags[1:]):
        return None
    has_b, has_s = layout[:1] == "B", tags[:1] == "S"
    nb = shape[0] if has_b else 1
    seq = shape[1 if has_b else 0] if has_s else 1
    rest = tuple(shape[(1 if has_b else 0) + (1 if has_s else 0):])
    if has_b:
        for name, v in (("samples", samples), ("txt_lens", txt_lens), ("txt_starts", txt_starts)):
            if v is not None and len(v) != nb:
                raise ValueError(f"site[{name!r}] has {len(v)} entries for batch size {nb}")
    grid = None if grid is None else (int(grid[0]), int(grid[1]))
    parts = []
    for b in range(nb):
        sample = -1 if not has_b else (int(samples[b]) if samples is not None else b)
        if has_s:
            txt_len = None if not has_b or txt_lens is None else int(txt_lens[b])
            t0 = 0 if not has_b or txt_starts is None else int(txt_starts[b])
            segs, rowmap = _segments("S", stream, seq, txt_len, grid, t0, cond)
            ranges = tuple((b * seq + a, b * seq + z) for a, z in segs if z > a)
            n = sum(z - a for a, z in ranges)
            parts.append(FlatPart(sample, ranges, 0, rowmap, (n, *rest)))
        else:
            parts.append(FlatPart(sample, ((b, b + 1),), None, None, rest))
    return parts
