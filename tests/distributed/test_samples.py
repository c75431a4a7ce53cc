"""``split_samples``: contiguous, deterministic, balanced to within one sample, every id once."""

from __future__ import annotations

import random

import pytest

from drifttool.distributed import rank_samples, sample_parallel_layout, split_samples
from drifttool.errors import UnsupportedConfigError


@pytest.mark.parametrize("n,world", [(1, 1), (4, 2), (5, 2), (5, 3), (7, 4), (3, 3), (17, 5)])
def test_split_is_contiguous_balanced_and_complete(n, world):
    ids = random.Random(n * 31 + world).sample(range(100), n)  # arbitrary logical ids
    split = split_samples(ids, world)
    assert len(split) == world and [i for part in split for i in part] == ids
    sizes = [len(p) for p in split]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger shares come first
    assert [rank_samples(ids, r, world) for r in range(world)] == split
    assert split_samples(ids, world) == split  # deterministic


def test_layout_names_every_rank():
    assert sample_parallel_layout([3, 1, 4, 1 + 4, 9], 2) == {
        "kind": "sample_parallel", "world_size": 2, "samples": {"0": [3, 1, 4], "1": [5, 9]}}


def test_refusals():
    with pytest.raises(UnsupportedConfigError, match="batch of 1 sample.*over 2 ranks"):
        split_samples([0], 2)
    with pytest.raises(ValueError, match="repeat"):
        split_samples([0, 0], 1)
    with pytest.raises(ValueError, match="world_size"):
        split_samples([0], 0)
    with pytest.raises(ValueError, match="ints"):
        split_samples([0.0], 1)
    with pytest.raises(ValueError, match="rank must be"):
        rank_samples([0, 1], 2, 2)
