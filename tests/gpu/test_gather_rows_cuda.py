"""``digest_rows.RowTables`` on CUDA: the records' rows gathered from the Triton row tables in one
launch (``gpu_rows.gather_rows``, each table read at its address) give the torch form's bytes
(``fused=False``: concatenation, ``gpu_rows.combine_splits``, indexing) for V, the kept rows and
the stats, before and after the tables are rewritten in place (a replay), and V equals the CPU's
digest of each record's rows. Skipped without CUDA; the kernel itself is also checked in Triton's
interpreter (``tests/capture/test_gpu_rows_interp.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drifttool.capture import gpu_rows
from drifttool.capture.digest import digest_tensor
from drifttool.capture.digest_rows import RowTables, pending_rows
from drifttool.digestcore import P

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bit patterns planted among random values: NaN payloads, ±inf, ±0
_PATTERNS = {2: [0x7FC1, 0xFF80, 0x8000, 0x0000, 0x7F80, 0xFFC3],
             4: [0x7FC00001, 0xFF800000, 0x80000000, 0x00000000, 0x7F800000, 0xFFC00003]}

# (dtype, rows, columns, column splits, records' row ranges)
_TABLES = [
    (torch.bfloat16, 1, 4096, 4, [((0, 1),), ((0, 1),)]),
    (torch.float32, 77, 300, 1, [((0, 77),), ((3, 10), (40, 41), (70, 77)), ((5, 5),)]),
    (torch.bfloat16, 4096 + 3, 96, 4, [((0, 4099),), ((4098, 4099), (0, 1)), ((1000, 3100),)]),
    (torch.float32, 6032, 64, 3, [((0, 6032),), ((17, 530), (600, 601))]),
    (torch.bfloat16, 6032, 200, 1, [((0, 2), (6000, 6032), (100, 700))]),
]


def _values(seed: int, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """Random values with NaN payloads, ±inf and ±0 planted by bit pattern (CPU)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, cols, generator=g) * 4).to(dtype)
    size = t.element_size()
    flat = t.view(torch.int16 if size == 2 else torch.int32).reshape(-1)
    at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), generator=g)
    pats = np.array(_PATTERNS[size], np.uint32).astype(np.int16 if size == 2 else np.int32)
    flat[at] = torch.from_numpy(pats)[torch.arange(at.numel()) % len(pats)]
    return t


def _bits(a: np.ndarray) -> list[int]:
    return np.ascontiguousarray(a).view(np.int64).reshape(-1).tolist()


def test_gathered_rows_equal_the_torch_form_before_and_after_a_rewrite():
    xs, tables, pending, parts = [], [], [], []
    for i, (dtype, rows, cols, splits, records) in enumerate(_TABLES):
        x = _values(i, dtype, rows, cols).cuda()
        table = gpu_rows.launch(x, dict(gpu_rows.TILE, split=splits))
        xs.append(x)
        tables.append((table, splits))
        for ranges in records:
            n = sum(z - a for a, z in ranges)
            pending.append(pending_rows(table, dtype, (n, cols), ranges, keep_rows=True))
            parts.append((i, ranges))
    fused, ref = RowTables(pending), RowTables(pending, fused=False)
    assert fused._plan is not None and ref._plan is None
    for replay in range(3):
        v, rows, st = fused()
        v_ref, rows_ref, st_ref = ref()
        assert _bits(v) == _bits(v_ref)
        assert _bits(st) == _bits(st_ref)
        assert [r.tolist() for r in rows] == [r.tolist() for r in rows_ref]
        for k, (i, ranges) in enumerate(parts):  # V and the rows are the CPU digest's
            part = torch.cat([xs[i][a:z] for a, z in ranges]).cpu()
            want = digest_tensor(part, row_axis=0, keep_rows=True)
            assert (int(v[k]) + pending[k].header) % P == want.digest
            assert rows[k].tolist() == want.rows.tolist()
        for i, (x, ((t_rows, t_stats), splits)) in enumerate(zip(xs, tables)):  # the next replay
            x.copy_(_values(100 * (replay + 1) + i, x.dtype, *x.shape).cuda())
            new_rows, new_stats = gpu_rows.launch(x, dict(gpu_rows.TILE, split=splits))
            t_rows.copy_(new_rows)
            t_stats.copy_(new_stats)
