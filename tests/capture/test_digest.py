"""Digest v2 is bitwise (dtype, shape and every bit count), row-resolvable, equal to its
definition (a pure-Python reference), equal in numpy (raw.py) and torch, and exact past 2**16
columns; stats report NaN/Inf."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from drifttool import digestcore as core
from drifttool.artifact.raw import RawTensor
from drifttool.capture import digest as D
from drifttool.capture.digest import (P, digest, digest_pending, digest_tensor, dtype_name,
                                      materialize, row_digests, stats)
from drifttool.errors import UnsupportedConfigError
from tests.capture.digest_reference import reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.bool,
          torch.uint8]


def random_tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bit patterns (NaNs, ±0, subnormals included); bool as 0/1 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
    if dtype == torch.bool:
        raw %= 2
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def ref(t: torch.Tensor, row_axis: int | None) -> tuple[int, list[int]]:
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return reference(data, dtype_name(t.dtype), tuple(t.shape), t.element_size(), row_axis)


def raw(t: torch.Tensor) -> RawTensor:
    """The tensor as ``drifttool.artifact.raw`` reads it (bf16 bits as uint16)."""
    a = t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return RawTensor(dtype_name(t.dtype), a)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), shapes, st.integers(0, 2**32), st.data())
def test_fast_path_equals_the_definition(dtype, shape, seed, data):
    t = random_tensor(seed, dtype, shape)
    axis = data.draw(st.sampled_from([None, *range(len(shape))]))
    d = digest_tensor(t, row_axis=axis, keep_rows=axis is not None)
    v, rows = ref(t, axis)
    assert d.digest == v and 0 <= d.digest < P
    if axis is not None:
        assert d.rows.dtype == np.uint64 and d.rows.tolist() == rows


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES + [torch.complex64, torch.int32]),
                          st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
                          st.integers(0, 2**32), st.booleans()), min_size=1, max_size=8), st.data())
def test_small_cpu_digests_read_back_together_equal_the_definition(specs, data):
    """Small CPU tensors leave their row sums to the read-back (``PendingWords``), where records
    of every dtype, width and row count are summed together: each equals the definition, and a
    write into the tensor after capture does not reach its digest."""
    ts = [random_tensor(seed, dtype, shape) for dtype, shape, seed, _ in specs]
    axes = [data.draw(st.sampled_from([None, *range(t.dim())])) for t in ts]
    keeps = [k for *_, k in specs]
    pending = [digest_pending(t, row_axis=a, keep_rows=k) for t, a, k in zip(ts, axes, keeps)]
    want = [(ref(t, a), stats(t)) for t, a in zip(ts, axes)]
    for t in ts:  # written in place after capture (the copy of its words is what counts)
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(7)
    for d, ((v, rows), (bad, l2, maxabs)), k in zip(materialize(pending), want, keeps):
        assert d.digest == v
        assert (d.rows is None) == (not k) and (d.rows is None or d.rows.tolist() == rows)
        assert d.nonfinite == bad and np.array_equal([d.l2, d.maxabs], [l2, maxabs], equal_nan=True)


def test_small_and_large_cpu_digests_in_one_read_back():
    small, large = torch.randn(3, 5), torch.randn(D._DEFER_ELEMENTS + 1)
    pending = [digest_pending(small, row_axis=0, keep_rows=True), digest_pending(large)]
    assert isinstance(pending[0], D.PendingWords) and isinstance(pending[1], D.PendingDigest)
    got = materialize(pending)
    assert got[0].digest == ref(small, 0)[0] and got[0].rows.tolist() == ref(small, 0)[1]
    assert got[1].digest == ref(large, None)[0] and got[1].rows is None


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(DTYPES + [torch.complex64, torch.int32]),
       st.lists(st.integers(0, 30), min_size=0, max_size=3).map(tuple), st.integers(0, 2**32),
       st.data())
def test_torch_ops_path_equals_numpy_path_on_cpu(dtype, shape, seed, data):
    # the torch ops (the path CUDA runs) on CPU tensors equal the numpy path CPU tensors take
    t = random_tensor(seed, dtype, shape)
    axis = data.draw(st.sampled_from([None, *range(len(shape))]))
    fast = digest_tensor(t, row_axis=axis, keep_rows=True)
    try:
        D._CPU_NUMPY = False
        ops = digest_tensor(t, row_axis=axis, keep_rows=True)
        stats_ops = stats(t)
    finally:
        D._CPU_NUMPY = True
    assert (ops.digest, ops.rows.tolist(), ops.nonfinite) == (fast.digest, fast.rows.tolist(), fast.nonfinite)
    assert stats_ops[0] == stats(t)[0]
    if t.numel() and fast.nonfinite == 0:
        assert ops.maxabs == fast.maxabs and ops.l2 == pytest.approx(fast.l2, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES + [torch.complex64, torch.int32, torch.int8]),
       st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple), st.integers(0, 2**32),
       st.data())
def test_numpy_raw_equals_torch(dtype, shape, seed, data):
    t = random_tensor(seed, dtype, shape)
    axis = data.draw(st.sampled_from([None, *range(len(shape))]))
    d = digest_tensor(t, row_axis=axis, keep_rows=True)
    assert raw(t).digest(axis) == d.digest
    v, rows = core.digest_array(raw(t).array, dtype_name(dtype), axis)
    assert (v, rows.tolist()) == (d.digest, d.rows.tolist())
    # the stored step bytes re-digest to the same value (diff's check_step_bytes)
    assert core.digest_bytes(t.numpy().tobytes() if dtype != torch.bfloat16 else
                             t.view(torch.uint16).numpy().tobytes(), dtype_name(dtype), shape,
                             axis) == d.digest


@pytest.mark.parametrize("shape,axis", [((2, 70_001), 0), ((70_003,), None)])
def test_more_than_2_16_columns_is_exact(shape, axis):
    # column blocking: 2**16 columns per FP64 product, chunks added as int64
    t = random_tensor(7, torch.float32, shape)
    d = digest_tensor(t, row_axis=axis, keep_rows=axis is not None)
    v, rows = ref(t, axis)
    assert d.digest == v and raw(t).digest(axis) == v
    if axis is not None:
        assert d.rows.tolist() == rows


def test_small_chunks_and_folding_give_the_same_value(monkeypatch):
    # every chunk size <= 2**16 and any folding cadence give the same exact value
    t = random_tensor(3, torch.float64, (5, 37))
    want = digest_tensor(t, row_axis=0)
    monkeypatch.setattr(D, "COL_CHUNK", 4)
    monkeypatch.setattr(core, "COL_CHUNK", 4)
    monkeypatch.setattr(core, "_FOLD_EVERY", 1)
    monkeypatch.setattr(D, "ROW_CHUNK", 2)
    monkeypatch.setattr(core, "ROW_CHUNK", 2)
    got = digest_tensor(t, row_axis=0)
    assert got.digest == want.digest and got.rows.tolist() == want.rows.tolist()
    monkeypatch.setattr(D, "_CPU_NUMPY", False)  # the torch ops, chunked alike
    got = digest_tensor(t, row_axis=0)
    assert got.digest == want.digest and got.rows.tolist() == want.rows.tolist()
    assert raw(t).digest(0) == want.digest


def test_signed_zero_and_nan_payloads_differ():
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert math.isnan(nan1.item()) and math.isnan(nan2.item())
    assert digest(nan1) != digest(nan2)
    assert digest(nan1) == digest(nan1.clone())
    z = torch.zeros(3, 5, dtype=torch.bfloat16)
    nz = z.clone()
    nz[1, 2] = -0.0
    assert not torch.equal(z.view(torch.int16), nz.view(torch.int16))
    assert np.nonzero(row_digests(z) != row_digests(nz))[0].tolist() == [1]


def test_one_ulp_detected_in_bf16_and_fp32():
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(dt)
        y = x.clone()
        y[17, 3] = (y[17, 3].view(torch.int16 if dt == torch.bfloat16 else torch.int32) + 1).view(dt)
        assert digest(x) != digest(y) and digest(x, 0) != digest(y, 0)
        assert np.nonzero(row_digests(x) != row_digests(y))[0].tolist() == [17]


def test_dtype_shape_transposition_and_row_order_count():
    x = torch.randn(12, generator=torch.Generator().manual_seed(1))
    assert digest(x) != digest(x.view(torch.int32))  # same bytes, other dtype
    assert digest(x) != digest(x.reshape(3, 4))  # same bytes, other shape
    assert digest(x.reshape(3, 4)) != digest(x.reshape(4, 3))
    assert digest(x.reshape(3, 4), 0) != digest(x.reshape(4, 3), 0)
    assert digest(x.reshape(3, 4), 0) != digest(x.reshape(3, 4).view(torch.int32), 0)
    assert digest(x.reshape(3, 4).t()) == digest(x.reshape(3, 4).t().contiguous())
    sq = torch.randn(5, 5, generator=torch.Generator().manual_seed(2))
    assert digest(sq, 0) != digest(sq.t().contiguous(), 0) and digest(sq) != digest(sq.t().contiguous())
    swapped = sq[[1, 0, 2, 3, 4]]
    assert digest(sq, 0) != digest(swapped, 0)
    # a row digest depends on its row's words only: swapping rows swaps their digests
    assert row_digests(swapped).tolist() == row_digests(sq)[[1, 0, 2, 3, 4]].tolist()
    # the row axis is part of the definition (module docstring)
    assert digest(sq, 0) != digest(sq) and digest(sq, 0) != digest(sq, 1)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
       st.integers(0, 2**32), st.data())
def test_any_bit_flip_changes_digest_and_its_row(dtype, shape, seed, data):
    t = random_tensor(seed, dtype, shape)
    nbits = (1 if dtype == torch.bool else t.element_size() * 8)
    i = data.draw(st.integers(0, t.numel() - 1))
    bit = data.draw(st.integers(0, nbits - 1))
    b = t.clone().reshape(-1).view(torch.uint8)
    b[i * t.element_size() + bit // 8] ^= 1 << (bit % 8)
    u = b.view(dtype).reshape(shape)
    assert digest(t) != digest(u) and digest(t, 0) != digest(u, 0)
    rows = np.nonzero(row_digests(t) != row_digests(u))[0].tolist()
    assert rows == [np.unravel_index(i, shape)[0]]
    assert digest(t) == digest(t.clone())


def test_row_digests_along_axis():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    r = row_digests(x, axis=1)
    assert r.shape == (4,) and r.dtype == np.uint64
    for i in range(4):
        assert int(r[i]) == ref(x[:, i].contiguous(), None)[1][0]
    assert row_digests(torch.zeros(0, 4)).shape == (0,)


def test_stats():
    x = torch.tensor([1.0, float("nan"), -3.0, float("inf")])
    nonfinite, l2, maxabs = stats(x)
    assert nonfinite == 2 and math.isnan(l2) and math.isnan(maxabs)
    assert stats(torch.tensor([3.0, -4.0])) == (0, 5.0, 4.0)
    assert stats(torch.tensor([1.0, float("-inf")]))[0] == 1
    assert stats(torch.tensor([3, -4], dtype=torch.int64)) == (0, 5.0, 4.0)
    assert stats(torch.tensor([0, 250], dtype=torch.uint8))[2] == 250.0
    assert stats(torch.tensor([1.5], dtype=torch.bfloat16)) == (0, 1.5, 1.5)
    assert stats(torch.tensor([True, False, True])) == (0, math.sqrt(2), 1.0)
    assert stats(torch.tensor([3 + 4j], dtype=torch.complex64)) == (0, 5.0, 5.0)
    assert stats(torch.zeros(0)) == (0, 0.0, 0.0)
    big = torch.randn(1000, 7, generator=torch.Generator().manual_seed(4))
    assert stats(big)[1] == pytest.approx(float(big.double().norm()), rel=1e-12)


def test_digest_tensor_record_and_batched_read_back():
    x = torch.randn(4, 3)
    d = digest_tensor(x, row_axis=0)
    assert (d.dtype, d.shape, d.digest) == ("float32", (4, 3), digest(x, 0))
    assert d.rows.tolist() == row_digests(x).tolist()
    assert digest_tensor(x).rows is None and digest_tensor(x, row_axis=0, keep_rows=False).rows is None
    ts = [random_tensor(s, dt, (3, 2 + s)) for s, dt in enumerate(DTYPES)]
    pending = [digest_pending(t, row_axis=0, keep_rows=s % 2 == 0) for s, t in enumerate(ts)]
    # small CPU tensors keep a copy of their words for the batched read-back; others a device vec
    assert all(isinstance(p, D.PendingWords) if t.device.type == "cpu" and t.numel() else
               p.vec.device == t.device and p.vec.dtype == torch.int64 for p, t in zip(pending, ts))
    many = materialize(pending)
    one = [digest_tensor(t, row_axis=0, keep_rows=s % 2 == 0) for s, t in enumerate(ts)]
    for a, b in zip(many, one):
        assert (a.digest, a.nonfinite, a.dtype, a.shape) == (b.digest, b.nonfinite, b.dtype, b.shape)
        assert (a.rows is None) == (b.rows is None) and (a.rows is None or a.rows.tolist() == b.rows.tolist())
    assert materialize([]) == []


def test_unsupported_dtype_fails_closed():
    with pytest.raises(UnsupportedConfigError, match="no code for dtype"):
        core.header_words("qint8", (2,))
    if hasattr(torch, "float8_e8m0fnu"):
        with pytest.raises(UnsupportedConfigError, match="float8_e8m0fnu"):
            digest(torch.zeros(2, dtype=torch.float8_e8m0fnu))
