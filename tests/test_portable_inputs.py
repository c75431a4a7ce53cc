"""The strict inputs — RoPE tables (``exact``) and pinned noise (``philox``) — are the same bytes
under every CPU dispatch level torch can be forced to (``ATEN_CPU_CAPABILITY``), and the sealed
fixture verifies under ``default`` (no SIMD) as it does under the host's best level.

Each level runs in a fresh interpreter (the variable is read once, at torch's start). Only the
levels up to this CPU's own run: forcing one the CPU lacks can kill the child with SIGILL (AVX-512
on an AVX2 machine, torch 2.13); the child also reports the level it got, and a level that fell
back is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LEVELS = ("default", "avx2", "avx512")

_CHILD = r"""
import hashlib, json, sys
import torch
from drifttool.model.rope import rope_tables
from drifttool.sampling.noise import draw_noise

def digest(t):
    t = torch.view_as_real(t) if t.is_complex() else t
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

rope, noise = sys.argv[1], sys.argv[2]
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for grid, L, axes in (((83, 83), 512, (16, 56, 56)), ((4, 6), 13, (4, 6, 6))):
    img, txt = rope_tables(grid, L, axes_dims=axes, algorithm=rope)
    out[f"rope{grid}"] = [digest(img), digest(txt)]
for seed, ids, grid, steps in ((386, [0, 1], (4, 6), 4), (7, [3], (32, 32), 2)):
    p = draw_noise(seed, ids, img_grid=grid, num_steps=steps, generator=noise)
    out[f"noise{seed}"] = [digest(p.x0), digest(p.noise)]
print(json.dumps(out))
"""


def _run_levels(rope: str, noise: str) -> dict[str, dict]:
    import torch

    here = torch.backends.cpu.get_cpu_capability().lower()
    results = {}
    for level in LEVELS[:LEVELS.index(here) + 1] if here in LEVELS else LEVELS[:1]:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
        proc = subprocess.run([sys.executable, "-c", _CHILD, rope, noise], env=env, capture_output=True,
                              text=True, timeout=300, check=True)
        out = json.loads(proc.stdout)
        if out.pop("capability").lower() == level:  # the CPU has this level
            results[level] = out
    return results


def test_strict_inputs_same_bytes_at_every_cpu_dispatch_level():
    results = _run_levels("exact", "philox")
    if len(results) < 2:
        pytest.skip(f"this CPU offers fewer than two of the dispatch levels {LEVELS}")
    base_level, base = next(iter(results.items()))
    for level, out in results.items():
        for key, digests in out.items():
            assert digests == base[key], f"{key}: {level} differs from {base_level}"


@pytest.mark.slow
def test_fixture_verifies_without_simd(tmp_path):
    """``drifttool fixture verify`` under ATEN_CPU_CAPABILITY=default: identical to the sealed
    expected artifact (before portable inputs: DRIFT, inputs.noise and inputs.x0 differ)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    proc = subprocess.run([sys.executable, "-m", "drifttool.cli.app", "fixture", "verify",
                           "--workdir", str(tmp_path / "w")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
