"""``.ci/gpu``, the GPU check CI cannot run: on a machine without CUDA it refuses in one line (exit
2) before running anything; the diffusers it requires is the one ``.ci/gpu-wheels`` fetches."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check(tmp_path, **env):
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # python3 = this python
    return subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), str(tmp_path / "out")],
                          env={**os.environ, "PATH": path, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_in_one_line(tmp_path):
    p = _gpu_check(tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = (p.stdout + p.stderr).splitlines()
    assert lines == ["error: no CUDA device: .ci/gpu checks the GPU paths (CI runs the CPU ones)"]
    assert not (tmp_path / "out" / "gpu-junit.xml").exists()  # nothing ran


def test_wheels_script_names_what_the_check_installs():
    text = (ROOT / ".ci" / "gpu-wheels").read_text()
    assert '"diffusers==0.42.1"' in text
    assert "diffusers 0.42" in (ROOT / ".ci" / "gpu").read_text()
