"""``torchrun --nproc-per-node 2 -m drifttool run --batch 4`` (gloo, CPU): the batch's samples run
sample-parallel and write one artifact that diffs identical to the one-process run; a drift
planted on rank 1 is reported with its owning rank (issue #9, "Done when")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drifttool.artifact import open_run
from drifttool.diff import diff_runs
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.harness import torchrun_env

HERE = Path(__file__).parent


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *args], cwd=cwd, env=torchrun_env(HERE),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    execute(RunSpec(batch=4), out)
    return out


@pytest.mark.slow  # two torchrun launches: rendezvous and imports take 5-15 s each
def test_two_ranks_write_one_artifact_identical_to_one_process(one_process, tmp_path):
    p = _torchrun("-m", "drifttool", "run", "--batch", "4", "-o", str(tmp_path / "sp"),
                  cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 (sample-parallel)" in p.stdout  # rank 0 prints the summary, once
    assert p.stdout.count("drifttool run →") == 1
    run = open_run(tmp_path / "sp")
    assert run.complete and run.world_size == 2 and run.check() == []
    layout = run.manifest["layout"]
    assert layout["kind"] == "sample_parallel" and layout["samples"] == {"0": [0, 1], "1": [2, 3]}
    assert layout["mesh"] == {"dims": ["sample"], "shape": [2]}
    owners = set(zip(run.steps_table()["sample"].to_pylist(), run.steps_table()["rank"].to_pylist()))
    assert {(s, r) for s, r in owners} == {(0, 0), (1, 0), (2, 1), (3, 1)}
    assert {r for r in run.ops_table()["rank"].to_pylist()} == {0, 1}
    assert {row["rank"] for row in run.trace_rows()} == {0, 1}
    report = diff_runs(open_run(one_process), open_run(tmp_path / "sp"))
    assert report.verdict.value == "identical", report.reason
    assert ("execution layouts differ (records align by identity): A single process, "
            "B sample_parallel over 2 ranks") in report.notes
    # and the comparison is not vacuous: every record of the one-process run was matched
    assert report.counts["ops"].only_a == 0 and report.counts["steps"].only_a == 0


@pytest.mark.slow
def test_drift_planted_on_rank1_names_its_owning_rank(one_process, tmp_path):
    p = _torchrun(str(HERE / "plant_rank1.py"), str(tmp_path / "planted"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    report = diff_runs(open_run(one_process), open_run(tmp_path / "planted"))
    assert report.verdict.value == "drift"
    first = report.first_drift
    assert (first.op, first.step, first.block, first.sample) == ("mlp_down_gemm", 1, 0, 2)
    assert (first.rank_a, first.rank_b) == (0, 1)
    out = subprocess.run([sys.executable, "-m", "drifttool", "diff", str(one_process),
                          str(tmp_path / "planted"), "--json"], capture_output=True, text=True)
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert (doc["first_drift"]["rank_a"], doc["first_drift"]["rank_b"]) == (0, 1)
    human = subprocess.run([sys.executable, "-m", "drifttool", "diff", str(one_process),
                            str(tmp_path / "planted")], capture_output=True, text=True)
    assert "owning rank 0 in run A, 1 in run B" in human.stdout.replace("\n", " ")
