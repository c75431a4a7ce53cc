"""SIGTERM during a command unwinds it as Ctrl-C does: ``fixture verify``'s temporary re-run is
removed (nothing left under the temporary folder) and the exit status is 143."""

import os
import signal
import subprocess
import sys
import time


def test_sigterm_during_fixture_verify_removes_its_temporary_rerun(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "drifttool", "fixture", "verify", "tiny-t2i"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("drifttool-verify-*")):  # the re-run has started
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, err.decode()[-2000:])
    assert "Traceback" not in err.decode(), err.decode()[-2000:]
    assert err.decode().strip().splitlines()[-1] == "terminated (SIGTERM)"  # its re-run is gone
    assert not list(tmp_path.glob("drifttool-verify-*")), list(tmp_path.iterdir())
