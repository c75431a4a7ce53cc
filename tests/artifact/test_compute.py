"""``drifttool.artifact.compute`` gives what pyarrow's own methods and ``pyarrow.compute`` give
(they are the same Arrow kernels), on random tables with nulls, and imports no
``pyarrow.compute``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from drifttool.artifact import compute as ac


@pytest.fixture
def table():
    rng = np.random.default_rng()
    n = int(rng.integers(5, 60))
    words = ["output", "internal", "grad", None]
    return pa.table({
        "role": pa.chunked_array([[words[i] for i in rng.integers(0, 4, n // 2)],
                                  [words[i] for i in rng.integers(0, 4, n - n // 2)]], pa.string()),
        "step": pa.array(rng.integers(-1, 4, n), pa.int32()),
        "x": pa.array(rng.standard_normal(n)),
        "lst": pa.array([None if k % 5 == 0 else list(range(k % 3)) for k in range(n)],
                        pa.list_(pa.int32())),
    })


def test_methods_match_pyarrow(table):
    rng = np.random.default_rng()
    mask = pa.array(rng.random(table.num_rows) < 0.5)
    idx = pa.array(rng.integers(0, table.num_rows, 7))
    assert ac.filter(table, mask).equals(table.filter(mask))
    assert ac.take(table, idx).equals(table.take(idx))
    assert ac.take(table["role"], idx).equals(table["role"].take(idx))
    assert ac.unique(table["role"]).equals(table["role"].unique())
    role = table["role"].combine_chunks()
    assert ac.dictionary_encode(role).equals(role.dictionary_encode())
    assert ac.is_null(table["lst"]).equals(table["lst"].is_null())
    assert ac.cast(table["step"], pa.utf8()).equals(table["step"].cast(pa.utf8()))
    with pytest.raises(pa.ArrowInvalid):
        ac.cast(pa.array([300]), pa.int8())  # the safe cast


def test_functions_match_pyarrow_compute(table):
    assert ac.is_in(table["role"], ["output", "internal"]).equals(
        pc.is_in(table["role"], pa.array(["output", "internal"])))
    assert ac.call("greater_equal", table["step"], 0).equals(pc.greater_equal(table["step"], 0))
    assert ac.call("min", table["step"]).equals(pc.min(table["step"]))
    assert ac.call("sum", table["x"]).equals(pc.sum(table["x"]))
    lens = ac.call("list_value_length", table["lst"])
    assert ac.call("coalesce", lens, pa.scalar(0, lens.type)).equals(pc.fill_null(lens, 0))
    joined = ac.call("binary_join_element_wise", table["role"], ac.cast(table["step"], pa.utf8()), "#")
    assert joined.equals(pc.binary_join_element_wise(table["role"], pc.cast(table["step"], pa.utf8()), "#"))


def test_does_not_import_pyarrow_compute():
    code = ("import sys, pyarrow as pa; from drifttool.artifact import compute as ac; "
            "t = pa.table({'a': [1, 2, 3]}); ac.filter(t, ac.call('greater', t['a'], 1)); "
            "ac.unique(t['a']); ac.is_in(t['a'], [2]); ac.cast(t['a'], pa.utf8()); "
            "sys.exit(int('pyarrow.compute' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
