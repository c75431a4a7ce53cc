"""Rank bodies for the multi-rank artifact tests, spawned with ``torch.multiprocessing`` over gloo
(a uniquely named module, importable in the spawned children through the parent's ``sys.path``).

Each rank runs a synthetic sample-parallel rollout through ``Recorder`` + ``ArtifactWriter`` the
way the runner will: op records and step records of its own samples only, the whole batch's
replay inputs, and its trace. A sample's tensors depend only on its logical id and the step, so
any split of the batch over ranks must give the records of the one-process run.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.recorder import Recorder
from drifttool.distributed.spawn import loopback_store, rank_environment
from drifttool.distributed import (DistContext, close_distributed, init_distributed,
                                   rank_samples, sample_parallel_layout)

STEPS = 3
IMG_GRID = (3, 3)  # 9 image rows: odd
WIDTH = 7
TRACE = [{"device": "cpu", "component": "mmdit", "op": "img_mlp", "block": 0, "stream": "img", "call": 0, "contract": "m.v1",
          "requested": "strict", "actual": "strict", "kernel": "cpu", "fallback": False,
          "reason": "", "declared": False, "calls": STEPS}]


def sample_tensor(sample: int, step: int, what: str) -> torch.Tensor:
    """[9, 7] float32 values of one logical sample at one step (fresh random, seeded by id)."""
    g = torch.Generator().manual_seed(1000 * sample + 10 * step + (what == "x_t"))
    return torch.randn(IMG_GRID[0] * IMG_GRID[1], WIDTH, generator=g)


def batch_inputs(batch: list[int]) -> dict[str, torch.Tensor]:
    """The whole batch's replay inputs ([B, 9, 7]), the same on every rank."""
    return {"x0": torch.stack([sample_tensor(s, -1, "x0") for s in batch])}


def synthetic_run(path: Path, batch: list[int], samples: list[int], rank: int, *,
                  layout: dict[str, Any] | None = None, fail_at: int | None = None,
                  fingerprint: dict[str, Any] | None = None, overwrite: bool = False) -> None:
    """Write ``samples`` (this rank's share of ``batch``) into the artifact at ``path``.

    ``fail_at``: raise ``RuntimeError`` at the start of that step (a planted failure) after
    closing the writer incomplete, as the runner's ``close_incomplete`` does.
    """
    m = {"fingerprint": fingerprint or {"arch": {"depth": 1}}, "kind": "rollout"}
    writer = ArtifactWriter(path, m, overwrite=overwrite, layout=layout)
    rec = Recorder("L2", writer, rank=rank)
    try:
        writer.write_inputs(batch_inputs(batch))
        for i in range(STEPS):
            if i == fail_at:
                raise RuntimeError(f"planted failure on rank {rank} at step {i}")
            sigma, sigma_next = 1.0 - i / STEPS, 1.0 - (i + 1) / STEPS
            site = {"phase": "rollout", "step": i, "sigma": sigma, "branch": "cond", "block": 0,
                    "samples": samples, "txt_lens": None, "img_grid": IMG_GRID, "rank": rank,
                    "op": "img_mlp", "stream": "img", "call": 0, "op_pos": 0}
            out = torch.stack([sample_tensor(s, i, "out") for s in samples])  # [b, 9, 7]
            rec.capture(site, out, "BS.")
            for s in samples:
                rec.record_step(phase="rollout", step=i, sigma=sigma, sigma_next=sigma_next,
                                sample=s, branch="cond", rank=rank,
                                quantities={"x_t": sample_tensor(s, i, "x_t")})
            rec.flush()
        writer.write_trace([{**row, "rank": rank} for row in TRACE])
    except BaseException:
        rec.close(complete=False)
        raise
    rec.close(complete=True)


def _error(e: BaseException) -> dict[str, str]:
    return {"error": type(e).__name__, "message": str(e)}


def scenario_complete(ctx: DistContext, out: Path, batch: list[int]) -> dict[str, Any]:
    """One sample-parallel artifact over every rank, overwriting an earlier one."""
    mine = rank_samples(batch, ctx.rank, ctx.world_size)
    layout = {**sample_parallel_layout(batch, ctx.world_size), **ctx.layout()}
    synthetic_run(out / "run", batch, mine, ctx.rank, layout=layout, overwrite=True)
    return {"samples": mine, "mesh": list(ctx.mesh.mesh_dim_names), "device": str(ctx.device)}


def scenario_failures(ctx: DistContext, out: Path, batch: list[int]) -> dict[str, Any]:
    """Three failures in one process group: rank 0 cannot create the directory; the ranks
    disagree on the fingerprint; rank 1 raises at step 2 while rank 0 finishes."""
    res: dict[str, Any] = {}
    mine = rank_samples(batch, ctx.rank, ctx.world_size)
    layout = sample_parallel_layout(batch, ctx.world_size)
    try:
        ArtifactWriter(out / "a_file" / "run", {"fingerprint": {}}, layout=layout)
        res["create"] = None
    except Exception as e:
        res["create"] = _error(e)
    try:
        synthetic_run(out / "disagree", batch, mine, ctx.rank, layout=layout,
                      fingerprint={"arch": {"depth": 1 + ctx.rank}})
        res["disagree"] = None
    except Exception as e:
        res["disagree"] = _error(e)
    try:
        synthetic_run(out / "failed", batch, mine, ctx.rank, layout=layout,
                      fail_at=2 if ctx.rank == 1 else None)
        res["failed"] = None
    except Exception as e:
        res["failed"] = _error(e)
    return res


SCENARIOS: dict[str, Callable[[DistContext, Path, list[int]], dict[str, Any]]] = {
    "complete": scenario_complete, "failures": scenario_failures}


def _rank_main(rank: int, world: int, port: int, out: str, scenario: str,
               batch: list[int]) -> None:
    os.environ.update(rank_environment(rank, world, port))
    torch.set_num_threads(1)
    ctx = init_distributed(mesh_dims=("sample",))
    try:
        result = SCENARIOS[scenario](ctx, Path(out), batch)
    except BaseException as e:  # reported to the parent, which fails the test
        result = {"crash": traceback.format_exc(), **_error(e)}
    finally:
        close_distributed(ctx)
    Path(out, f"result.rank{rank}.json").write_text(json.dumps(result))


def spawn(world: int, out: Path, scenario: str, batch: list[int]) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` gloo ranks; every rank's result, by rank."""
    store = loopback_store(world)  # bound now, held until the ranks are done
    mp.spawn(_rank_main, args=(world, store.port, str(out), scenario, batch), nprocs=world,
             join=True)
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(world)]
