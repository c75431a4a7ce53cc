"""``diff.arrays.arrow_array`` gives the Arrow array ``pa.array`` gives (type, values, no nulls)
for fresh random numpy arrays of awkward lengths, strided views included, without importing
``numpy.ma`` (a fresh interpreter checks)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from drifttool.diff.arrays import arrow_array

LENGTHS = (0, 1, 7, 8, 9, 63, 65, 1001)
DTYPES = (np.bool_, np.int64, np.int32, np.uint64, np.float64, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_equals_pa_array(dtype):
    rng = np.random.default_rng()
    for n in LENGTHS:
        raw = rng.integers(-2**31, 2**31, size=2 * n + 3)
        if dtype is np.bool_:
            raw = raw % 2
        elif dtype in (np.float64, np.float32):
            raw = rng.standard_normal(2 * n + 3) * 1e3
        elif dtype is np.uint64:
            raw = np.abs(raw)
        for arr in (raw[:n].astype(dtype), raw.astype(dtype)[1:2 * n + 1:2]):  # strided too
            got, want = arrow_array(arr), pa.array(arr)
            assert got.type == want.type and got.null_count == 0 and len(got) == n
            assert got.equals(want), (dtype, n)
            if dtype is not np.bool_:
                assert got.to_numpy().tobytes() == np.ascontiguousarray(arr).tobytes()


def test_refuses_what_it_cannot_wrap():
    with pytest.raises(TypeError, match="1-D"):
        arrow_array(np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="unsupported dtype"):
        arrow_array(np.zeros(3, np.float16))


def test_does_not_import_numpy_ma():
    code = ("import sys, numpy as np; from drifttool.diff.arrays import arrow_array; "
            "arrow_array(np.arange(5)); arrow_array(np.ones(9, bool)); "
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
