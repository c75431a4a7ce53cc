"""A run directory another process is writing now (its writer holds the directory's lock) is
refused by every reader in one line saying so: its streams end mid-record, and reading it gave
"bytes after the end-of-stream marker", "stopped before it wrote its trace" or a replay of the
steps written so far, by timing. Once the writer has stopped, the run reads as what it left."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.cli.scripting import console_script
from tests.conftest import one_error_line


def test_every_reader_refuses_a_run_being_written(cli, tmp_path):
    out = tmp_path / "writing"
    proc = subprocess.Popen([console_script(), "run", "--steps", "400", "--capture", "L0", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "80"})
    try:
        deadline = time.monotonic() + 180
        while not (out / "steps.rank0.arrows").exists():  # its first step is written
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        for args in (("diff", out, out), ("trace", out), ("replay", out, "-o", tmp_path / "r"),
                     ("report", out, out, "-o", tmp_path / "x.html")):
            code, text = cli(*args)
            one_error_line(code, text, str(out), "a drifttool run is writing it now")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
    code, text = cli("replay", out, "-o", tmp_path / "r2")  # stopped: its finished steps replay
    assert code == 0 and "it finished" in " ".join(text.split()), text
