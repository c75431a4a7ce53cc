"""A run killed mid-way (a real process ended with ``os._exit`` after its first step): ``trace``
says the trace is missing and the run incomplete (exit 2); ``replay`` re-executes only the steps
the run finished and marks the replay incomplete too, saying so (notes on stderr: stdout keeps the
summary and the trace table)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KILL_AFTER_STEP_0 = """
import os, sys
from drifttool.runner import execute
from drifttool.settings import RunSpec
execute(RunSpec(capture="L0"), sys.argv[1], on_step=lambda out: os._exit(9))
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    out = tmp_path_factory.mktemp("killed") / "run"
    res = subprocess.run([sys.executable, "-c", KILL_AFTER_STEP_0, str(out)], timeout=300)
    assert res.returncode == 9
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    return out


def test_trace_of_a_killed_run_says_it_is_missing(cli, killed):
    code, out = cli("trace", killed)
    assert code == 2, out
    assert "no operator trace" in out and "incomplete" in out and "0 call sites" not in out


def test_replay_of_a_killed_run_replays_its_finished_steps_only(cli, killed, tmp_path):
    code, out = cli("replay", killed, "-o", tmp_path / "r")
    assert code == 0, out
    assert "replayed the 1 of its 4 steps it finished" in " ".join(out.split()), out
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["complete"] is False and m["replay_of"]["complete"] is False
    from drifttool.artifact import open_run

    steps = {r["step"] for r in open_run(tmp_path / "r").steps_table().to_pylist()}
    assert steps == {0}


def test_the_notes_on_a_cut_run_go_to_stderr(killed, tmp_path):
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    res = CliRunner().invoke(app, ["replay", str(killed), "-o", str(tmp_path / "r")])
    assert res.exit_code == 0 and "the source run is incomplete" in " ".join(res.stderr.split()), res.output
    assert "note:" not in res.stdout, res.stdout
    res = CliRunner().invoke(app, ["trace", str(tmp_path / "r")])  # a replay of one step: its trace exists
    assert res.exit_code == 0, res.output
    assert "note: the run is incomplete" in res.stderr and "note:" not in res.stdout, res.output


KILL_IN_STEP_0 = """
import os, sys
from drifttool.model import mmdit
from drifttool.runner import execute
from drifttool.settings import RunSpec
mmdit.MMDiT.forward = lambda *a, **k: os._exit(9)
execute(RunSpec(capture="L0"), sys.argv[1])
"""


def test_replay_of_a_run_killed_before_its_first_step_is_refused(cli, tmp_path):
    out = tmp_path / "run"
    assert subprocess.run([sys.executable, "-c", KILL_IN_STEP_0, str(out)], timeout=300).returncode == 9
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    code, text = cli("replay", out, "-o", tmp_path / "r")
    assert code == 2 and "nothing to replay" in text and "0 of its 4" in " ".join(text.split()), text
    assert not (tmp_path / "r").exists()
