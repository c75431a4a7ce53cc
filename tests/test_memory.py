"""``drifttool.memory``: the peak-memory lower bound is one (a fresh process decoding at the bound's
shapes rises at least that far above its resident size), the chain's VAE decode builds no
autograd graph (which kept every operator's working tensors alive: ~20 KB a pixel, a 1024²
prompt run killed at 22 GiB), and the available-memory reader reads ``/proc/meminfo``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drifttool import memory
from drifttool.chain import decode_latents, default_pipeline
from drifttool.model.checkpoint import read_config
from drifttool.model.vae_checkpoint import load_vae, vae_config
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec, resolve

ROOT = Path(__file__).resolve().parents[1]

# one decode in a fresh process: the resident peak (VmHWM, reset first) over the resident size
# before it, in bytes
_DECODE = """
import sys, torch
from drifttool.chain import decode_latents, default_pipeline
from drifttool.model.vae_checkpoint import load_vae
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec, resolve

size, mode = int(sys.argv[1]), sys.argv[2]
_, s = resolve(RunSpec(checkpoint=default_pipeline(), samples=[0], mode=mode, height=size, width=size))
vae = load_vae(default_pipeline(), dtype=s.torch_dtype)
latents = torch.randn(1, (size // 16) ** 2, 64, generator=torch.Generator().manual_seed(0))

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the resident size
base = status("VmRSS")
decode_latents(vae, latents, 0.0, s, Runtime(mode=mode))
print(status("VmHWM") - base)
"""


def _settings(size: int, mode: str):
    """At capture L0: no digest key table, no unfused attention (the decode term is the bound's)."""
    return resolve(RunSpec(checkpoint=default_pipeline(), samples=[0], mode=mode, height=size, width=size,
                           capture="L0"))[1]


def _decode_term(size: int, mode: str) -> int:
    """The bound's decode term alone: the bound with a VAE less the bound's other terms."""
    folder = default_pipeline()
    s = _settings(size, mode)
    config, vae = read_config(folder), vae_config(folder)
    with_decode, _ = memory.peak_lower_bound(s, config, vae)
    tokens, lat = (size // 16) ** 2, s.sampler().latents_torch_dtype.itemsize
    latents = (s.steps + 1) * tokens * config.in_channels * lat
    x0 = tokens * config.in_channels * 4
    return with_decode - latents - x0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("size,mode", [(1024, "auto"), (256, "strict")])
def test_the_decode_term_is_below_what_a_decode_takes(size, mode):
    """bf16, 4 channels at full resolution: production 4·H·W·(3·2 + 4·2) bytes, strict
    4·H·W·(3·2 + 4·4); the measured rise is above it (3.5× and 25× here: the operators'
    working tensors are not counted)."""
    term = _decode_term(size, mode)
    assert term == 4 * size * size * (6 + (16 if mode == "strict" else 8))
    rose = subprocess.run([sys.executable, "-c", _DECODE, str(size), mode], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.split()[-1]
    assert int(rose) >= term, (int(rose), term)


def test_the_decode_builds_no_autograd_graph():
    """The VAE's parameters require grad (``nn.Parameter``'s default): outside ``no_grad`` its
    decode would record a graph holding every intermediate until the image is written."""
    s = _settings(64, "strict")
    vae = load_vae(default_pipeline(), dtype=s.torch_dtype)
    assert all(p.requires_grad for p in vae.parameters())
    graphed = []
    vae.decoder.register_forward_hook(lambda module, args, out: graphed.append(out.grad_fn is not None))
    decode_latents(vae, torch.randn(1, 16, 64), 0.0, s, Runtime(mode="strict"))
    assert graphed == [False]


def test_available_memory_is_meminfos_or_unknown(tmp_path, monkeypatch):
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        line = next(ln for ln in meminfo.read_text().splitlines() if ln.startswith("MemAvailable:"))
        assert abs(memory.available_bytes("cpu") - int(line.split()[1]) * 1024) < 1 << 30
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    assert memory.available_bytes("cpu") is None  # no such file
    (tmp_path / "meminfo").write_text("MemTotal:  1000 kB\nMemFree:  10 kB\n")
    assert memory.available_bytes("cpu") is None  # no MemAvailable line
    _, s = resolve(RunSpec(height=16384, width=16))
    memory.check_memory(s, read_config(default_pipeline()), vae_config(default_pipeline()))  # no check
