"""``torchrun --standalone --nproc-per-node 2`` (the launcher the runner will use) writes one
complete sample-parallel artifact from its environment alone (``context.launch_env`` reads the
variables the real launcher sets)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from drifttool.artifact import open_run

_TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.mark.slow  # 5-15 s of rendezvous and imports; test_multirank_artifact covers the writer
def test_torchrun_writes_one_complete_artifact(tmp_path):
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path]),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    for attempt in (1, 2):
        out = tmp_path / f"run{attempt}"
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", str(here / "torchrun_job.py"), str(out),
                            "5,6,7"], env=env, capture_output=True, text=True, timeout=120)
        # Once in many CI runs a rank aborted in torch's gloo teardown at process exit ("terminate
        # called without an active exception", SIGABRT; not reproduced in 58 local runs, 8 at a time): one
        # retry for that signature only; any other failure, or the same twice, fails the test
        if p.returncode == 0 or _TEARDOWN_ABORT not in p.stdout + p.stderr or attempt == 2:
            break
    assert p.returncode == 0, p.stdout + p.stderr
    run = open_run(out)
    assert run.complete and run.world_size == 2 and run.check() == []
    assert run.manifest["layout"]["samples"] == {"0": [5, 6], "1": [7]}
    steps = run.steps_table()
    assert sorted(zip(steps["rank"].to_pylist(), steps["sample"].to_pylist())) == sorted(
        (r, s) for r, ss in ((0, [5, 6]), (1, [7])) for s in ss for _ in range(3))
