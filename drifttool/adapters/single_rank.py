"""One CPU rank for a runtime that needs torch.distributed even on one device (vllm-omni and
xfuser build their parallel groups at start-up): the rendezvous of a one-rank gloo group.

    >>> single_rank_env("xfuser")    # then the runtime's own init_distributed_environment(...)
"""

from __future__ import annotations

import os
import socket

import torch

from drifttool.errors import DriftToolError


def single_rank_env(runtime: str) -> None:
    """Refuse a process whose torch.distributed already runs more than one rank, and, when no
    group exists yet, set ``MASTER_ADDR`` (127.0.0.1) and a free ``MASTER_PORT`` for an
    ``env://`` rendezvous of world size 1 (values the user set are kept).

    Raises:
        DriftToolError: torch.distributed is initialised with a world size other than 1.
    """
    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise DriftToolError(f"{runtime} on the CPU runs one rank; torch.distributed already "
                                 f"has {dist.get_world_size()}")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
