"""The copy-free capture path (``layout.flat_parts`` + ``digest.PendingRows``) gives the records of
the canonical path (``layout.canonicalize`` + ``digest_pending``).

On a GPU the per-row table comes from the Triton kernel (``gpu_rows.row_table``, tested against
the CPU in ``tests/gpu``); here it is built from the CPU's level 1 (``digest._row_sums``), so the
layout cuts and the vectorised level 2 / summaries of ``materialize`` are tested on every machine.
"""

import math

import numpy as np
import pytest
import torch

from drifttool.capture.digest import (ReadBack, _halves, _row_sums, digest_tensor, materialize,
                                      materialize_columns, pending_rows)
from drifttool.capture.layout import canonicalize, flat_parts


def cpu_table(flat: torch.Tensor, splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows int64 [S, R, 2], stats float64 [S, R, 4])`` as ``gpu_rows.row_table`` defines
    them: the partial sums of ``splits`` column ranges (the last ones may be empty)."""
    c = flat.shape[1]
    step = -(-c // splits)
    rows, stats = [], []
    for k in range(splits):
        part = flat[:, k * step:(k + 1) * step]
        if part.shape[1] == 0:
            rows.append(torch.zeros(flat.shape[0], 2, dtype=torch.int64))
            inf = torch.full((flat.shape[0],), float("inf"), dtype=torch.float64)
            zero = torch.zeros_like(inf)
            stats.append(torch.stack([zero, -inf, inf, zero], 1))  # a split without columns
            continue
        rows.append(_row_sums(_halves(part.contiguous(), 0), k * step).t().contiguous())
        x = part.double()
        bad = (~torch.isfinite(x)).sum(1).double()
        stats.append(torch.stack([(x * x).sum(1), x.max(1).values, x.min(1).values, bad], 1))
    return torch.stack(rows), torch.stack(stats)


CASES = [
    ("BS.", "joint", (3, 5 + 6, 7), [2, 5, 0], (2, 3)),
    ("BS..", "txt", (1, 9, 2, 3), [4], None),
    ("BS.", "img", (2, 6, 5), None, (2, 3)),
    ("B.", "none", (3, 11), None, None),
    ("S.", "img", (6, 4), None, (3, 2)),
    ("..", "none", (3, 4), None, None),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("layout,stream,shape,txt_lens,grid", CASES)
def test_flat_parts_cut_the_canonical_parts(layout, stream, shape, txt_lens, grid, dtype):
    g = torch.Generator().manual_seed(hash((layout, stream)) % 2**31)
    t = torch.randn(shape, generator=g).to(dtype)
    nb = shape[0] if layout[0] == "B" else 1
    site = {"stream": stream, "samples": list(range(10, 10 + nb)), "txt_lens": txt_lens,
            "img_grid": grid}
    flat, fparts = flat_parts(site, t, layout)
    cparts = canonicalize(site, t, layout)
    assert len(fparts) == len(cparts)
    for f, c in zip(fparts, cparts):
        got = torch.cat([flat[a:z] for a, z in f.ranges]).reshape(f.shape)
        assert got.view(torch.uint8).tolist() == c.tensor.view(torch.uint8).tolist()
        assert (f.sample, f.row_axis, f.rows) == (c.sample, c.row_axis, c.rows)


def test_flat_parts_refuses_layouts_that_need_a_copy():
    t = torch.zeros(2, 3, 4)
    assert flat_parts({"stream": "img", "img_grid": (1, 3)}, t.transpose(1, 2), "B.S") is None
    assert flat_parts({"stream": "img", "img_grid": (1, 3)}, t.transpose(0, 1), "SB.") is None
    assert flat_parts({"stream": "joint", "img_grid": (1, 3)}, t, "BK.") is None
    assert flat_parts({"stream": "img", "img_grid": (1, 4)}, t[:, :, :3], "BS.") is None  # strided


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout,stream,shape,txt_lens,grid", CASES)
def test_vectorised_level2_equals_the_digest_of_each_part(layout, stream, shape, txt_lens, grid,
                                                          splits):
    g = torch.Generator().manual_seed(7)
    t = torch.randn(shape, generator=g).bfloat16()
    t.view(-1)[3] = float("nan") if layout == "BS.." else t.view(-1)[3]
    nb = shape[0] if layout[0] == "B" else 1
    site = {"stream": stream, "samples": list(range(nb)), "txt_lens": txt_lens, "img_grid": grid}
    flat, fparts = flat_parts(site, t, layout)
    table = cpu_table(flat, splits)
    pend = [pending_rows(table, t.dtype, f.shape, f.ranges, keep_rows=f.row_axis is not None)
            for f in fparts]
    # two more tables in the same batch: records from several outputs (and split counts) finish
    # together
    other = torch.randn(4, 3, generator=g)
    pend.append(pending_rows(cpu_table(other), other.dtype, (4, 3), ((0, 4),), keep_rows=True))
    pend.append(pending_rows(cpu_table(other, 2), other.dtype, (4, 3), ((0, 4),), keep_rows=True))
    got = materialize(pend)
    want = [digest_tensor(c.tensor, row_axis=c.row_axis) for c in canonicalize(site, t, layout)]
    want += [digest_tensor(other, row_axis=0)] * 2
    for g_, w in zip(got, want):
        assert (g_.dtype, g_.shape, g_.digest, g_.nonfinite) == (w.dtype, w.shape, w.digest, w.nonfinite)
        assert (g_.rows is None) == (w.rows is None)
        if w.rows is not None:
            assert g_.rows.tolist() == w.rows.tolist()
        if math.isnan(w.l2):
            assert math.isnan(g_.l2) and math.isnan(g_.maxabs)
        else:
            assert g_.maxabs == w.maxabs and g_.l2 == pytest.approx(w.l2, rel=1e-12)


def test_an_empty_text_part_has_the_digest_of_an_empty_tensor():
    t = torch.randn(2, 5, 3).bfloat16()
    site = {"stream": "txt", "samples": [0, 1], "txt_lens": [0, 4], "img_grid": None}
    flat, fparts = flat_parts(site, t, "BS.")
    got = materialize([pending_rows(cpu_table(flat), t.dtype, f.shape, f.ranges, keep_rows=True)
                       for f in fparts])
    for d, c in zip(got, canonicalize(site, t, "BS.")):
        w = digest_tensor(c.tensor, row_axis=0)
        assert (d.shape, d.digest, d.l2, d.maxabs) == (w.shape, w.digest, w.l2, w.maxabs)
        assert np.array_equal(d.rows, w.rows)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_planned_read_back_reads_tables_rewritten_in_place(splits):
    """``ReadBack`` plans once and reads what the row tables hold at each call, as after each
    replay of a CUDA graph that rewrites them: each call equals a fresh ``materialize_columns``
    of the tensors written since, and a digest read back already passes through."""
    rng = np.random.default_rng()
    site = {"stream": "joint", "samples": [0, 1, 2], "txt_lens": [2, 5, 0], "img_grid": (2, 3)}
    shape, other_shape = (3, 11, 7), (5, 4)
    tables = [cpu_table(flat_parts(site, torch.zeros(shape), "BS.")[0], splits),
              cpu_table(torch.zeros(other_shape), splits)]
    parts = flat_parts(site, torch.zeros(shape), "BS.")[1]
    pend = [pending_rows(tables[0], torch.float32, f.shape, f.ranges, keep_rows=True) for f in parts]
    pend.append(pending_rows(tables[1], torch.float32, other_shape, ((0, 5),), keep_rows=False))
    pend.append(digest_tensor(torch.ones(2, 2), row_axis=0))
    plan = ReadBack(pend)
    for _ in range(3):
        t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        u = torch.from_numpy(rng.standard_normal(other_shape).astype(np.float32))
        for (rows, stats), new in zip(tables, (cpu_table(flat_parts(site, t, "BS.")[0], splits),
                                               cpu_table(u, splits))):
            rows.copy_(new[0])
            stats.copy_(new[1])
        fresh = [pending_rows(cpu_table(flat_parts(site, t, "BS.")[0], splits), torch.float32, f.shape,
                              f.ranges, keep_rows=True) for f in parts]
        fresh += [pending_rows(cpu_table(u, splits), torch.float32, other_shape, ((0, 5),), keep_rows=False),
                  pend[-1]]
        got, want = plan().records(), materialize_columns(fresh).records()
        assert [(d.digest, d.nonfinite, d.l2, d.maxabs) for d in got] == \
            [(d.digest, d.nonfinite, d.l2, d.maxabs) for d in want]
        assert [None if d.rows is None else d.rows.tolist() for d in got] == \
            [None if d.rows is None else d.rows.tolist() for d in want]
        assert got[0].digest == digest_tensor(canonicalize(site, t, "BS.")[0].tensor, row_axis=0).digest
