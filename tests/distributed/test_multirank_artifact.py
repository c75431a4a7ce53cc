"""Several gloo ranks write one artifact (issue #9 item 4): per-rank files, the manifest and
inputs from rank 0, ``complete`` only once every rank closed; the reader presents every rank's
records as one run that equals the one-process run of the same batch. Each spawn takes a few
seconds (the children import torch)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dist_workers import STEPS, TRACE, spawn, synthetic_run
from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.errors import ArtifactError
from tests.artifact.table_files import rewrite_batches


def _records(table: pa.Table, key: tuple[str, ...]) -> list[dict]:
    """Rows without the rank attribute and the per-rank ``seq``, in identity order."""
    cols = [c for c in table.column_names if c not in ("rank", "seq")]
    key = tuple(k for k in key if k != "rank")
    return sorted(table.select(cols).to_pylist(), key=lambda r: tuple(r[k] for k in key))


@pytest.mark.parametrize("world,batch", [(2, [0, 1, 2, 3]), (3, [4, 7, 1, 2, 9])])
def test_ranks_write_one_artifact_equal_to_one_process(tmp_path, world, batch):
    single = tmp_path / "single"
    synthetic_run(single, batch, batch, 0)
    run_dir = tmp_path / "run"
    synthetic_run(run_dir, batch, batch, 0)  # an earlier artifact there: rank 0 removes it
    results = spawn(world, tmp_path, "complete", batch)
    assert all("error" not in r for r in results), results
    split = [r["samples"] for r in results]
    assert [i for s in split for i in s] == batch and all(split)
    assert results[0]["mesh"] == ["sample"] and results[0]["device"] == "cpu"

    run = open_run(run_dir)
    assert run.complete and run.world_size == world and run.check() == []
    m = run.manifest
    assert m["layout"] == {"kind": "sample_parallel", "world_size": world,
                           "samples": {str(r): s for r, s in enumerate(split)},
                           "mesh": {"dims": ["sample"], "shape": [world]}}
    for table in S.RANK_TABLES:
        assert m["files"][table] == [S.rank_file(table, r) for r in range(world)]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        [S.MANIFEST, S.INPUTS, *(S.rank_file(t, r) for t in S.RANK_TABLES for r in range(world))])

    ops, steps = run.ops_table(), run.steps_table()
    for r, samples in enumerate(split):  # owning rank = a column, each rank its own samples
        assert set(pc.unique(ops.filter(pc.equal(ops["rank"], r))["sample"]).to_pylist()) \
            == set(samples)
        assert set(pc.unique(steps.filter(pc.equal(steps["rank"], r))["sample"]).to_pylist()) \
            == set(samples)
    assert run.trace_rows() == [{**TRACE[0], "rank": r} for r in range(world)]

    one = open_run(single)
    assert _records(ops, S.OPS_KEY) == _records(one.ops_table(), S.OPS_KEY)
    assert _records(steps, S.STEPS_KEY) == _records(one.steps_table(), S.STEPS_KEY)
    assert ops.num_rows == len(batch) * STEPS and steps.num_rows == len(batch) * STEPS
    assert (run_dir / S.INPUTS).read_bytes() == (single / S.INPUTS).read_bytes()


def test_failures_leave_the_artifact_incomplete(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    batch = [0, 1, 2, 3]
    r0, r1 = spawn(2, tmp_path, "failures", batch)
    assert "crash" not in r0 and "crash" not in r1, (r0, r1)

    # rank 0 cannot create the directory: every rank raises, the others name rank 0
    assert r0["create"]["error"] == r1["create"]["error"] == "ArtifactError"
    assert "exists and is not a directory" in r0["create"]["message"]
    assert r1["create"]["message"].endswith("(reported by rank 0)")

    # the ranks disagree on the fingerprint: both finished, yet the artifact is incomplete
    for r in (r0, r1):
        assert r["disagree"]["error"] == "ArtifactError"
        assert "rank 1's manifest 'fingerprint' differs from rank 0's" in r["disagree"]["message"]
    assert json.loads((tmp_path / "disagree" / S.MANIFEST).read_text())["complete"] is False

    # rank 1 raises at step 2: rank 0 is told, the manifest stays incomplete, and both ranks'
    # finished steps are readable
    assert r1["failed"] == {"error": "RuntimeError",
                            "message": "planted failure on rank 1 at step 2"}
    assert r0["failed"]["error"] == "ArtifactError"
    assert "left incomplete: rank(s) [1] did not finish" in r0["failed"]["message"]
    run = open_run(tmp_path / "failed")
    assert not run.complete and run.world_size == 2
    steps = run.steps_table()
    by_rank = {r: sorted(set(steps.filter(pc.equal(steps["rank"], r))["step"].to_pylist()))
               for r in (0, 1)}
    assert by_rank == {0: [0, 1, 2], 1: [0, 1]}
    ops = run.ops_table(rank=1)
    assert sorted(set(ops["sample"].to_pylist())) == [2, 3]
    assert sorted(set(ops["step"].to_pylist())) == [0, 1]
    assert run.trace_rows(rank=1) == [] and len(run.trace_rows(rank=0)) == 1
    assert run.check() == []  # every file was closed: nothing cut, just not every step


def test_complete_run_lacking_a_rank_is_refused(tmp_path):
    """A complete world-2 manifest whose rank 1 files are gone (or a world-1 run holding rank 1
    files) is damage, not a smaller run."""
    batch = [0, 1, 2, 3]
    spawn(2, tmp_path, "complete", batch)
    run_dir = tmp_path / "run"
    m = json.loads((run_dir / S.MANIFEST).read_text())
    for t in S.RANK_TABLES:
        (run_dir / S.rank_file(t, 1)).unlink()
        m["files"][t].remove(S.rank_file(t, 1))
        del m["files"]["digests"][S.rank_file(t, 1)]
    (run_dir / S.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="world size 2 lacks steps.rank1.parquet"):
        open_run(run_dir)
    m["layout"]["world_size"] = 1
    (run_dir / S.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError,
                       match=r"mesh dims \['sample'\] of shape \[2\] does not cover"):
        open_run(run_dir)
    m["layout"]["mesh"]["shape"] = [1]
    (run_dir / S.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"layout.samples has ranks \['0', '1'\]"):
        open_run(run_dir)
    del m["layout"]["samples"]
    (run_dir / S.MANIFEST).write_text(json.dumps(m))
    run = open_run(run_dir)  # now a consistent world-1 run of rank 0's samples
    assert run.world_size == 1 and run.check() == []
    (run_dir / S.steps_file(1)).write_bytes((run_dir / S.steps_file(0)).read_bytes())
    with pytest.raises(ArtifactError, match="files not listed in the manifest: steps.rank1.parquet"):
        open_run(run_dir)
    m["complete"] = False  # an incomplete run may hold unlisted files, but not of rank 1 of 1
    (run_dir / S.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="steps.rank1.parquet belongs to a rank beyond "
                                            "layout.world_size 1"):
        open_run(run_dir)


def _drop_samples(path, samples):
    """Rewrite a table file without the records of ``samples`` (a valid file, its digest
    re-recorded)."""
    rewrite_batches(path, lambda parts: [
        p.filter(pc.invert(pc.is_in(p["sample"], pa.array(samples)))) for p in parts])


def test_complete_run_that_lost_a_ranks_samples_is_refused(tmp_path):
    results = spawn(2, tmp_path, "complete", [0, 1, 2, 3])
    assert all("error" not in r for r in results), results
    run_dir = tmp_path / "run"
    assert open_run(run_dir).check() == []
    for table in ("ops", "steps"):  # rank 1's files keep their batches, minus its samples
        _drop_samples(run_dir / S.rank_file(table, 1), [2, 3])
    with pytest.raises(ArtifactError, match=r"marked complete, but no step records of sample\(s\) "
                                            r"\[2, 3\] on rank\(s\) \[1\]"):
        open_run(run_dir).check()
