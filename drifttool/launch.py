"""Run the main job on every rank of a TP/SP/CFG-parallel layout from one process: gloo ranks on
the loopback interface, started with ``torch.multiprocessing.spawn`` (no torchrun needed). It
sits above the runner (each rank runs ``drifttool.runner.execute``).

    >>> summary = run_parallel(RunSpec(capture="L2"), "runs/tp2", ParallelDims(tp=2))
    >>> summary["complete"], summary["rank"]
    (True, 0)

Each of ``dims.world_size`` children joins the loopback rendezvous the parent serves
(``drifttool.distributed.spawn``: torchrun's variables, a store bound to a port the OS assigns,
so concurrent launches never collide), joins the mesh
``plan.MESH_DIMS`` of ``dims.mesh_shape()`` (``init_distributed``), runs
``drifttool.runner.execute(spec, out, dist=ctx, parallel=dims, faults=faults)`` and closes the
process group. The artifact is the same as ``torchrun --nproc-per-node N -m drifttool run
--tp/--sp/--cfg-parallel ...`` writes. The probe matrix's distributed probes
(``drifttool.probes.distributed``) run their layouts through it.

A rank that raises writes its error, then exits non-zero, so ``spawn`` stops the other ranks
(they would otherwise wait in a collective for the dead one until ``timeout``); the caller gets
one error for the lowest rank that reported one, with its exception's class and message:
``RankError`` (a ``DriftToolError``: the CLI prints one line) when the rank refused the run with
a user error, ``RankCrash`` (a bug; the rank's traceback in the message) otherwise. CPU only
(gloo): the ranks run on ``cpu``. ``spec`` and ``faults`` are pickled to the children, so
operator variants (``RunSpec.variants``) must be picklable.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from drifttool.distributed.context import DEFAULT_TIMEOUT, close_distributed, init_distributed
from drifttool.distributed.plan import MESH_DIMS, ParallelDims, check_faults
from drifttool.distributed.spawn import loopback_store, rank_environment
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runner import execute
from drifttool.settings import RunSpec


class RankError(DriftToolError):
    """A rank of a spawned layout refused the run with a user error (a ``DriftToolError``: bad
    settings, a layout the model does not divide, an occupied output directory). ``rank``: the
    rank; ``kind``: its exception's class name; ``trace``: its traceback (text)."""

    def __init__(self, message: str, *, rank: int, kind: str, trace: str) -> None:
        super().__init__(message)
        self.rank, self.kind, self.trace = rank, kind, trace


class RankCrash(RuntimeError):
    """A rank of a spawned layout raised anything else (a bug), or died without a report; the
    message ends with the rank's traceback."""

    def __init__(self, message: str, *, rank: int, kind: str, trace: str) -> None:
        super().__init__(f"{message}\n{trace}")
        self.rank, self.kind, self.trace = rank, kind, trace


def _describe(dims: ParallelDims) -> str:
    parts = [f"{k}={v}" for k, v in (("tp", dims.tp), ("sp", dims.sp), ("cfg", dims.cfg)) if v > 1]
    if dims.sp > 1:
        parts.append(f"sp_attention={dims.sp_attention}")
    return " ".join(parts) or "1 rank"


def _rank_main(rank: int, world: int, port: int, errors: str, spec: RunSpec, out: str,
               dims: ParallelDims, faults: tuple[str, ...], overwrite: bool, timeout: timedelta,
               threads: int) -> None:
    """One child: torchrun's variables, the mesh, ``execute``; an exception is written to
    ``errors/rank<r>.json`` and re-raised (the non-zero exit stops the other ranks)."""
    os.environ.update(rank_environment(rank, world, port))
    torch.set_num_threads(threads)
    ctx = None
    try:
        if dims.parallel:
            ctx = init_distributed(mesh_dims=MESH_DIMS, mesh_shape=dims.mesh_shape(), timeout=timeout)
        else:  # sample-parallel (``run_parallel(sample_parallel=)``)
            ctx = init_distributed(timeout=timeout)
        summary = execute(spec, out, dist=ctx, parallel=dims if dims.parallel else None,
                          faults=faults, overwrite=overwrite)
        if rank == 0:
            Path(errors, "summary.json").write_text(json.dumps(summary, default=str))
    except BaseException as e:
        Path(errors, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "kind": type(e).__name__, "message": str(e),
             "user_error": isinstance(e, DriftToolError), "trace": traceback.format_exc()}))
        raise
    finally:
        if ctx is not None:
            close_distributed(ctx)


def run_parallel(spec: RunSpec, out: str | Path, dims: ParallelDims, *, faults: tuple[str, ...] = (),
                 overwrite: bool = False, timeout: timedelta = DEFAULT_TIMEOUT,
                 threads: int = 1, sample_parallel: int = 0) -> dict[str, Any]:
    """Run ``spec`` (a ``RunSpec``) under the layout ``dims`` on ``dims.world_size`` spawned gloo
    ranks, writing one artifact to ``out``; returns rank 0's ``execute`` summary (plus
    ``"rank": 0``). ``faults`` plants probe faults (``plan.FAULTS``); ``threads`` is each rank's
    intra-op thread count (strict bytes do not depend on it); ``timeout`` bounds a collective
    waiting for a rank. ``sample_parallel`` N > 1 with a one-rank ``dims`` runs the batch
    sample-parallel on N ranks instead (the logical samples split contiguously,
    ``distributed.rank_samples``; no plan, no faults), as ``torchrun --nproc-per-node N -m
    drifttool run`` without layout options.

    Raises:
        UnsupportedConfigError: ``dims`` is one rank, or a fault is not in ``plan.FAULTS``.
        RankError: a rank raised a ``DriftToolError`` (the lowest rank that reported one: its
            exception's class and message; the traceback in ``RankError.trace``).
        RankCrash: a rank raised anything else, or died without a report.
    """
    if sample_parallel > 1 and (dims.parallel or faults):
        raise UnsupportedConfigError("run_parallel: a sample-parallel run has no TP/SP/CFG layout "
                                     "and no faults")
    if not dims.parallel and sample_parallel <= 1:
        raise UnsupportedConfigError("run_parallel: the layout is one rank (tp = sp = cfg = 1); "
                                     "call drifttool.runner.execute")
    check_faults(faults)
    world = sample_parallel if sample_parallel > 1 else dims.world_size
    store = loopback_store(world, timeout)  # held (and its port bound) until the ranks are done
    with tempfile.TemporaryDirectory(prefix="drifttool-spawn-") as errors:
        try:
            mp.spawn(_rank_main, nprocs=world, join=True,
                     args=(world, store.port, errors, spec, str(out), dims, tuple(faults),
                           overwrite, timeout, int(threads)))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise _rank_error(Path(errors), dims, e, world) from None
        summary = json.loads(Path(errors, "summary.json").read_text())
    del store
    return {**summary, "rank": 0}


def _rank_error(errors: Path, dims: ParallelDims, e: Exception, world: int) -> RankError | RankCrash:
    """One error for the caller: the lowest rank's report (user error or crash), else the
    process that ``spawn`` saw die."""
    reports = sorted((json.loads(p.read_text()) for p in errors.glob("rank*.json")),
                     key=lambda r: r["rank"])
    where = (f"{world}-rank layout ({_describe(dims)})" if dims.parallel
             else f"{world}-rank sample-parallel run")
    if not reports:
        rank = int(getattr(e, "error_index", -1))
        return RankCrash(f"rank {rank} of the {where} died without a report", rank=rank,
                         kind="died", trace=str(e))
    r = reports[0]
    cls = RankError if r["user_error"] else RankCrash
    return cls(f"rank {r['rank']} of the {where} failed: {r['kind']}: {r['message']}",
               rank=r["rank"], kind=r["kind"], trace=r["trace"])
