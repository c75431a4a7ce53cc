"""``--clip-range`` on ``drifttool probe`` and ``drifttool experiment train-rollout``: each probe's or
combination's log-prob drift against the clip range, as ``drifttool diff --clip-range`` reports it
(``drifttool.diff.clip``), in the table, ``--json``, matrix.json/.arrow and train_rollout.json."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from drifttool.artifact.reader import open_run
from drifttool.cli.app import app
from drifttool.diff.clip import CLIP_FIELDS, clip_summary
from drifttool.diff.compare import diff_runs
from drifttool.probes.matrix import MATRIX_SCHEMA, read_matrix


def _cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip") / "m"
    code, text = _cli("probe", "--only", "cfg_renorm_off,repeat", "--clip-range", "1e-4", "--json",
                      "-o", out, "--no-heatmaps")
    return code, text, out


def test_probe_json_and_matrix_hold_each_probes_clip_drift(clipped):
    code, text, out = clipped
    assert code == 0, text
    data = json.loads(text)
    assert data["settings"]["clip_range"] == 1e-4
    by = {r["name"]: r for r in data["results"]}
    for name, r in by.items():  # the diff's own clip drift of that pair, field for field
        want = clip_summary(diff_runs(open_run(out / "runs" / "baseline"), open_run(r["run_dir"]),
                                      clip_range=1e-4).clip)
        assert {k: r[k] for k in CLIP_FIELDS} == want, name
    assert by["repeat"]["clip_verdict"] == "below" and by["repeat"]["clip_ratio_dev_max"] == 0.0
    drift = by["cfg_renorm_off"]
    assert drift["clip_ratio_dev_max"] > 0 and drift["clip_verdict"] in ("below", "above")
    assert drift["clip_fraction"] == pytest.approx(drift["clip_ratio_dev_max"] / 1e-4)
    assert drift["clip_worst"].startswith("rollout step ")
    table = read_matrix(out / "matrix.arrow")
    assert table.schema.equals(MATRIX_SCHEMA)
    assert table.column("clip_verdict").to_pylist() == [by[n]["clip_verdict"] for n in
                                                        table.column("name").to_pylist()]
    assert json.loads((out / "matrix.json").read_text())["matrix_version"] == 3


def test_probe_table_shows_the_share_of_the_clip_range(clipped, tmp_path):
    code, text = _cli("probe", "--only", "repeat", "--clip-range", "0.2", "-o", tmp_path / "t",
                      "--no-heatmaps")
    assert code == 0, text
    assert "of clip" in text and "0.2" in text


def test_without_a_clip_range_the_fields_are_null(tmp_path):
    code, text = _cli("probe", "--only", "repeat", "--json", "-o", tmp_path / "n", "--no-heatmaps")
    assert code == 0, text
    (r,) = json.loads(text)["results"]
    assert all(r[k] is None for k in CLIP_FIELDS) and "clip_range" not in json.loads(text)["settings"]


@pytest.mark.parametrize("bad", ["0", "-1e-4", "nan", "inf"])
@pytest.mark.parametrize("command", [["probe", "--only", "repeat"],
                                     ["experiment", "train-rollout", "--combos", "strict/strict"]])
def test_a_bad_clip_range_is_one_line_and_exit_2(tmp_path, bad, command):
    out = tmp_path / "o"
    code, text = _cli(*command, "--clip-range", bad, "-o", out)
    assert code == 2 and "clip range must be a finite number > 0" in text, text
    assert len(text.strip().splitlines()) == 1 and not out.exists()


def test_experiment_train_rollout_reports_each_combination_against_the_clip_range(tmp_path):
    out = tmp_path / "exp"
    code, text = _cli("experiment", "train-rollout", "-o", out, "--no-grad", "--combos",
                      "strict/strict,production/strict", "--clip-range", "1e-4")
    assert code == 0, text
    assert "log-prob drift against the clip range 0.0001" in text
    rows = {r["combo"]: r for r in json.loads((out / "train_rollout.json").read_text())}
    for combo, r in rows.items():
        want = clip_summary(diff_runs(open_run(r["rollout_dir"]), open_run(r["train_dir"]),
                                      clip_range=1e-4).clip)
        assert {k: r[k] for k in CLIP_FIELDS} == want, combo
    assert rows["strict/strict"]["clip_ratio_dev_max"] == 0.0
    assert rows["strict/strict"]["clip_verdict"] == "below"
    assert rows["production/strict"]["clip_ratio_dev_max"] > 0
    table = pa.ipc.open_stream(open(out / "train_rollout.arrow", "rb")).read_all()
    assert table.column("clip_range").to_pylist() == [1e-4, 1e-4]
    assert json.loads((out / "train_rollout.settings.json").read_text())["clip_range"] == 1e-4


def test_a_clip_cell_above_the_range_is_red_text_not_markup():
    """The table's cells print as written (no rich markup, so a kernel id's brackets show): the
    share of the clip range is styled red itself."""
    from types import SimpleNamespace

    from drifttool.diff.clip import percent
    from drifttool.probes.matrix import _clip_cell

    cell = _clip_cell(SimpleNamespace(clip_fraction=2.0, clip_ratio_dev_max=1e-3, clip_verdict="above"))
    assert cell.plain == percent(2.0) and str(cell.style) == "red"
