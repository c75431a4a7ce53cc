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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refusal_leaves_the_tree_alone(tmp_path):
    """The check links cli/, fixtures/, ... into drifttool/ for its tests; a refusal must not, even
    for a moment: this suite's other workers import drifttool from the same tree meanwhile. A
    ``python3`` shim records, at each call, which of those links exist."""
    shim = tmp_path / "bin"
    shim.mkdir()
    seen = tmp_path / "seen.txt"
    (shim / "python3").write_text(
        "#!/usr/bin/env bash\n"
        f"for s in cli probes references fixtures; do [ -L drifttool/$s ] && echo $s >> {seen}; done\n"
        f'exec {sys.executable} "$@"\n')
    (shim / "python3").chmod(0o755)
    p = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), str(tmp_path / "out")], cwd=ROOT,
                       env={**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert not seen.exists(), f"links made before the refusal: {seen.read_text().split()}"


def test_wheels_script_names_what_the_check_installs():
    text = (ROOT / ".ci" / "gpu-wheels").read_text()
    assert '"diffusers==0.42.1"' in text
    assert "diffusers 0.42" in (ROOT / ".ci" / "gpu").read_text()
