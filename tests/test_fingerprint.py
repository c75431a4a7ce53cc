"""The fingerprint's ``inputs`` (version 2): what the strict inputs' bytes depend on."""

from __future__ import annotations

import pytest
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


def test_non_finite_weights_are_named_in_one_line_of_bounded_length():
    """A checkpoint of many NaN tensors: the first three named with count and first index, the
    rest counted (a line of every tensor ran to thousands of characters)."""
    from drifttool.errors import DriftToolError
    from drifttool.fingerprint import check_finite

    tensors = {f"blocks.{i}.weight": torch.randn(8, 8) for i in range(40)}
    tensors["scale"] = torch.ones(2, dtype=torch.int64)  # not a float: never checked
    for i in range(2, 40, 3):
        tensors[f"blocks.{i}.weight"][i % 8, 1] = float("nan")
    with pytest.raises(DriftToolError) as e:
        check_finite(tensors, "checkpoint weights")
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    assert text.startswith("non-finite checkpoint weights in 13 of 41 tensor(s): blocks.2.weight: 1 "
                           "non-finite value(s), first at index (2, 1); blocks.5.weight"), text
    assert "blocks.8.weight" in text and "blocks.11.weight" not in text and text.endswith("; and 10 more"), text
    check_finite({k: v.nan_to_num() for k, v in tensors.items()}, "checkpoint weights")  # finite: no error
