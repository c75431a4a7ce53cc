"""Artifact writer/reader: round trip, plain-pyarrow readability, crash tolerance, refusals."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from drifttool.artifact import SCHEMA_VERSION, ArtifactWriter, open_run
from drifttool.artifact import schema as S
from drifttool.artifact.parquet import file_digest
from drifttool.capture.recorder import Recorder
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.runner import execute
from drifttool.settings import RunSpec
from drifttool.artifact.parquet import write_parquet
from drifttool.diff import diff_runs
from tests.artifact.table_files import rewrite_batches, rewrite_table, to_streams, write_batches
from tests.diff.diff_synthetic_runs import build_run

TRACE = [{"rank": 0, "device": "cpu", "component": "mmdit", "op": "qk_rmsnorm", "block": 0, "stream": "img", "call": 0, "contract": "q.v1",
          "requested": "strict", "actual": "strict", "kernel": "cpu", "fallback": False,
          "reason": "", "declared": False, "calls": 4}]


def write_run(path, *, steps=3, close=True):
    """A small L2 run through Recorder + ArtifactWriter; ``close=False`` simulates a crash (the
    writer is never closed); an error raised inside closes it incomplete, as a run does."""
    w = ArtifactWriter(path, manifest={"fingerprint": {"arch": {"depth": 1}}, "variants": ["x=y"]})
    try:
        return _record(w, path, steps, close)
    except BaseException:
        w.close(complete=False)
        raise


def _record(w, path, steps, close):
    w.write_inputs({"x_T": torch.arange(6.0).reshape(2, 3), "mask": torch.tensor([True, False])})
    rec = Recorder("L2", w)
    for i in range(steps):
        s = {"phase": "rollout", "step": i, "sigma": 1.0 - i / steps, "branch": "cond", "block": 0,
             "samples": [0, 1], "txt_lens": None, "img_grid": (2, 2), "rank": 0,
             "op": "img_mlp", "stream": "img", "call": 0, "op_pos": 0}
        rec.capture(s, torch.full((2, 4, 8), float(i)), "BS.")
        rec.record_step(phase="rollout", step=i, sigma=s["sigma"],
                        sigma_next=1.0 - (i + 1) / steps, sample=0,
                        branch="cfg", quantities={"x_t": torch.full((4, 8), float(i))})
        rec.flush()
    if close:
        w.write_trace(TRACE)
        rec.close(complete=True)
    return path


def test_round_trip(tmp_path):
    run = open_run(write_run(tmp_path / "a"))
    assert run.complete and run.schema_version == SCHEMA_VERSION and run.problems == []
    m = run.manifest
    assert m["fingerprint"] == {"arch": {"depth": 1}} and m["variants"] == ["x=y"]
    names = {"steps": "steps.rank0.parquet", "ops": "ops.rank0.parquet",
             "trace": "trace.rank0.parquet"}
    assert m["files"] == {"inputs": "inputs.safetensors", **{t: [n] for t, n in names.items()},
                          "digests": {n: file_digest(run.path / n) for n in sorted(names.values())}}
    assert sorted(p.name for p in run.path.iterdir()) == sorted(
        ["manifest.json", "inputs.safetensors", *names.values()])  # no stream left
    assert m["layout"] == {"world_size": 1} and run.world_size == 1
    assert run.ops_table().num_rows == 6 and run.steps_table().num_rows == 3
    assert run.trace_rows() == [{**TRACE[0], "rank": 0}]
    inputs = run.inputs()
    assert torch.equal(inputs["x_T"], torch.arange(6.0).reshape(2, 3))
    assert inputs["mask"].dtype == torch.bool
    assert run.check() == []


@pytest.mark.parametrize("table", S.RANK_TABLES)
def test_plain_pyarrow_reads_every_file_with_its_columns_meaning(tmp_path, table):
    """A finished table is a Parquet file that plain pyarrow reads back with the schema as
    written: types, the schema version and every column's meaning (field metadata)."""
    write_run(tmp_path / "a")
    t = pq.read_table(tmp_path / "a" / S.rank_file(table, 0))
    assert t.schema.metadata[b"drifttool.schema_version"] == str(SCHEMA_VERSION).encode()
    assert t.schema.metadata[b"drifttool.table"] == table.encode()
    assert t.schema.equals(S.SCHEMAS[table], check_metadata=True)
    assert all(f.metadata[b"description"] for f in t.schema) and t.num_rows > 0
    assert pq.ParquetFile(tmp_path / "a" / S.rank_file(table, 0)).num_row_groups == (
        3 if table != "trace" else 1)  # one row group per step


def test_manifest_says_incomplete_until_closed(tmp_path):
    w = ArtifactWriter(tmp_path / "a", manifest={"fingerprint": {}})
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["complete"] is False
    w.update_manifest(seconds=1.5)
    assert open_run(tmp_path / "a").manifest["seconds"] == 1.5
    w.close(complete=True, wall_s=1.5)
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["complete"] is True and m["wall_s"] == 1.5 and m["schema_version"] == SCHEMA_VERSION
    assert not list((tmp_path / "a").glob("*.tmp"))
    with pytest.raises(ArtifactError, match="closed"):
        w.write_trace([])


def test_crash_leaves_finished_steps_readable(tmp_path):
    path = write_run(tmp_path / "a", close=False)
    ops = path / "ops.rank0.arrows"
    ops.write_bytes(ops.read_bytes()[:-40])  # cut inside the third batch
    run = open_run(path)
    assert not run.complete
    t = run.ops_table()
    assert t.num_rows == 4 and sorted(set(t.column("step").to_pylist())) == [0, 1]
    assert run.steps_table().num_rows == 3  # whole batches, just no end-of-stream marker
    problems = run.check()
    assert any("ops.rank0.arrows: truncated after 2 complete batches" in p for p in problems)
    assert any("steps.rank0.arrows: stream not closed after 3 batches" in p for p in problems)
    assert run.trace_rows() == []  # never written


def test_a_stream_cut_in_its_header_is_incomplete_but_a_damaged_header_is_corrupt(tmp_path):
    """A crash can cut a stream only while its header is being written (a short file: an
    incomplete run with nothing from that file); garbage in the header of a file that holds
    batches is corruption, refused in one line."""
    path = write_run(tmp_path / "a", close=False)
    ops = path / "ops.rank0.arrows"
    data = ops.read_bytes()
    ops.write_bytes(data[:20])  # killed while the header was written
    run = open_run(path)
    assert run.ops_table().num_rows == 0
    assert any("ops.rank0.arrows: unreadable header" in p for p in run.check())
    bad = bytearray(data)
    bad[10:110] = bytes(range(100))  # the header overwritten, the batches still there
    ops.write_bytes(bytes(bad))
    with pytest.raises(ArtifactError, match="stream header is damaged"):
        open_run(path).ops_table()


def test_a_process_killed_while_finishing_leaves_a_readable_run(tmp_path):
    """Killed after a stream became Parquet but before it was removed (and before the manifest
    said complete): the incomplete run reads the finished Parquet file, not the stream."""
    path = write_run(tmp_path / "a", close=False)
    with pa.memory_map(str(path / "ops.rank0.arrows")) as src:
        write_parquet(path / "ops.rank0.parquet", pa.ipc.open_stream(src), S.OPS_SCHEMA)
    run = open_run(path)
    assert not run.complete and run.ops_table().num_rows == 6
    assert run.check() == ["steps.rank0.arrows: stream not closed after 3 batches"]


@pytest.mark.parametrize("version", [3, 4])
def test_streams_of_versions_3_and_4_still_read_and_diff_identical(tmp_path, version):
    a, b = build_run(tmp_path / "a"), build_run(tmp_path / "b")
    to_streams(b, version)
    assert sorted(p.suffix for p in b.iterdir()) == [".arrow"] * 3 + [".json", ".safetensors"]
    run = open_run(b)
    assert run.schema_version == version and run.check() == []
    assert diff_runs(open_run(a), run).verdict.value == "identical"


def test_crash_before_any_batch(tmp_path):
    w = ArtifactWriter(tmp_path / "a", manifest={"fingerprint": {}})
    (tmp_path / "a" / "ops.rank0.arrows").write_bytes(b"")
    run = open_run(w.path)
    assert run.ops_table().num_rows == 0 and run.steps_table().num_rows == 0
    assert run.problems == ["ops.rank0.arrows: empty (no batch written)"]


def test_cut_file_in_complete_run_is_an_error(tmp_path):
    path = write_run(tmp_path / "a")
    ops = path / "ops.rank0.parquet"
    ops.write_bytes(ops.read_bytes()[:-8])  # the footer's length and magic number missing
    with pytest.raises(ArtifactError, match="bytes differ from the digest the manifest records"):
        open_run(path).ops_table()
    (path / "steps.rank0.parquet").unlink()
    with pytest.raises(ArtifactError, match="complete run lacks steps.rank0.parquet"):
        open_run(path).steps_table()


def test_parquet_damage_the_digest_misses_is_refused(tmp_path):
    """Bytes the Parquet footer does not account for, a file that is no Parquet, and a file left
    by a process that died before the manifest recorded its digest: refused, never parsed as
    records."""
    path = write_run(tmp_path / "a")
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["digests"].pop("ops.rank0.parquet")
    m["complete"] = False  # a complete run must record every digest (files_problem)
    (path / "manifest.json").write_text(json.dumps(m))
    ops = path / "ops.rank0.parquet"
    good = ops.read_bytes()
    ops.write_bytes(good + good)
    with pytest.raises(ArtifactError, match="bytes that its Parquet footer does not account for"):
        open_run(path).ops_table()
    ops.write_bytes(b"garbage" * 10)
    with pytest.raises(ArtifactError, match="not a readable Parquet file"):
        open_run(path).ops_table()


def test_missing_and_corrupt_directory(tmp_path):
    with pytest.raises(ArtifactError, match="no such artifact directory"):
        open_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="missing manifest.json"):
        open_run(tmp_path / "empty")
    path = write_run(tmp_path / "a")
    (path / "manifest.json").write_text('{"schema_version": 1, "compl')
    with pytest.raises(ArtifactError, match="corrupt manifest") as e:
        open_run(path)
    assert "not JSON" in str(e.value) and "Error" not in str(e.value)  # words, no class name
    (path / "manifest.json").write_text('{"schema_version": NaN}')
    with pytest.raises(ArtifactError, match="corrupt manifest") as e:
        open_run(path)
    assert "NaN" in str(e.value) and "ValueError" not in str(e.value)
    (path / "manifest.json").write_text('[1, 2]')
    with pytest.raises(ArtifactError, match="not a JSON object"):
        open_run(path)


def test_corrupt_inputs(tmp_path):
    path = write_run(tmp_path / "a")
    (path / "inputs.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ArtifactError, match="corrupt safetensors"):
        open_run(path).inputs()


def test_unknown_schema_version_refused(tmp_path):
    path = write_run(tmp_path / "a")
    m = json.loads((path / "manifest.json").read_text())
    m["schema_version"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="schema_version 99 was written by a newer drifttool"):
        open_run(path)
    # an Arrow file of another version inside a supported manifest
    m["schema_version"] = SCHEMA_VERSION
    (path / "manifest.json").write_text(json.dumps(m))
    old = S.OPS_SCHEMA.with_metadata({b"drifttool.schema_version": b"0"})
    write_batches(path / "ops.rank0.parquet", [], old)
    with pytest.raises(ArtifactError, match="schema_version 0 is not a drifttool schema version"):
        open_run(path).ops_table()


def test_older_schema_version_says_re_run(tmp_path):
    """Version 2 keyed records on the rank and ordered them by a per-rank counter: refused with
    one line saying to re-run (or reseal), from the manifest and from an Arrow file alike."""
    path = write_run(tmp_path / "a")
    m = json.loads((path / "manifest.json").read_text())
    m["schema_version"] = 2
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as e:
        open_run(path)
    msg = str(e.value)
    assert "\n" not in msg and "schema_version 2 was written by an older drifttool" in msg
    assert f"reads version {SCHEMA_VERSION}" in msg and "re-run it (a fixture: reseal it)" in msg
    m["schema_version"] = SCHEMA_VERSION
    (path / "manifest.json").write_text(json.dumps(m))
    old = S.STEPS_SCHEMA.with_metadata({b"drifttool.schema_version": b"2"})
    write_batches(path / "steps.rank0.parquet", [], old)
    with pytest.raises(ArtifactError, match="steps.rank0.parquet: schema_version 2 was written by "
                                            "an older drifttool"):
        open_run(path).steps_table()


def test_writer_refusals(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not empty"):
        ArtifactWriter(tmp_path / "x")
    with pytest.raises(ArtifactError, match="not empty"):
        ArtifactWriter(tmp_path / "x", overwrite=True)  # not an artifact: never removed
    write_run(tmp_path / "a")
    ArtifactWriter(tmp_path / "a", {"fingerprint": {}}, overwrite=True).close(complete=True)
    assert open_run(tmp_path / "a").ops_table().num_rows == 0
    w = ArtifactWriter(tmp_path / "b")
    with pytest.raises(ValueError, match="missing"):
        w.write_ops({"seq": [1]}, rank=0)
    with pytest.raises(ValueError, match="unknown keys"):
        w.write_trace([{**TRACE[0], "extra": 1}])
    with pytest.raises(ValueError, match="JSON"):
        w.update_manifest(bad=object())


def test_overwrite_leaves_a_sealed_fixtures_expected_run_alone(tmp_path):
    expected = write_run(tmp_path / "fx" / "expected")
    before = {p.name: p.read_bytes() for p in expected.iterdir()}
    (tmp_path / "fx" / "seal.json").write_text("{}")
    with pytest.raises(ArtifactError, match=r"expected: inside the sealed fixture .*fx, whose seal a run there"):
        ArtifactWriter(expected, {"fingerprint": {}}, overwrite=True)
    assert {p.name: p.read_bytes() for p in expected.iterdir()} == before
    for new in (tmp_path / "fx" / "runs" / "a", tmp_path / "fx"):  # a new run inside it, or the fixture itself
        with pytest.raises(ArtifactError, match=r"inside the sealed fixture .*fx.*--rebuild"):
            ArtifactWriter(new, {"fingerprint": {}})
    assert sorted(p.name for p in (tmp_path / "fx").iterdir()) == ["expected", "seal.json"]
    (tmp_path / "fx" / "seal.json").unlink()  # not sealed: an ordinary run, replaced
    ArtifactWriter(expected, {"fingerprint": {}}, overwrite=True).close(complete=True)
    assert open_run(expected).ops_table().num_rows == 0


def test_one_lookup_finds_the_sealed_fixture_above_a_path(tmp_path, monkeypatch):
    """``sealed_above``: the fixture folder itself, a path not made yet inside it and one reached
    through a link into it are inside; ``..`` out of it is not. A run's overwrite
    (``claim``) and the CLI's output paths (``cli._paths``) both ask it."""
    from drifttool.artifact import directory
    from drifttool.cli import _paths
    from drifttool import fixture

    fx = tmp_path / "fx"
    (fx / "expected").mkdir(parents=True)
    (fx / "seal.json").write_text("{}")
    (tmp_path / "link").symlink_to(fx / "expected")
    assert fixture.sealed_above(fx) == fx.resolve()
    assert fixture.sealed_above(fx / "expected" / "new" / "r.html") == fx.resolve()
    assert fixture.sealed_above(tmp_path / "link" / "r.html") == fx.resolve()
    assert fixture.sealed_above(fx / "expected" / ".." / ".." / "out") is None
    assert fixture.sealed_above(tmp_path) is None

    asked = []
    run = write_run(tmp_path / "run")
    monkeypatch.setattr(directory, "sealed_above", lambda p: asked.append(p) or tmp_path / "fake")
    monkeypatch.setattr(fixture, "sealed_above", lambda p: asked.append(p) or tmp_path / "fake")
    with pytest.raises(ArtifactError, match="inside the sealed fixture .*fake"):
        directory.claim(run, overwrite=True)
    with pytest.raises(DriftToolError, match="inside the sealed fixture .*fake"):
        _paths.output_dir(tmp_path / "out", "-o")
    assert asked == [run, tmp_path / "out"]


def test_complete_run_missing_a_named_sample_is_refused(tmp_path):
    """A complete one-process run whose files lost every record of a sample of its batch
    (``settings.samples``) is damaged: the diff must not compare the samples left as if the run
    had only those."""
    execute(RunSpec(capture="L1"), tmp_path / "r")
    assert open_run(tmp_path / "r").check() == []
    for table in ("ops", "steps"):
        rewrite_table(tmp_path / "r" / S.rank_file(table, 0),
                      lambda t: t.filter(pc.not_equal(t["sample"], 1)))
    with pytest.raises(ArtifactError, match=r"no step records of sample\(s\) \[1\] "
                                            r"\(settings.samples names them\)"):
        open_run(tmp_path / "r").check()


def test_complete_run_whose_op_file_lost_its_last_step_is_refused(tmp_path):
    """An op file without its last step is a valid file: the check compares the steps it covers
    with the step records' (L1 and finer) and refuses the run."""
    execute(RunSpec(capture="L1"), tmp_path / "r")
    rewrite_batches(tmp_path / "r" / S.rank_file("ops", 0), lambda bs: bs[:-1])
    with pytest.raises(ArtifactError, match=r"ops.rank0 has no records of rollout step 3 sample 0"):
        open_run(tmp_path / "r").check()


def test_complete_run_cut_at_a_step_boundary_or_without_its_trace_is_refused(tmp_path):
    """Every file a valid one, yet the run lost its last step (ops and steps alike),
    or a rank that ran the model has an empty trace: a complete run says otherwise — refused."""
    execute(RunSpec(capture="L1"), tmp_path / "r")
    for table in ("ops", "steps"):
        rewrite_batches(tmp_path / "r" / S.rank_file(table, 0), lambda bs: bs[:-1])
    with pytest.raises(ArtifactError, match=r"no step records of step 3 \(settings.steps 4\)"):
        open_run(tmp_path / "r").check()
    execute(RunSpec(capture="L0"), tmp_path / "t")
    rewrite_batches(tmp_path / "t" / S.rank_file("trace", 0), lambda bs: [])
    with pytest.raises(ArtifactError, match=r"trace.rank0 holds no call sites"):
        open_run(tmp_path / "t").check()


@pytest.mark.parametrize("complete", [True, False])
def test_a_manifest_that_says_fewer_steps_than_its_records_is_refused(tmp_path, complete):
    """settings.steps edited down (4 → 2) leaves records of steps 2 and 3 the manifest does not
    cover: refused, complete or not, instead of diffed IDENTICAL on part of them."""
    execute(RunSpec(capture="L0"), tmp_path / "r")
    path = tmp_path / "r" / "manifest.json"
    m = json.loads(path.read_text())
    m["settings"]["steps"], m["complete"] = 2, complete
    path.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"step records of step 3, past settings.steps 2 \(steps 0..1\)"):
        open_run(tmp_path / "r").check()
