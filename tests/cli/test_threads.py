"""``--threads N``: the computing commands take it, strict bytes do not depend on it, and test
workers (and the processes they start) run one intra-op thread each."""

from __future__ import annotations

import json
import os

import pytest
import torch

from drifttool.cli import _threads
from tests import harness

ARTIFACT_FILES = ("ops.rank0.parquet", "steps.rank0.parquet", "trace.rank0.parquet",
                  "inputs.safetensors")


@pytest.fixture
def keep_threads(monkeypatch):
    """Restore this worker's torch thread count and thread environment after a test that runs
    the CLI with --threads."""
    n = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(n)


def test_strict_bytes_do_not_depend_on_the_thread_count(cli, tmp_path, keep_threads):
    runs = {}
    for n in (1, 2):
        code, out = cli("run", "--threads", n, "-o", tmp_path / f"t{n}")
        assert code == 0, out
        runs[n] = tmp_path / f"t{n}"
    for name in ARTIFACT_FILES:
        assert (runs[1] / name).read_bytes() == (runs[2] / name).read_bytes(), name
    m1, m2 = (json.loads((runs[n] / "manifest.json").read_text()) for n in (1, 2))
    # the option took effect, and the environment record (provenance, never compared) is the only
    # place the count appears
    assert (m1["environment"]["torch_threads"], m2["environment"]["torch_threads"]) == (1, 2)
    for m in (m1, m2):
        del m["environment"]["torch_threads"]
    assert m1 == m2
    code, out = cli("diff", runs[1], runs[2])
    assert code == 0, out


@pytest.mark.parametrize("command", [("run",), ("replay",), ("recompute",), ("probe",), ("diff",),
                                     ("overlay",), ("fixture", "verify"),
                                     ("experiment", "train-rollout"), ("experiment", "grpo")])
def test_every_computing_command_takes_threads(cli, command, keep_threads):
    code, out = cli(*command, "--help")
    assert code == 0 and "--threads" in out, out


def test_threads_below_one_is_one_line_exit_2(cli, tmp_path, keep_threads):
    code, out = cli("run", "--threads", "0", "-o", tmp_path / "r")
    assert code == 2 and "--threads" in out and "Traceback" not in out, out
    assert not (tmp_path / "r").exists()


def test_default_is_the_environment_count_else_at_most_four_cores():
    assert _threads.default_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert _threads.default_threads({}) == min(4, _threads.usable_cores())
    assert _threads.default_threads({"OMP_NUM_THREADS": "x"}) == min(4, _threads.usable_cores())


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="runs under pytest-xdist only")
def test_each_xdist_worker_and_its_children_use_one_thread():
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
    assert _threads.default_threads() == 1  # the CLI, run in this worker, keeps one thread
    assert harness.torchrun_env()["OMP_NUM_THREADS"] == "1"


def test_without_torch_loaded_the_count_goes_to_the_environment(monkeypatch):
    """diff, trace and overlay never import torch: the option then only sets what torch reads
    when it is first imported."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.delitem(__import__("sys").modules, "torch")
    assert _threads.apply_threads(3) == 3
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "3"
