"""Identity alignment: fast path, join path and a dict-based reference agree."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings, strategies as st

from drifttool.diff.align import align, encode_keys

KEY = ("phase", "step", "op", "sample")


def table(rows: list[tuple]) -> pa.Table:
    cols = list(zip(*rows)) if rows else [[]] * 4
    return pa.table({"phase": pa.array(cols[0], pa.utf8()), "step": pa.array(cols[1], pa.int32()),
                     "op": pa.array(cols[2], pa.utf8()), "sample": pa.array(cols[3], pa.int32())})


def reference(a: list[tuple], b: list[tuple]) -> set[tuple[int, int]]:
    """Pair the k-th occurrence of an identity in A with its k-th occurrence in B."""
    seen: dict[tuple, list[int]] = {}
    for j, r in enumerate(b):
        seen.setdefault(r, []).append(j)
    used: dict[tuple, int] = {}
    pairs = set()
    for i, r in enumerate(a):
        k = used.get(r, 0)
        if k < len(seen.get(r, [])):
            pairs.add((i, seen[r][k]))
        used[r] = k + 1
    return pairs


row = st.tuples(st.sampled_from(["rollout", "train"]), st.integers(-1, 3),
                st.sampled_from(["a", "bb", "ccc"]), st.integers(-1, 2))


@settings(max_examples=80, deadline=None)
@given(st.lists(row, max_size=40), st.data())
def test_matches_reference(a_rows, data):
    b_rows = data.draw(st.permutations(a_rows))
    b_rows = b_rows[: data.draw(st.integers(0, len(b_rows)))] + data.draw(st.lists(row,
                                                                                   max_size=5))
    al = align(table(a_rows), table(b_rows), KEY)
    assert set(zip(al.ia.tolist(), al.ib.tolist())) == reference(a_rows, b_rows)
    assert set(al.only_a.tolist()) == set(range(len(a_rows))) - set(al.ia.tolist())
    assert set(al.only_b.tolist()) == set(range(len(b_rows))) - set(al.ib.tolist())


def test_fast_path_is_positional_only_when_identities_equal():
    rows = [("rollout", s, "a", 0) for s in range(4)]
    al = align(table(rows), table(rows), KEY)
    assert al.ia.tolist() == al.ib.tolist() == [0, 1, 2, 3] and al.only_a.size == 0
    al = align(table(rows), table(rows[::-1]), KEY)
    assert sorted(zip(al.ia.tolist(), al.ib.tolist())) == [(0, 3), (1, 2), (2, 1), (3, 0)]


def test_duplicates_counted():
    rows = [("rollout", 0, "a", 0)] * 3
    al = align(table(rows), table(rows[:2] + [("train", 0, "a", 0)]), KEY)
    assert al.duplicates == 3 and al.only_a.tolist() == [2] and al.only_b.tolist() == [2]


def test_wide_keys_do_not_overflow():
    n = 1000
    big = pa.table({f"k{i}": pa.array(np.arange(n) * (i + 1) + 10**9, pa.int64())
                    for i in range(8)})
    ka, kb = encode_keys(big, big.slice(1), big.column_names)
    assert len(set(ka.tolist())) == n and np.array_equal(ka[1:], kb)
