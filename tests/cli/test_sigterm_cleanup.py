"""SIGTERM during a command unwinds it as Ctrl-C does: ``fixture verify``'s temporary re-run is
removed (nothing left under the temporary folder) and the exit status is 143."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drifttool.cli import app as cli_app
from drifttool.cli._errors import SIGNALS

STEP_WRITTEN = "drifttool-verify-*/replay/steps.rank0.arrows"
"""The re-run's first step is in its artifact: its imports are done (a SIGTERM that lands while
Python compiles or initialises a module can be lost, and the command then ends with exit 0)."""


def _state(pid: int) -> str:
    """The state letter in ``/proc/PID/stat`` (``T`` stopped, ``Z`` exited); ``X`` once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"


def _verify_and_terminate(tmp_path) -> tuple[bool, int, str]:
    """Start ``fixture verify``; once its re-run has written its first step, freeze the process
    (SIGSTOP) and, if the re-run folder is still there, send SIGTERM before letting it go on
    (SIGCONT): the signal then lands in the re-run whatever the scheduler does. Returns (SIGTERM
    sent, exit status, stderr). The rest of the re-run and its diff take about 0.6 s; a test
    that falls further behind on a loaded machine sees the verify end (exit 0) before that step
    was seen, or finds the folder gone when it freezes it: no SIGTERM is sent, nothing tested."""
    tmp_path.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "drifttool", "fixture", "verify", "tiny-t2i"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    sent = False
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the re-run wrote no step in 120 s"
        if list(tmp_path.glob(STEP_WRITTEN)):
            proc.send_signal(signal.SIGSTOP)
            while _state(proc.pid) not in "TtZX":
                time.sleep(0.001)
            if list(tmp_path.glob("drifttool-verify-*")):  # frozen inside the re-run
                proc.send_signal(signal.SIGTERM)
                sent = True
            proc.send_signal(signal.SIGCONT)
            break
        time.sleep(0.01)
    _, err = proc.communicate(timeout=120)
    return sent, proc.returncode, err.decode()


def test_sigterm_during_fixture_verify_removes_its_temporary_rerun(tmp_path):
    for attempt in range(3):  # a verify that ended (exit 0) before it could be signalled: again
        sent, code, err = _verify_and_terminate(tmp_path / str(attempt))
        if sent or code != 0:
            break
    assert sent and code == 143, (sent, code, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "terminated (SIGTERM)"  # its re-run is gone
    assert not list((tmp_path / str(attempt)).glob("drifttool-verify-*")), list(tmp_path.iterdir())


def test_a_sigterm_whose_exception_python_lost_still_exits_143(monkeypatch, capsys):
    """A SIGTERM that lands while a module is being imported can lose the handler's exception
    (the command then runs to its end); the handler's flag still makes the exit 143, one line."""
    monkeypatch.setattr(SIGNALS, "sigterm", True)
    with pytest.raises(SystemExit) as e:
        cli_app.build(cli_app.invoked(["--version"]))(["--version"])
    assert e.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "terminated (SIGTERM)"
    monkeypatch.setattr(SIGNALS, "sigterm", False)
    with pytest.raises(SystemExit) as e:
        cli_app.build(cli_app.invoked(["--version"]))(["--version"])
    assert e.value.code == 0


def test_a_run_whose_sigterm_was_lost_stops_after_its_step(monkeypatch, capsys, tmp_path):
    """``drifttool run`` checks the flag after each step: a run whose SIGTERM exception was lost
    stops after the step in progress (not at its end), its artifact kept with that one step and
    marked incomplete, exit 143 and the one line naming it."""
    from drifttool.artifact import open_run

    out = tmp_path / "r"
    monkeypatch.setattr(SIGNALS, "sigterm", True)
    args = ["run", "-o", str(out), "--steps", "4"]
    with pytest.raises(SystemExit) as e:
        cli_app.build(cli_app.invoked(args))(args)
    assert e.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"terminated (SIGTERM): the run directory {out} is kept, marked incomplete (complete: false)")
    run = open_run(out)
    assert run.manifest["complete"] is False
    assert sorted(set(run.steps_table().column("step").to_pylist())) == [0]
