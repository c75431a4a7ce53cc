"""The host-memory watchdog of every command (``cli._memory_guard``): when the host's available
memory falls below its floor mid-run, the run stops in one ``error: out of host memory`` line,
exit 2, its directory kept readable and ``complete: false`` with the steps it finished, where the
kernel's out-of-memory killer would have ended the process without a word (``run --batch 100000``
on the tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from drifttool.artifact import open_run
from drifttool.cli import _memory_guard
from drifttool.host_memory import HostMemory, host_meminfo
from tests.conftest import one_error_line


def test_the_floor_is_the_larger_of_its_bytes_and_fraction():
    assert _memory_guard.floor(1 << 30) == _memory_guard.FLOOR_BYTES
    assert _memory_guard.floor(1 << 40) == int((1 << 40) * _memory_guard.FLOOR_FRACTION)


def _rows(stream: Path) -> int:
    """Rows of the record batches written whole so far to the Arrow stream ``stream`` (0 while
    it is missing or holds its schema only)."""
    try:
        with pa.ipc.open_stream(stream) as reader:
            return sum(batch.num_rows for batch in reader)
    except (OSError, pa.ArrowInvalid):  # missing, or a batch being written: what was whole
        return 0


def test_a_run_whose_host_memory_runs_low_stops_in_one_line_and_keeps_its_steps(cli, tmp_path, monkeypatch):
    out = tmp_path / "r"
    total = 64 << 30

    def meminfo(path=None):  # plenty until the run has written its first step, then too little
        # (above half the floor: the in-process run is not ended). The stream file exists from the
        # run's start, schema only: its first record batch is the first step written
        return HostMemory((2000 << 20) if _rows(out / "steps.rank0.arrows") else (32 << 30), total)

    monkeypatch.setattr(_memory_guard, "host_meminfo", meminfo)
    code, text = cli("run", "--steps", "400", "--capture", "L0", "-o", out)
    one_error_line(code, text, "out of host memory", "available memory fell to 2000 MiB of 65536 MiB")
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert open_run(out).steps_table().num_rows > 0  # the finished steps are readable


def test_without_meminfo_nothing_is_watched(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(_memory_guard, "host_meminfo", lambda path=None: None)
    code, text = cli("run", "--steps", "2", "--capture", "L0", "-o", tmp_path / "r")
    assert code == 0, text
    assert host_meminfo(str(tmp_path / "missing")) is None



_STUCK = """
import signal
import time
from drifttool.cli import _errors, _memory_guard
from drifttool.host_memory import HostMemory

t0 = time.monotonic()
falling = lambda path=None: HostMemory(({mib} << 20) if time.monotonic() - t0 > 0.3 else (32 << 30), 64 << 30)
_memory_guard.host_meminfo = falling
_memory_guard.GRACE_SECONDS = {grace}


def stuck():  # as one native call: the signal reaches another thread, the handler waits for this one
    signal.pthread_sigmask(signal.SIG_BLOCK, {{_memory_guard.SIGNAL}})
    print("started", flush=True)
    time.sleep(60)


_errors.user_errors(stuck, command="run")()
"""


@pytest.mark.parametrize("mib, grace", [(40, 60.0), (2000, 0.5)], ids=["below half the floor", "the grace"])
def test_a_main_thread_stuck_in_one_native_call_is_ended_by_the_watchdog(tmp_path, mib, grace):
    """Python runs the signal's handler in the main thread, between bytecodes: a main thread
    inside one long native call (a large tensor operation) never raised, and the kernel's
    out-of-memory killer ended ``run --batch 100000`` without a word. The watchdog ends the
    process itself, in one line, exit 2: at once when the memory falls below half the floor,
    else after its grace (here the floor of a 64 GiB host is 2.56 GiB)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "stuck.py"
    script.write_text(_STUCK.format(mib=mib, grace=grace))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert res.returncode == _memory_guard.EXIT_CODE, (res.returncode, res.stderr)
    assert res.stdout == "started\n"
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: out of host memory: the host's available memory fell to {mib} MiB of 65536 MiB"), res.stderr
    assert took < 40, took  # not the 60 s sleep's end, after which the handler would have raised


def test_a_stop_right_after_a_batch_is_written_writes_it_once(cli, tmp_path, monkeypatch):
    """An exception raised between a batch's write and the recorder's emptying of its buffer (the
    watchdog's ``MemoryError``, Ctrl-C: both land between any two bytecodes) left the records
    buffered, and the close of the stopped run wrote them again: the run's steps were unreadable
    (``duplicated record(s)``). Here Ctrl-C lands right after the second step batch is written."""
    from drifttool.artifact.writer import ArtifactWriter

    write, calls = ArtifactWriter.write_steps, []

    def then_interrupted(self, batch):
        write(self, batch)
        calls.append(batch.num_rows)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ArtifactWriter, "write_steps", then_interrupted)
    out = tmp_path / "r"
    code, text = cli("run", "--steps", "4", "--capture", "L0", "-o", out)
    assert code == 130, text
    run = open_run(out)
    assert not run.complete
    assert run.steps_table().num_rows == sum(calls[:2]) and len(calls) == 2, (calls, text)
