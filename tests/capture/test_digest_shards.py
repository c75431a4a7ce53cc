"""Digest v2 is shard-combinable: ranks holding row shards (SP) and/or contiguous column shards
(TP heads or channels) of a canonical tensor each compute a partial from their own bytes and the
global indices, and ``combine`` gives exactly the unsharded digest and row digests."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from drifttool import digestcore as core
from drifttool.capture.digest import combine, digest_tensor, dtype_name, partial
from tests.capture.test_digest import DTYPES, random_tensor


def cuts(draw, n: int) -> list[int]:
    """Sorted split points ``0 = c0 <= … <= ck = n`` (empty shards allowed)."""
    inner = draw(st.lists(st.integers(0, n), max_size=4))
    return [0, *sorted(inner), n]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 9), st.lists(st.integers(1, 6), min_size=0, max_size=2),
       st.integers(0, 2**32), st.data())
def test_row_and_column_shards_combine_exactly(dtype, rows, rest, seed, data):
    shape = (rows, *rest)
    t = random_tensor(seed, dtype, shape)
    cols = math.prod(rest)
    flat = t.reshape(rows, cols)  # [R, C]: a TP shard is a contiguous range of C
    rcut, ccut = cuts(data.draw, rows), cuts(data.draw, cols)
    parts = [partial(flat[r0:r1, c0:c1], row_axis=0, row_offset=r0, col_offset=c0, total_shape=shape)
             for r0, r1 in zip(rcut, rcut[1:]) for c0, c1 in zip(ccut, ccut[1:])]
    v, row_t = combine(parts, dtype_name(dtype), shape, row_axis=0)
    whole = digest_tensor(t, row_axis=0)
    assert v == whole.digest and row_t.tolist() == whole.rows.tolist()
    # numpy partials (raw.py's arithmetic) are the same numbers
    for p, (r0, r1, c0, c1) in zip(parts, [(a, b, c, d) for a, b in zip(rcut, rcut[1:])
                                          for c, d in zip(ccut, ccut[1:])]):
        sh = flat[r0:r1, c0:c1]
        arr = sh.view(torch.uint16).numpy() if dtype == torch.bfloat16 else sh.numpy()
        nrows, nv = core.partial_np(arr, dtype_name(dtype), row_axis=0, row_offset=r0, col_offset=c0)
        assert nrows.tolist() == p.rows.tolist() and nv == int(p.v)


def test_tp_heads_and_sp_rows_of_6889_image_tokens():
    # [S, H, D] attention output: SP over 4 ranks (6889 is not divisible by 4), TP over 3 head
    # groups: every rank digests its [S/4, H/3, D] block with global row and column offsets
    S, H, Dh = 6889, 6, 8
    t = random_tensor(11, torch.bfloat16, (S, H, Dh))
    bounds = [0, 1723, 3445, 5167, S]
    parts = [partial(t[r0:r1, h0:h0 + 2], row_axis=0, row_offset=r0, col_offset=h0 * Dh,
                     total_shape=(S, H, Dh))
             for r0, r1 in zip(bounds, bounds[1:]) for h0 in (0, 2, 4)]
    v, rows = combine(parts, "bfloat16", (S, H, Dh), row_axis=0)
    whole = digest_tensor(t, row_axis=0)
    assert v == whole.digest and np.array_equal(rows, whole.rows)
    # a missing or doubled shard is not the tensor
    assert combine(parts[1:], "bfloat16", (S, H, Dh), row_axis=0)[0] != v
    assert combine(parts + parts[:1], "bfloat16", (S, H, Dh), row_axis=0)[0] != v


def test_shards_of_a_row_axis_that_is_not_first_and_of_one_row():
    t = random_tensor(5, torch.float32, (3, 10, 4))  # rows along axis 1
    parts = [partial(t[:, 0:6], row_axis=1, row_offset=0), partial(t[:, 6:], row_axis=1, row_offset=6)]
    v, rows = combine(parts, "float32", (3, 10, 4), row_axis=1)
    whole = digest_tensor(t, row_axis=1)
    assert v == whole.digest and rows.tolist() == whole.rows.tolist()
    flat = t.reshape(-1)  # no row axis: one row, TP over its elements
    parts = [partial(flat[:50], col_offset=0), partial(flat[50:], col_offset=50)]
    assert combine(parts, "float32", (120,))[0] == digest_tensor(flat).digest


def test_a_shard_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        partial(torch.zeros(2, 3), row_axis=0, row_offset=3, total_shape=(4, 3))
    with pytest.raises(ValueError, match="does not fit"):
        partial(torch.zeros(2, 3), row_axis=0, col_offset=1, total_shape=(4, 3))
