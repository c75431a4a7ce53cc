"""The op records' rank columns (schema version 4) in the diff: a version 3 artifact reads with
them null and still aligns; a TP/SP run whose outputs were not checked on every rank gets no
origin claim (docs/distributed.md, "Every rank checked")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.diff import diff_runs
from drifttool.errors import ArtifactError
from tests.artifact.table_files import to_streams


def as_version_3(path: Path, layout: dict | None = None) -> Path:
    """Rewrite the artifact at ``path`` as schema version 3 wrote it (streams, no rank columns),
    with ``layout`` merged into its manifest's layout."""
    to_streams(path, 3)
    m = json.loads((path / "manifest.json").read_text())
    m["layout"] = {**m.get("layout", {}), **(layout or {})}
    (path / "manifest.json").write_text(json.dumps(m))
    return path


def test_version_3_reads_with_null_rank_columns_and_aligns(make_run):
    a = make_run("a")
    b = as_version_3(make_run("b"))
    run = open_run(b)
    ops = run.ops_table()
    assert run.schema_version == 3 and ops.schema.equals(S.OPS_SCHEMA, check_metadata=False)
    assert ops["rank_disagree"].null_count == ops["rank_digests"].null_count == ops.num_rows > 0
    report = diff_runs(open_run(a), run)
    assert report.verdict.value == "identical", report.reason


def test_version_2_is_still_refused(make_run):
    b = make_run("b")
    m = json.loads((b / "manifest.json").read_text())
    m["schema_version"] = 2
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="schema_version 2 was written by an older drifttool"):
        open_run(b)


def test_no_origin_past_outputs_not_checked_on_every_rank(make_run):
    plant = {"step": 1, "block": 0, "op": "img_mlp", "sample": 1, "row": 2}
    a = make_run("a")
    checked = diff_runs(open_run(a), open_run(make_run("b", plant=plant)))
    assert checked.first_drift.origin_kind == "record"
    tp2 = {"kind": "parallel", "tp": 2, "sp": 1, "cfg_parallel": 1}
    b = as_version_3(make_run("c", plant=plant), tp2)
    report = diff_runs(open_run(a), open_run(b))
    fd = report.first_drift
    assert (fd.step, fd.block, fd.op) == (1, 0, "img_mlp")
    assert fd.origin_kind == "unchecked" and not fd.origin
    assert "not checked on every rank" in report.reason
