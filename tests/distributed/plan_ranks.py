"""Run a function on the ranks of a TP/SP/CFG-parallel layout, in-process workers over gloo.

    results = on_ranks(ParallelDims(tp=2), "tests.distributed.tp_cases:forward_case", arg)

Each of ``dims.world_size`` workers (``torch.multiprocessing`` spawn) sets torchrun's variables,
joins the mesh ``plan.MESH_DIMS`` of ``dims.mesh_shape()`` and calls ``target(ctx, dims, arg)``
(``target`` named ``"module:function"``, importable in the children through the parent's
``sys.path``). Each rank's return value (picklable) comes back by rank; an exception in a rank
comes back as ``RankCrash`` and fails the calling test with that rank's traceback.
"""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from drifttool.distributed import close_distributed, init_distributed
from drifttool.distributed.plan import MESH_DIMS, ParallelDims
from drifttool.distributed.spawn import loopback_store, rank_environment


class RankCrash(AssertionError):
    """A rank raised; the message holds its traceback."""


def _main(rank: int, world: int, port: int, out: str, target: str, dims: ParallelDims, arg: Any) -> None:
    os.environ.update(rank_environment(rank, world, port))
    torch.set_num_threads(1)
    module, name = target.split(":")
    ctx = init_distributed(mesh_dims=MESH_DIMS, mesh_shape=dims.mesh_shape())
    try:
        result: Any = getattr(importlib.import_module(module), name)(ctx, dims, arg)
    except BaseException:  # reported to the parent, which fails the test
        result = RankCrash(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        close_distributed(ctx)
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))  # test-internal, own files


def on_ranks(dims: ParallelDims, target: str, arg: Any = None) -> list[Any]:
    """``target(ctx, dims, arg)`` on every rank of ``dims``; the results by rank.

    Raises:
        RankCrash: a rank raised (the first such rank's traceback).
    """
    world = dims.world_size
    with tempfile.TemporaryDirectory() as out:
        store = loopback_store(world)  # bound now, held until the ranks are done
        mp.spawn(_main, args=(world, store.port, out, target, dims, arg), nprocs=world, join=True)
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]
    crashed = [r for r in results if isinstance(r, RankCrash)]
    if crashed:  # every crashed rank's traceback: the first is often a peer's lost connection
        raise RankCrash("\n".join(str(r) for r in crashed))
    return results
