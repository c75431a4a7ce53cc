"""Split a batch's logical sample ids across ranks (sample-parallel rollout: each rank runs its
own samples end to end, the layout RL rollouts use).

    >>> split_samples([0, 1, 2, 3, 4], 2)
    [[0, 1, 2], [3, 4]]
    >>> sample_parallel_layout(range(4), 2)
    {'kind': 'sample_parallel', 'world_size': 2, 'samples': {'0': [0, 1], '1': [2, 3]}}

The split is contiguous and deterministic: the ids keep their batch order, and with ``n`` ids
over ``w`` ranks the first ``n % w`` ranks take ``n // w + 1`` ids and the others ``n // w``
(the rule of ``torch.tensor_split`` and ``numpy.array_split``). It depends on nothing but ``n``
and ``w``, so every rank computes the same split without communicating. Strict operators are
batch-invariant, so the bytes of a sample do not depend on which rank runs it or with which
other samples; the split only decides where its records are written (the owning rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from drifttool.errors import UnsupportedConfigError


def split_samples(samples: Iterable[int], world_size: int) -> list[list[int]]:
    """The logical sample ids of each rank: ``out[r]`` for rank ``r``, contiguous, in batch order.

    Args:
        samples: the batch's logical sample ids (distinct ints), in batch order.
        world_size: number of ranks (>= 1).

    Raises:
        ValueError: ``world_size`` < 1, an id that is not an int, or repeated ids.
        UnsupportedConfigError: fewer samples than ranks (a rank would run nothing).
    """
    ids = list(samples)
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if any(type(i) is not int for i in ids):
        raise ValueError(f"sample ids must be ints, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"sample ids repeat: {ids!r}")
    if len(ids) < world_size:
        raise UnsupportedConfigError(
            f"sample-parallel layout: batch of {len(ids)} sample(s) over {world_size} ranks "
            "leaves a rank without samples; use a batch of at least world_size samples")
    base, extra = divmod(len(ids), world_size)
    out, start = [], 0
    for r in range(world_size):
        stop = start + base + (r < extra)
        out.append(ids[start:stop])
        start = stop
    return out


def rank_samples(samples: Iterable[int], rank: int, world_size: int) -> list[int]:
    """The logical sample ids rank ``rank`` runs (``split_samples(samples, world_size)[rank]``).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, or as ``split_samples``.
        UnsupportedConfigError: as ``split_samples``.
    """
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return split_samples(samples, world_size)[rank]


def sample_parallel_layout(samples: Iterable[int], world_size: int) -> dict[str, Any]:
    """The manifest ``layout`` of a sample-parallel run (``manifest_schema._LAYOUT``): kind, world size and
    each rank's sample ids, keyed by the rank as a string (JSON object keys).

    Raises:
        ValueError, UnsupportedConfigError: as ``split_samples``.
    """
    split = split_samples(samples, world_size)
    return {"kind": "sample_parallel", "world_size": world_size,
            "samples": {str(r): ids for r, ids in enumerate(split)}}
