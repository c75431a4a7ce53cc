"""The fingerprint's ``inputs`` (version 2): what the strict inputs' bytes depend on."""

from __future__ import annotations

import torch

from drifttool.fingerprint import FINGERPRINT_VERSION, arch_fingerprint
from drifttool.model.rope import ROPE_ALGORITHMS
from drifttool.sampling.noise import PHILOX_NAME, noise_record


def _fp(mode, generator="philox"):
    rec = noise_record(1, img_grid=(2, 3), num_steps=2, generator=generator)
    return arch_fingerprint(arch={"num_layers": 2}, img_grid=(2, 3), weights="xxh3_64:0", dtype=torch.float32,
                            mode=mode, sampler={"num_steps": 2}, noise_record=rec)


def test_strict_inputs_are_portable_and_say_so():
    fp = _fp("strict")
    assert FINGERPRINT_VERSION == 2 and fp["version"] == 2
    assert fp["inputs"] == {"rope_tables": ROPE_ALGORITHMS["exact"], "noise": PHILOX_NAME, "cpu_capability": None}
    assert _fp("audit")["inputs"] == fp["inputs"]


def test_dispatch_dependent_inputs_record_the_cpu_capability():
    cap = torch.backends.cpu.get_cpu_capability()
    prod = _fp("auto")["inputs"]
    assert prod["rope_tables"] == ROPE_ALGORITHMS["polar"] and prod["cpu_capability"] == cap
    torch_noise = _fp("strict", generator="torch")["inputs"]
    assert torch_noise["noise"].startswith("torch.Generator") and torch_noise["cpu_capability"] == cap
    unknown = arch_fingerprint(arch={}, img_grid=(2, 3), weights="w", dtype=torch.float32, mode="strict",
                               sampler={}, noise_record={"generator": "torch.Generator (mt19937)"})
    assert unknown["inputs"]["cpu_capability"] == cap  # a pre-v2 record: torch.randn, dispatch-dependent
