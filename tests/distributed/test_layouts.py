"""The main job in every process layout (``tests/harness.py``, ``LAYOUTS``): ``drifttool run --batch
2`` as one process and sample-parallel on 2 ranks (torchrun, gloo; ``slow``) writes an artifact
that diffs identical to the one-process reference, and its replay and training recompute — single
process, from the stored inputs and step records, whatever layout wrote them — diff identical to
it (issue #9: rank is the owning rank, not identity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drifttool.artifact import open_run
from drifttool.diff import diff_runs
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.harness import SAMPLE_PARALLEL_RANKS, layouts, run_in_layout

BATCH = 2  # one sample per rank at 2 ranks; larger batches only cost time
WORLD = {"single": 1, "sample_parallel": SAMPLE_PARALLEL_RANKS}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The one-process reference, written through the library (not the CLI under test)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    execute(RunSpec(batch=BATCH), out)
    return out


@pytest.fixture(scope="module", params=layouts())
def layout_run(request, tmp_path_factory) -> tuple[str, Path]:
    """(layout, artifact of ``drifttool run --batch 2`` written in that layout), once per module."""
    layout = request.param
    work = tmp_path_factory.mktemp(layout)
    code, out = run_in_layout(layout, "run", "--batch", BATCH, "-o", work / "run", cwd=work)
    assert code == 0, out
    return layout, work / "run"


def _assert_identical(a: Path, b: Path) -> None:
    """``diff_runs(a, b)`` is identical and not vacuous: every record of ``a`` was matched."""
    report = diff_runs(open_run(a), open_run(b))
    assert report.verdict.value == "identical", report.reason
    for table in ("ops", "steps"):
        c = report.counts[table]
        assert c.only_a == 0 and c.only_b == 0 and c.matched > 0, (table, c)


def test_run_in_layout_is_identical_to_one_process(layout_run, reference):
    layout, path = layout_run
    run = open_run(path)
    assert run.complete and run.check() == [] and run.world_size == WORLD[layout]
    assert run.manifest["layout"]["kind"] == layout
    ranks = set(run.steps_table()["rank"].to_pylist())
    assert ranks == set(range(WORLD[layout]))  # every rank owns some samples' records
    _assert_identical(reference, path)


def test_replay_of_layout_artifact_is_identical(layout_run, cli, tmp_path):
    """``drifttool replay`` runs one process from the stored inputs and writes its own layout."""
    layout, path = layout_run
    code, out = cli("replay", path, "-o", tmp_path / "replay")
    assert code == 0, out
    manifest = json.loads((tmp_path / "replay" / "manifest.json").read_text())
    assert manifest["replay_of"]["path"] == str(path)
    assert manifest["layout"]["kind"] == "single" and manifest["layout"]["world_size"] == 1
    _assert_identical(path, tmp_path / "replay")
    code, out = cli("diff", path, tmp_path / "replay")
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.slow  # the single-process case is tests/cli/test_replay.py::test_recompute_and_diff
def test_recompute_of_layout_artifact_is_identical(layout_run, cli, tmp_path):
    """The training recompute reads every rank's step records (latents, logp) of the artifact."""
    layout, path = layout_run
    code, out = cli("recompute", path, "-o", tmp_path / "train")
    assert code == 0, out
    _assert_identical(path, tmp_path / "train")
