"""Runs of the main job under a TP/SP/CFG-parallel layout, for the WS2 tests: rank bodies for
``plan_ranks.on_ranks`` and the one-process run they must equal, record for record.

    one = run_one(tmp / "one", WIDE, fields)
    run_layout(ParallelDims(tp=2, sp=2), tmp / "tp2sp2", WIDE, fields)
    assert_identical(one, tmp / "tp2sp2")

``WIDE`` is the embedded tiny model's shape with 8 heads (d = 128; every strict GEMM still runs
the exact-product kernel), so TP 2/4/8 and Ulysses over 8 ranks divide it; its weights are drawn
from a fixed seed on every rank. Image sizes are chosen per test so that SP shards are unequal
or empty.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from drifttool.artifact import open_run
from drifttool.diff import diff_runs
from drifttool.distributed.canonical import COMM
from drifttool.distributed.plan import ParallelDims
from drifttool.model.config import MMDiTConfig, tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.distributed.plan_ranks import on_ranks

WIDE = dataclasses.replace(tiny(), num_attention_heads=8)
"""tiny() with 8 heads of 16: d = 128, MLP 512 (N·K ≤ 65536: exact products everywhere)."""


def model_of(config: MMDiTConfig | None) -> MMDiT | None:
    """A model of ``config`` in the fixture's dtype (bf16), or None (the fixture's own)."""
    return None if config is None else random_init_(MMDiT(config, dtype=torch.bfloat16), seed=7)


def run_rank(ctx, dims: ParallelDims, arg: Any) -> tuple[int, int]:
    """Rank body: ``execute`` ``arg = (out, config or None, spec fields, faults)`` under ``dims``;
    returns the rank and the bytes its capture received (``COMM.capture_nbytes``)."""
    out, config, fields, faults = arg
    COMM.reset()
    execute(RunSpec(**fields), out, dist=ctx, parallel=dims, model=model_of(config),
            faults=tuple(faults))
    return ctx.rank, COMM.capture_nbytes


def run_one(out: Path, config: MMDiTConfig | None, fields: dict[str, Any]) -> Path:
    execute(RunSpec(**fields), out, model=model_of(config))
    return out


def run_layout(dims: ParallelDims, out: Path, config: MMDiTConfig | None, fields: dict[str, Any],
               faults: tuple[str, ...] = (), capture_bytes: list[int] | None = None) -> Path:
    """Run the layout into ``out``; ``capture_bytes`` (a list) receives each rank's capture
    bytes, by rank."""
    got = on_ranks(dims, "tests.distributed.layout_runs:run_rank", (out, config, fields, faults))
    assert [r for r, _ in got] == list(range(dims.world_size))
    if capture_bytes is not None:
        capture_bytes.extend(n for _, n in got)
    return out


def assert_identical(a: Path, b: Path) -> None:
    """``diff_runs`` finds every record of both tables matched and equal."""
    report = diff_runs(open_run(a), open_run(b))
    assert report.verdict.value == "identical", report.reason
    for table in ("ops", "steps"):
        c = report.counts[table]
        assert c.only_a == c.only_b == c.differ == 0 and c.matched > 0, (table, c)
