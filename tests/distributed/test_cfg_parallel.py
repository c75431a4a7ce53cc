"""CFG-parallel (RFC ``cfg_parallel_invariance``): one CFG branch per rank gives the artifact of
batched and of sequential CFG on one process, record for record, with the uncond branch's model
records owned by CFG rank 1 and every step and sampler record by rank 0."""

from __future__ import annotations

import pytest

from drifttool.artifact import open_run
from drifttool.distributed.plan import ParallelDims
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.distributed.layout_runs import assert_identical
from tests.distributed.plan_ranks import RankCrash, on_ranks


def run_rank(ctx, dims, arg):
    """Rank body: ``execute`` the run ``arg = (out, spec fields)`` under ``dims``."""
    out, fields = arg
    execute(RunSpec(**fields), out, dist=ctx, parallel=dims)
    return ctx.rank


@pytest.mark.parametrize("fields", [dict(batch=3, capture="L2"),
                                    pytest.param(dict(samples=[2], capture="L1", cfg_layout="sequential"),
                                                 marks=pytest.mark.slow)])
def test_cfg_parallel_equals_one_process(tmp_path, fields):
    one = tmp_path / "one"
    execute(RunSpec(**fields), one)
    par = tmp_path / "cfg2"
    assert on_ranks(ParallelDims(cfg=2), "tests.distributed.test_cfg_parallel:run_rank",
                    (par, fields)) == [0, 1]
    assert_identical(one, par)
    run = open_run(par)
    assert run.complete and run.manifest["layout"]["kind"] == "parallel"
    assert run.manifest["layout"]["cfg_parallel"] == 2 and run.world_size == 2
    ops = run.ops_table().to_pydict()
    owners = {(b, r) for b, r, blk in zip(ops["branch"], ops["rank"], ops["block"]) if blk >= -1}
    assert owners == {("cond", 0), ("uncond", 1)}, owners  # the model's records: the branch's rank
    assert set(run.steps_table()["rank"].to_pylist()) == {0}


@pytest.mark.slow  # two spawned gloo ranks (about 8 s); the CLI refuses it before any rank starts:
# tests/distributed/test_cli_layouts.py
def test_cfg_parallel_without_cfg_is_refused(tmp_path):
    with pytest.raises(RankCrash, match="CFG is off"):
        on_ranks(ParallelDims(cfg=2), "tests.distributed.test_cfg_parallel:run_rank",
                 (tmp_path / "x", dict(cfg_scale=1.0)))


@pytest.mark.slow  # spawned gloo ranks, then a production CFG-parallel run (about 9 s each)
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_production_cfg_parallel_needs_sequential_cfg(tmp_path, mode):
    """Each CFG rank runs its branch alone, as sequential CFG does: production bytes differ from
    batched CFG, so a batched production run under CFG-parallel is refused (it would record a
    layout it did not run); with --cfg-layout sequential it diffs identical to one process."""
    with pytest.raises(RankCrash, match="pass --cfg-layout sequential"):
        on_ranks(ParallelDims(cfg=2), "tests.distributed.test_cfg_parallel:run_rank",
                 (tmp_path / "x", dict(mode=mode)))
    if mode == "auto":
        fields = dict(mode=mode, cfg_layout="sequential", capture="L1")
        execute(RunSpec(**fields), tmp_path / "one")
        on_ranks(ParallelDims(cfg=2), "tests.distributed.test_cfg_parallel:run_rank",
                 (tmp_path / "cfg2", fields))
        assert_identical(tmp_path / "one", tmp_path / "cfg2")
