"""The strict GEMM's launches compiled for sm_90 on a machine without a GPU
(``tools/strict_launches_sm90.py``): every launch the strict operators make fits a block's shared
memory, and the digesting epilogue neither changes a launch's shared memory (its pipelining) nor
adds spills; the check finds a launch the device would refuse (the persistent 128 × 256 kernel
with an FP32 merge: 278,552 bytes, the number an H200 refused). CI has no GPU: this is what it can
see of the kernels' resources."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "strict_launches_sm90.py"


def _ptxas() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.origin).parent / "backends/nvidia/bin/ptxas").exists()


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _ptxas(), reason="Triton with its ptxas is not installed")]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_every_launch_fits_and_the_digest_costs_no_pipelining():
    res = _run(str(TOOL))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert sum(" digest " in line for line in lines) >= 8
    assert not any("FAILED" in line or "changed" in line for line in lines)


def test_the_attention_kernels_compile_and_the_digest_costs_no_pipelining():
    res = _run(str(ROOT / "tools" / "strict_cuda_sm90.py"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert sum("+dig" in line for line in res.stdout.splitlines()) >= 8


def test_it_finds_a_launch_the_device_refuses():
    code = ("import sys; sys.path.insert(0, 'tools'); import strict_launches_sm90 as t; "
            "from drifttool.ops.strict_cuda.kernels import gemm; "
            "k, _ = t.compile_launch(gemm.GemmConfig(block_n=256, persistent=1), ('bf16', 'bf16', 'fp32'), "
            "None, True, False); print(k.metadata.shared, k.metadata.shared > t.SMEM_LIMIT)")
    res = _run("-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["278552", "True"]
