"""The up-front memory check of a CUDA run reads the device's free memory
(``torch.cuda.mem_get_info``) and refuses, before the model loads, a run whose lower bound
exceeds it; one that fits runs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from drifttool import memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_available_memory_of_a_cuda_device_is_its_free_memory():
    free, total = torch.cuda.mem_get_info(0)
    got = memory.available_bytes("cuda:0")
    assert 0 < got <= total and abs(got - free) < 1 << 30
    assert memory.available_bytes("cuda") <= torch.cuda.mem_get_info()[1]


def test_a_cuda_run_beyond_the_free_memory_is_one_line(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 << 20 if device.startswith("cuda") else None)
    args = ("run", "--device", "cuda", "--mode", "auto", "--height", "4096", "--width", "4096")
    code, out = cli(*args, "-o", tmp_path / "r")
    assert code == 2 and out.startswith("error: 2 samples at --height 4096 --width 4096: the run needs at least 88 MiB, "
                                        "10 MiB available (cuda device memory"), out
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 40)
    code, out = cli("run", "--device", "cuda", "--mode", "auto", "-o", tmp_path / "ok")
    assert code == 0, out
