"""The collectives the artifact writer and the runner need: a barrier and the gather/broadcast
of small picklable objects (file lists, statuses, digests), over torch.distributed. A leaf
module (it imports no other drifttool module), so the artifact writer below ``distributed/``
can use it.

    >>> all_gather_object({"rank": 0, "ok": True})   # world 1, no process group: no-op
    [{'rank': 0, 'ok': True}]

Each function takes an optional ``group`` (``None``: the default group) and is a no-op that
behaves as rank 0 of a world of one when no process group is initialised, so the same code
serves one process and ``torchrun``. Object collectives pickle their argument (torch's
``all_gather_object``); use them for metadata only, never tensors of the run. On NCCL they
run on the current CUDA device (``drifttool.distributed.context`` sets it). These move no bytes
of strict arithmetic: canonical tensor collectives (ordered gathers that finish reduction
trees) come with TP/SP. Source: design.md, "Scale: devices, ranks, runtimes".
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup


def is_distributed() -> bool:
    """Whether a torch.distributed process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` got here (no-op without a process group)."""
    if is_distributed():
        dist.barrier(group=group)


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank in ``group`` (``[obj]`` without a process group).

    Raises:
        RuntimeError: (torch.distributed) a rank failed or the group timed out.
    """
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``src`` is a rank in ``group``; ``obj`` of the other
    ranks is ignored). Returns ``obj`` without a process group.

    Raises:
        RuntimeError: (torch.distributed) a rank failed or the group timed out.
    """
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]
