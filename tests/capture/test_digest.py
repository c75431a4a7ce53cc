"""Digests are bitwise: dtype, shape and every byte count; rows localise; stats report NaN/Inf."""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from drifttool.capture.digest import digest, digest_tensor, row_digests, stats


def test_golden_value():
    # pins the identity definition: xxh3_64(b"<dtype>|<shape>|" + bytes)
    t = torch.tensor([1.0, -0.0], dtype=torch.float32)
    want = xxhash.xxh3_64_intdigest(b"float32|2|" + t.numpy().tobytes())
    assert digest(t) == want


def test_signed_zero_and_nan_payloads_differ():
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert math.isnan(nan1.item()) and math.isnan(nan2.item())
    assert digest(nan1) != digest(nan2)
    assert digest(nan1) == digest(nan1.clone())


def test_one_ulp_detected_in_bf16_and_fp32():
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dt)
        y = x.clone()
        y[17, 3] = torch.nextafter(y[17, 3].float(), torch.tensor(math.inf)).to(dt)
        if torch.equal(x, y):  # bf16 rounding swallowed the step: take the next bf16 value
            y[17, 3] = (y[17, 3].view(torch.int16) + 1).view(torch.bfloat16)
        assert digest(x) != digest(y)
        rows_x, rows_y = row_digests(x), row_digests(y)
        assert np.nonzero(rows_x != rows_y)[0].tolist() == [17]


def test_dtype_and_shape_are_identity():
    x = torch.arange(12, dtype=torch.float32)
    assert digest(x) != digest(x.view(torch.int32))  # same bytes, other dtype
    assert digest(x) != digest(x.reshape(3, 4))  # same bytes, other shape
    assert digest(x.reshape(3, 4)) != digest(x.reshape(4, 3))
    assert digest(x.reshape(3, 4).t()) == digest(x.reshape(3, 4).t().contiguous())


def test_row_digests_along_axis():
    x = torch.randn(2, 5, 3)
    r = row_digests(x, axis=1)
    assert r.dtype == np.uint64 and r.shape == (5,)
    for i in range(5):
        assert int(r[i]) == xxhash.xxh3_64_intdigest(x[:, i].contiguous().numpy().tobytes())
    assert row_digests(torch.zeros(0, 4)).shape == (0,)


def test_stats_report_nonfinite():
    x = torch.tensor([3.0, -4.0, float("nan"), float("inf")])
    nonfinite, l2, maxabs = stats(x)
    assert nonfinite == 2 and math.isnan(l2) and math.isnan(maxabs)
    assert stats(torch.tensor([3.0, -4.0])) == (0, 5.0, 4.0)
    assert stats(torch.tensor([1.0, float("-inf")]))[0] == 1
    assert stats(torch.tensor([3, -4], dtype=torch.int64)) == (0, 5.0, 4.0)
    assert stats(torch.tensor([0, 250], dtype=torch.uint8))[2] == 250.0
    assert stats(torch.tensor([1.5], dtype=torch.bfloat16)) == (0, 1.5, 1.5)
    assert stats(torch.zeros(0)) == (0, 0.0, 0.0)


def test_digest_tensor_record():
    x = torch.randn(4, 3)
    d = digest_tensor(x, row_axis=0)
    assert (d.dtype, d.shape, d.digest) == ("float32", (4, 3), digest(x))
    assert d.rows.tolist() == row_digests(x).tolist()
    assert digest_tensor(x).rows is None


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=4, max_size=256), st.data())
def test_any_bit_flip_changes_digest(raw, data):
    raw = raw[: len(raw) // 4 * 4]
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    flipped = bytearray(raw)
    flipped[bit // 8] ^= 1 << (bit % 8)
    a = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    b = torch.frombuffer(flipped, dtype=torch.float32)
    assert digest(a) != digest(b)
    assert digest(a) == digest(a.clone())


def test_module_docstring_example():
    d = digest_tensor(torch.tensor([[3.0, -0.0], [4.0, 0.0]]), row_axis=0)
    assert (d.dtype, d.shape, hex(d.digest)) == ("float32", (2, 2), "0x7c21b21f924b7c19")
    assert [hex(r) for r in d.rows.tolist()] == ["0xd36c0a551c02a39c", "0xea1882d8863a9f49"]
    assert (d.nonfinite, d.l2, d.maxabs) == (0, 5.0, 4.0)
