"""Distributed probes (``drifttool probe --distributed``): each planted parallel fault drifts first
at its declared operator, step, block, stream, branch and owning rank; each layout control is
identical to one process. Every layout runs on spawned gloo ranks (``run_parallel``).

The default set checks the catalog's declarations. ``slow`` (CI runs them): three probes through
the CLI (an SP mismatch whose first differing row was computed by rank 1, the CFG noise mismatch
on which CFG rank 1 disagrees, the TP2 control), the whole distributed matrix, the 4-rank
all-reduce mismatch on an 8-head model and the errors of a rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drifttool.artifact import open_run
from drifttool.cli.app import app
from drifttool.diff import diff_runs
from drifttool.distributed.plan import ParallelDims
from drifttool.launch import RankError, run_parallel
from drifttool.model.checkpoint import save_checkpoint
from drifttool.probes.catalog import catalog, distributed_catalog
from drifttool.probes.distributed import LayoutRun, layout_name
from drifttool.probes.runner import ERROR, NOT_APPLICABLE, PASS, judge, run_probe
from drifttool.probes.spec import Expectation, Probe
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.distributed.layout_runs import WIDE, model_of

DIST = {p.name: p for p in distributed_catalog()}
FAST = ["sp_rope_no_offset", "noise_per_rank", "layout_tp2", "tp_allreduce"]


def _matrix(out: Path, names: list[str] | None) -> tuple[int, str, dict]:
    args = ["probe", "--distributed", "-o", str(out), *(["--only", ",".join(names)] if names else [])]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    return res.exit_code, res.output, json.loads((out / "matrix.json").read_text())


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "m"
    return (*_matrix(out, FAST), out)


def _check(p: Probe, r: dict) -> None:
    if p.name == "tp_allreduce":  # at TP2 one commutative addition: the ranks prove it a no-op
        assert r["status"] == NOT_APPLICABLE and r["verdict"] == "identical", r["reasons"]
        assert "tp_allreduce gave the contract's bytes at all" in r["reasons"][0], r["reasons"]
        return
    assert r["status"] == PASS, r["reasons"]
    e = p.expect
    if p.kind == "invariant":
        assert r["verdict"] == "identical"
        return
    assert r["verdict"] == "drift" and r["first_op"] == e.op and r["origin"] is True
    for k in ("step", "block", "stream", "branch", "sample", "rank"):
        if getattr(e, k) is not None:
            assert r[f"first_{k}"] == getattr(e, k), k


def test_the_catalog_declares_every_fault_and_layout():
    faults = {"tp_bias_every_rank", "sp_rope_no_offset", "sp_padding_unmasked", "tp_allreduce",
              "noise_per_rank", "cfg_branch_swap"}
    assert faults <= set(DIST)
    assert {p.layout for p in DIST.values() if p.kind == "invariant"} == {
        "TP2", "SP2 agrs", "SP2 ulysses", "SP2 ring", "CFG2", "TP2×SP2 agrs"}
    assert DIST["tp_allreduce"].kind == "invariant"  # at TP2: one commutative addition
    assert all(p.expect.rank is not None for p in DIST.values() if p.kind == "mismatch")
    assert not set(DIST) & {p.name for p in catalog()}  # a group of its own (--distributed)
    assert layout_name(ParallelDims(tp=2, sp=2, sp_attention="ulysses")) == "TP2×SP2 ulysses"
    no_cfg = {p.name: p for p in distributed_catalog({"cfg_scale": 1.0})}
    assert no_cfg["noise_per_rank"].pending and no_cfg["layout_cfg2"].pending
    assert not no_cfg["layout_tp2"].pending


@pytest.mark.slow  # the fixture runs the group's fast probes on spawned ranks (about 35 s)
def test_cli_runs_the_distributed_group(fast):
    code, output, data, out = fast
    assert code == 0, output
    assert [r["name"] for r in data["results"]] == [n for n in DIST if n in FAST]  # catalog order
    for col in ("layout", "first drift", "result"):
        assert col in output
    assert "SP2 agrs" in output and "CFG2" in output and "rank 1" in output
    for r in data["results"]:
        _check(DIST[r["name"]], r)
        assert r["layout"] == DIST[r["name"]].layout


@pytest.mark.slow  # the fixture runs the group's fast probes on spawned ranks (about 35 s)
def test_sp_probe_names_the_rank_that_computed_the_row(fast):
    out = fast[3]
    rep = json.loads((out / "diffs" / "sp_rope_no_offset.json").read_text())["first_drift"]
    assert (rep["rank_b"], rep["row_rank_b"], rep["row_rank_a"]) == (0, 1, None)
    assert rep["rows"]["first"][0]["row"] == 192  # rank 1's first image row
    run = open_run(out / "runs" / "sp_rope_no_offset")
    assert run.manifest["layout"]["sp"] == 2 and run.world_size == 2
    assert run.manifest["settings"]["img_grid"] == [10, 35]  # 350 image tokens: 192 | 158 rows
    assert run.manifest["variants"] == ["parallel=sp_rope_no_offset"]


@pytest.mark.slow  # the fixture runs the group's fast probes on spawned ranks (about 35 s)
def test_noise_probe_is_owned_by_cfg_rank_1(fast):
    rep = json.loads((fast[3] / "diffs" / "noise_per_rank.json").read_text())["first_drift"]
    # the CFG ranks repeat the sampler's calls; rank 1's SDE step (its own noise) disagrees with
    # rank 0's, which writes the record, at the step that drew the noise
    assert (rep["op"], rep["step"], rep["block"], rep["branch"]) == ("flow_sde_step_logp", 0, -2,
                                                                    "cfg")
    assert (rep["rank_b"], rep["disagree_b"], rep["origin_kind"]) == (0, [1], "ranks")


@pytest.mark.slow  # the fixture runs the group's fast probes on spawned ranks (about 35 s)
def test_a_wrong_owning_rank_is_a_finding(fast):
    out = fast[3]
    r = [x for x in fast[2]["results"] if x["name"] == "sp_rope_no_offset"][0]
    report = diff_runs(open_run(r["reference"]), open_run(r["run_dir"]))
    p = DIST["sp_rope_no_offset"]
    assert judge(p, report) == []
    wrong = p.with_(expect=Expectation(verdict="drift", op="multi_axis_rope", rank=0))
    assert judge(wrong, report) == [
        "first drift owned by rank 1 in the probe run (the SP rank of its first differing row), "
        "expected rank 0"]
    assert Path(r["reference"]).parent.name == "references"  # its own one-process reference
    assert (out / "heatmaps" / "sp_rope_no_offset.png").exists()


def test_a_failing_rank_comes_back_as_one_error(tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "note.txt").write_text("not an artifact")
    with pytest.raises(RankError) as e:
        run_parallel(RunSpec(capture="L1"), target, ParallelDims(cfg=2))
    assert e.value.rank == 0 and e.value.kind == "ArtifactError"
    assert str(e.value).startswith("rank 0 of the 2-rank layout (cfg=2) failed: ArtifactError: ")


# -- slow: the whole group, the 4-rank all-reduce, a refused layout ------------------------------
@pytest.mark.slow
def test_the_whole_distributed_matrix(tmp_path):
    code, output, data = _matrix(tmp_path / "m", None)
    assert code == 0, output
    assert [r["name"] for r in data["results"]] == list(DIST)
    for r in data["results"]:
        _check(DIST[r["name"]], r)


def _wide(ctx) -> Path:
    """The 8-head model of the WS2 tests as a checkpoint (TP4 needs >= 4 heads), one folder per
    matrix: both TP4 probes then share their one-process reference."""
    folder = ctx.work.parent / "models" / "wide"
    return folder if (folder / "config.json").exists() else save_checkpoint(model_of(WIDE), folder)


TP4 = dict(settings={"steps": 2}, model=_wide)

TP4_ALLREDUCE = Probe(
    name="tp_allreduce_tp4", factor="TP reduction order", kind="mismatch",
    change="plain all-reduce of 4 row-parallel partials instead of the contract's tree",
    execute=LayoutRun(ParallelDims(tp=4), ("tp_allreduce",), **TP4), layout="TP4",
    # observed: one image row of sample 1 at block 1 is the first whose fp32 sums, in gloo's
    # order, round to another bf16 than the tree's; everything before it is equal
    expect=Expectation(verdict="drift", op="attn_out_bias_gemm", step=0, block=1, stream="img",
                       branch="cond", sample=1, rank=0))

TP4_CONTROL = Probe(name="layout_tp4", factor="TP layout", kind="invariant",
                    change="TP4 on the 8-head model", layout="TP4",
                    execute=LayoutRun(ParallelDims(tp=4), (), **TP4),
                    expect=Expectation(verdict="identical"))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_base")
    execute(RunSpec(), out / "runs" / "baseline")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("p", [TP4_CONTROL, TP4_ALLREDUCE], ids=lambda p: p.name)
def test_tp4_allreduce_drifts_where_tp4_itself_is_identical(baseline, p):
    from drifttool.fixture import load_fixture

    r = run_probe(p, RunSpec(), baseline / "runs" / "baseline", baseline,
                  load_fixture("tiny-t2i").model_dir)
    assert r.status == PASS, (r.reasons, r.first_drift)
    if p.kind == "mismatch":
        assert r.first_rows.startswith("1/24: ")  # one image row of sample 1 differs


@pytest.mark.slow
def test_a_layout_the_model_does_not_divide_is_an_error(baseline):
    from drifttool.fixture import load_fixture

    p = TP4_ALLREDUCE.with_(name="tp4_on_two_heads",
                            execute=LayoutRun(ParallelDims(tp=4), ("tp_allreduce",)))
    r = run_probe(p, RunSpec(), baseline / "runs" / "baseline", baseline,
                  load_fixture("tiny-t2i").model_dir)
    assert r.status == ERROR and not r.ok
    assert ("RankError: rank 0 of the 4-rank layout (tp=4) failed: UnsupportedConfigError: --tp 4: "
            "2 attention heads do not split over 4 ranks") in r.reasons[0]
