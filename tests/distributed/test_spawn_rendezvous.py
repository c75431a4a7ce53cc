"""Spawned ranks meet at a store the parent already holds: its port is bound before any rank
starts and stays bound while they run, so two launches (two test workers) never pick the same
port (a port picked free, released and bound later by rank 0 could be taken in between)."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import pytest

from drifttool import launch
from drifttool.distributed import spawn
from drifttool.distributed.plan import ParallelDims
from drifttool.settings import RunSpec


def test_the_rendezvous_port_is_bound_before_the_ranks_start(monkeypatch, tmp_path):
    seen = {}

    def fake_spawn(fn, *, nprocs, join, args):
        world, port, errors = args[0], args[1], args[2]
        with socket.socket() as s:  # another process trying the same port now must fail
            with pytest.raises(OSError) as e:
                s.bind((spawn.LOOPBACK, port))
        seen.update(world=world, errno=e.value.errno, env=spawn.rank_environment(1, world, port))
        Path(errors, "summary.json").write_text(json.dumps({"complete": True}))

    monkeypatch.setattr(launch.mp, "spawn", fake_spawn)
    assert launch.run_parallel(RunSpec(), tmp_path / "r", ParallelDims(tp=2))["complete"]
    assert seen["world"] == 2 and seen["errno"] == errno.EADDRINUSE
    assert seen["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # every rank a client
