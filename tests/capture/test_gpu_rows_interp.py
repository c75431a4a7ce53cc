"""The Triton row kernels (``capture.gpu_rows``) in Triton's interpreter on CPU tensors: both
kernels' row digests ``T``, ``T'`` equal the CPU's level 1 bit for bit, and their row summaries
keep exact max, min and NaN/±inf counts, for every float dtype, awkward shapes, column splits and
tile settings; the finishing kernels (``gather_rows``, ``level2_products``) give their torch forms'
bytes. With a CUDA device these skip: ``tests/gpu/test_digest_cuda.py`` runs the kernels
there (the interpreter is only set up on a machine without one, ``tests/conftest.py``).
"""

import importlib.util

import numpy as np
import pytest
import torch

from drifttool import digestcore as core
from drifttool.capture import gpu_rows
from drifttool.capture.digest import _halves, _row_sums

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="a CUDA device is present (tests/gpu runs the kernels there) or Triton is missing")

# bit patterns planted among random values: ±0, NaN payloads, ±inf, subnormals, extremes
_PATTERNS = {2: [0x0000, 0x8000, 0x7FC1, 0xFF80, 0x0001, 0x7C00, 0xFE01, 0x7F7F, 0xFBFF],
             4: [0x00000000, 0x80000000, 0x7FC00001, 0xFF800000, 0x00000001, 0x7F800000,
                 0x7F7FFFFF]}


def _tensor(seed: int, dtype: torch.dtype, shape: tuple[int, int], special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 4).to(dtype)
    if special:
        size = t.element_size()
        flat = t.view(torch.int16 if size == 2 else torch.int32).numpy().reshape(-1)
        for i, v in enumerate(_PATTERNS[size]):
            flat[(i * 7919 + seed) % flat.size] = np.array(v, np.uint32).astype(flat.dtype)
    return t


def _check(t: torch.Tensor, tile: dict) -> None:
    rows, stats = gpu_rows.combine_splits(*gpu_rows.launch(t, tile))
    want = _row_sums(_halves(t, 0), 0).t()  # [R, 2]: T, T' of the CPU's level 1
    assert rows.dtype == torch.int64 and rows.tolist() == want.tolist()
    x = t.double()
    nan = torch.isnan(x)
    assert stats[:, 3].tolist() == (~torch.isfinite(x)).sum(1).double().tolist()
    assert stats[:, 1].tolist() == torch.where(nan, -torch.inf, x).amax(1).tolist()
    assert stats[:, 2].tolist() == torch.where(nan, torch.inf, x).amin(1).tolist()
    sq = (x * x).sum(1)
    fin = torch.isfinite(x).all(1)
    assert torch.allclose(stats[fin, 0], sq[fin], rtol=1e-12, atol=0)
    assert not torch.isfinite(stats[~fin, 0]).any()


KERNEL2 = dict(kernel=2, bm=16, bc=64, warps=4, stages=2, split=1, v=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,tile", [
    ((1, 300), {}),                                   # one row, a partial last tile
    ((37, 130), dict(split=3, v=0)),                  # odd width, rows past a program's end
    ((5, 64), dict(split=4)),                         # more splits than tiles: empty splits
    ((19, 515), dict(bm=32, bc=128, v=16)),
    ((4, 100), dict(bc=32, v=32)),                    # fp32: 16 columns a tile, v capped at 16
])
def test_kernel2_equals_the_cpu(dtype, shape, tile):
    _check(_tensor(shape[0] + shape[1], dtype, shape, special=True), dict(KERNEL2, **tile))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel1_equals_the_cpu(dtype):
    _check(_tensor(3, dtype, (21, 300), special=True),
           dict(kernel=1, bm=16, bc=64, warps=4, stages=2, split=2))


def test_finite_rows_count_nothing_and_rows_with_nonfinite_values_count_them():
    t = _tensor(5, torch.bfloat16, (20, 200), special=False)
    t[3, 7] = float("nan")
    t[3, 199] = float("inf")
    t[17, 0] = float("-inf")
    rows, stats = gpu_rows.combine_splits(*gpu_rows.launch(t, dict(KERNEL2, split=2)))
    assert stats[:, 3].tolist() == [2.0 if r == 3 else 1.0 if r == 17 else 0.0 for r in range(20)]
    _check(t, dict(KERNEL2, split=2))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(6889, 24), (2, 70_001)])  # many rows; > 2**16 byte columns
def test_kernel2_large_shapes(dtype, shape):
    tile = dict(KERNEL2, bm=64, bc=1024 if shape[0] < 8 else 16)
    _check(_tensor(7, dtype, shape, special=True), tile)


def test_kernel2_folds_inside_a_row():
    # 2**16 byte columns per fold: a 40,000-column fp32 row folds twice in its loop
    _check(_tensor(11, torch.float32, (2, 40_000), special=True), dict(KERNEL2, bc=2048))


def test_signed_limbs_rebuild_every_key():
    for wbytes in (2, 4):
        table = gpu_rows._signed_table(4096, wbytes).astype(object)  # [16, 4096 · W]
        weights = np.array([256 ** l for l in range(8)], dtype=object)
        for f, family in enumerate(("col", "col2")):
            e = gpu_rows._byte_keys(family, 4096, wbytes).T.reshape(-1)  # memory order
            got = (table[8 * f:8 * f + 8] * weights[:, None]).sum(0)
            assert got.tolist() == e.astype(object).tolist()
            assert int(e.max()) < core.P


def test_launch_refuses_unknown_settings():
    t = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="row kernel 3 does not exist"):
        gpu_rows.launch(t, dict(KERNEL2, kernel=3))
    with pytest.raises(ValueError, match="not a power of two"):
        gpu_rows.launch(t, dict(KERNEL2, bc=96))
    with pytest.raises(ValueError, match="Σx² width 6"):
        gpu_rows.launch(t, dict(KERNEL2, v=6))
    with pytest.raises(ValueError, match="needs a 2-D CUDA"):
        gpu_rows.row_table(t)


@pytest.mark.parametrize("seed", [0, 1])
def test_level2_products_kernel_equals_the_torch_segment_sums(seed):
    """``gpu_rows.level2_products`` (one program per record) equals ``digest_rows``' torch
    products and segment sums bit for bit: records of 0, 1, a partial block, several blocks of
    rows, T at its extremes (0, p − 1) and at random in [0, p)."""
    from drifttool.capture.digest_rows import key_consts, key_table, level2_products

    rng = np.random.default_rng(seed)
    lens = np.array([0, 1, 3, 255, 256, 257, 700, 1, 0, 1500], np.int64)
    rng.shuffle(lens)
    total = int(lens.sum())
    t = rng.integers(0, core.P, size=(total, 2), dtype=np.int64)
    t[:40] = core.P - 1
    t[40:60] = 0
    t_rows = torch.from_numpy(t)
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64))
    rec = torch.from_numpy(lens)
    local = torch.arange(total) - torch.repeat_interleave(starts, rec)
    keys = key_table("row", int(lens.max()), torch.device("cpu"))
    want = level2_products(t_rows, keys, local, starts, rec, key_consts(torch.device("cpu")))
    got = gpu_rows.level2_products(t_rows, keys.contiguous(), starts, rec)
    assert torch.equal(got, want)
    assert got[:, lens == 0].eq(0).all()


def _random_table(rng: np.random.Generator, splits: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows int64 [S, R, 2], stats float64 [S, R, 4])`` partials as ``row_table`` writes them:
    T at random in ``[0, p)`` and at ``p − 1``; Σx² at random, 0, +inf or NaN; max and min at
    random, ±0, ±inf or NaN (two payloads), with ties between splits; counts 0 to 2."""
    rows = rng.integers(0, core.P, size=(splits, r, 2), dtype=np.int64)
    rows[:, ::5] = core.P - 1  # sums that wrap past p
    stats = rng.standard_normal((splits, r, 4)) * 3
    stats[..., 0] = stats[..., 0] ** 2
    stats[..., 3] = rng.integers(0, 3, size=(splits, r))
    for cols, pick in (([0], [0.0, np.inf, np.nan]), ([1, 2], [0.0, -0.0, np.inf, -np.inf, np.nan, 1.5])):
        planted = rng.random((splits, r, len(cols))) < 0.2
        sub = stats[..., cols]
        sub[planted] = rng.choice(pick, size=int(planted.sum()))
        stats[..., cols] = sub
    stats[:, 7::11, 1] = np.array([0x7FF8000000000123], np.int64).view(np.float64)[0]  # a NaN payload
    return torch.from_numpy(rows), torch.from_numpy(stats)


def _gather_reference(tables, segments) -> tuple[torch.Tensor, torch.Tensor]:
    """``combine_splits`` of each table, then the segments' rows in order (``RowTables``' torch
    form)."""
    combined = [gpu_rows.combine_splits(*t) for t in tables]
    t = torch.cat([combined[i][0][a:a + n] for i, a, n in segments])
    s = torch.cat([combined[i][1][a:a + n] for i, a, n in segments])
    return t, s


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int64), b.view(torch.int64))


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_rows_kernel_equals_combine_splits_and_indexing(seed):
    """``gpu_rows.gather_rows`` (one launch, each table read at its address) gives the torch form's
    bytes: tables of 1 to 1,300 rows and 1, 3, 4 or 8 splits, segments of whole tables, sub-ranges,
    single rows, empty ranges and more than one program (``GATHER_BLOCK``), a total not a
    multiple of the block; and again after the tables are rewritten in place (a replay)."""
    rng = np.random.default_rng(seed)
    shapes = [(4, 1300), (1, 77), (4, 1), (3, 600), (1, 5), (8, 40)]
    tables = [_random_table(rng, s, r) for s, r in shapes]
    segments = [(0, 0, 1300), (1, 3, 50), (2, 0, 1), (0, 17, 513), (3, 0, 0), (3, 599, 1),
                (4, 0, 5), (3, 1, 598), (1, 76, 1), (5, 0, 40), (0, 1299, 1), (2, 0, 1)]
    rng.shuffle(segments)
    plan = gpu_rows.gather_plan(tables, segments)
    assert plan.total % gpu_rows.GATHER_BLOCK and plan.items.shape[0] > len(segments)
    for _ in range(2):
        got = gpu_rows.gather_rows(plan)
        want = _gather_reference(tables, segments)
        assert _same_bytes(got[0], want[0]) and _same_bytes(got[1], want[1])
        assert got[0].lt(core.P).all() and got[0].ge(0).all()
        for rows, stats in tables:  # the next replay, written where the tables are
            new = _random_table(rng, rows.shape[0], rows.shape[1])
            rows.copy_(new[0])
            stats.copy_(new[1])


def test_combine_splits_adds_in_split_order_and_keeps_the_first_nan():
    rows = torch.tensor([[[core.P - 1, 3]], [[core.P - 1, 4]], [[2, core.P - 7]]])
    stats = torch.tensor([[[1e16, -0.0, 0.0, 1.0]], [[1.0, 0.0, -0.0, 2.0]], [[1.0, -1.0, 1.0, 0.0]]],
                         dtype=torch.float64)
    t, st = gpu_rows.combine_splits(rows, stats)
    assert t.tolist() == [[(2 * (core.P - 1) + 2) % core.P, 0]]
    assert st[0, 0].item() == (1e16 + 1.0) + 1.0 != 1e16 + (1.0 + 1.0)  # left to right
    assert str(st[0, 1].item()) == "-0.0" and str(st[0, 2].item()) == "0.0"  # ties: the first
    assert st[0, 3].item() == 3.0
    nans = torch.tensor([0x7FF8000000000001, 0x7FF8000000000002]).view(torch.float64)
    stats[1:, 0, 1:3] = nans[:, None]  # NaN in splits 1 and 2: split 1's, bit for bit
    got = gpu_rows.combine_splits(rows, stats)[1][0, 1:3].view(torch.int64)
    assert got.tolist() == [0x7FF8000000000001] * 2


def test_gather_plan_refuses_tables_and_segments_it_cannot_read():
    rows, stats = torch.zeros(2, 5, 2, dtype=torch.int64), torch.zeros(2, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="segment 1 .* outside"):
        gpu_rows.gather_plan([(rows, stats)], [(0, 0, 5), (0, 3, 3)])
    with pytest.raises(ValueError, match="segment 0 .* outside"):
        gpu_rows.gather_plan([(rows, stats)], [(1, 0, 1)])
    with pytest.raises(ValueError, match="row table 0 is not"):
        gpu_rows.gather_plan([(rows.transpose(0, 1), stats)], [])
    with pytest.raises(ValueError, match="row table 0 is not"):
        gpu_rows.gather_plan([(rows, stats[:1])], [])
