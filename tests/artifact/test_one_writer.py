"""One writer per artifact directory: while a run writes into a directory, a second
``drifttool run`` given it (with ``--overwrite`` too) exits 2 with one line saying another run
holds it, and leaves the first run's files alone. Two real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HOLD = """
import sys
from drifttool.artifact.writer import ArtifactWriter
w = ArtifactWriter(sys.argv[1], manifest={"kind": "rollout"})
print("open", flush=True)
sys.stdin.read()  # hold the directory until the test closes our stdin
w.close(complete=False)
"""


def _run(out, *args):
    return subprocess.run([sys.executable, "-m", "drifttool", "run", "-o", str(out), "--steps", "2",
                           "--capture", "L0", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # four drifttool processes beside a holder (about 10 s)
def test_a_second_run_on_a_held_directory_exits_2_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for extra in ((), ("--overwrite",)):
            res = _run(out, *extra)
            assert res.returncode == 2, res.stderr
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") \
                and "another drifttool run holds it" in lines[0], res.stderr
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    res = _run(out, "--overwrite")  # the holder closed: the directory is free again
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
