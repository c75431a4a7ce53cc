"""A run stopped by Ctrl-C (SIGINT) or SIGTERM: exit 130 or 143 with one line on stderr naming
the run directory, kept and marked incomplete; every ``--help`` lists both exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from drifttool.exit_codes import EXIT_HELP, MEANINGS, ExitCode
from tests.cli.scripting import console_script, invoke


def test_exit_help_lists_every_exit_code():
    for code in ExitCode:
        assert f" {int(code)} {MEANINGS[code]}" in EXIT_HELP, code
    assert EXIT_HELP.endswith(", 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).")
    res = invoke("run", "--help", env={"COLUMNS": "400"})
    assert "143 terminated (SIGTERM)" in res.output


@pytest.mark.parametrize("signum, code, line", [
    (signal.SIGTERM, 143, "terminated (SIGTERM)"),
    (signal.SIGINT, 130, "interrupted (Ctrl-C)"),
], ids=["sigterm", "ctrl-c"])
def test_a_stopped_run_says_its_directory_is_kept_incomplete(tmp_path, signum, code, line):
    out = tmp_path / "runs" / "stopped"
    proc = subprocess.Popen(  # a run far longer than the test waits; SIGINT as a shell leaves it
        [console_script(), "run", "--steps", "400", "-o", str(out)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "80"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while not (out / "steps.rank0.arrows").exists():  # its first step is written
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"{line}: the run directory {out} is kept, marked incomplete (complete: false)"), err
    assert "Traceback" not in err
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
