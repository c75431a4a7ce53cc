"""A run whose finishing step fails (Ctrl-C or a full disk while a stream becomes Parquet) reports
its own error (exit 130, or one ``error:`` line and exit 2), never ``internal error: ValueError:
write to closed file`` from closing the already closed streams again; the run stays readable,
incomplete."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from drifttool.artifact import writer as W
from drifttool.cli.app import app


@pytest.mark.parametrize("failure, code", [(KeyboardInterrupt, 130),
                                           (lambda: OSError(28, "No space left on device",
                                                            "x.parquet"), 2)])
def test_a_failure_while_finishing_is_reported_as_itself(tmp_path, monkeypatch, failure, code):
    def finish(self):
        raise failure()

    monkeypatch.setattr(W._Stream, "finish", finish)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "--steps", "2", "-o", str(out)])
    assert res.exit_code == code, res.output
    assert "internal error" not in res.output
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    monkeypatch.undo()
    diff = CliRunner().invoke(app, ["diff", str(out), str(out)])
    assert diff.exit_code == 3, diff.output  # inconclusive: the run is incomplete
