"""The loopback rendezvous of ranks started from one process (``torch.multiprocessing.spawn``,
no torchrun): a store the parent serves and torchrun's variables for each child.

    >>> store = loopback_store(2)                       # bound now, to a port the OS assigns
    >>> rank_environment(1, 2, store.port)["RANK"]      # os.environ.update(...) in child 1
    '1'

Each child sets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``) and joins, as torchrun's workers do
(``TORCHELASTIC_USE_AGENT_STORE``), the rendezvous store the parent already serves on that port
(``loopback_store``: bound to a port the OS assigns, held until the children are done; no port
is picked first and bound later, so concurrent launches never collide); then
``init_distributed`` joins the process group. ``drifttool.launch.run_parallel`` runs the main job
on ranks started this way.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from drifttool.distributed.context import DEFAULT_TIMEOUT

LOOPBACK = "127.0.0.1"


def loopback_store(world: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """The rendezvous store of ``world`` spawned ranks: a ``TCPStore`` server bound now to a
    loopback port the OS assigns (``store.port``), which the ranks join as clients
    (``rank_environment``), as torchrun's workers join its agent's store. Keep it referenced
    until the ranks are done."""
    return dist.TCPStore(LOOPBACK, 0, world, is_master=True, timeout=timeout,
                         wait_for_workers=False)


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of ``world`` joining the store of
    ``loopback_store`` on ``port`` (every rank a client: ``TORCHELASTIC_USE_AGENT_STORE``)."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
