"""Paths that read something on the CPU and run it on the GPU: ``diff --localize`` of two CUDA
runs (replay inputs and stored x_t read on the CPU), ``probe --peer diffusers --device cuda``
(the peer's velocity and the sampler's latents on one device) and a ``--preset diffusers`` run
given ``--latents`` (its manifest read back by ``diff``). Skipped without CUDA; run on the GPU
machine with ``python -m pytest tests/gpu``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_localize_two_cuda_runs(cli, tmp_path):
    for name, extra in (("a", []), ("b", ["--cfg-scale", "3.5"])):
        code, out = cli("run", "-o", tmp_path / name, "--device", "cuda", "--mode", "auto",
                        "--capture", "L0", *extra)
        assert code == 0, out
    code, out = cli("diff", tmp_path / "a", tmp_path / "b", "--localize", "--json")
    assert code == 1, out  # drift, localized: no device error (exit 2)
    assert "more than one device" not in out


def test_peer_probe_on_cuda(cli, tmp_path):
    pytest.importorskip("diffusers")
    code, out = cli("probe", "--peer", "diffusers", "--device", "cuda", "--only", "repeat",
                    "-o", tmp_path / "m")
    assert code == 0, out
    data = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert data["settings"]["peer"]["device"] == "cuda"
    assert [(r["name"], r["status"]) for r in data["results"]] == [("repeat", "PASS")]


def test_preset_run_with_latents_on_cuda_diffs(cli, tmp_path):
    code, out = cli("run", "-o", tmp_path / "drawn", "--device", "cuda", "--preset", "diffusers",
                    "--mode", "auto", "--batch", "2")
    assert code == 0, out
    save_file({"latents": load_file(str(tmp_path / "drawn" / "inputs.safetensors"))["x0"]},
              str(tmp_path / "x0.safetensors"))
    code, out = cli("run", "-o", tmp_path / "given", "--device", "cuda", "--preset", "diffusers",
                    "--mode", "auto", "--batch", "2", "--latents", tmp_path / "x0.safetensors")
    assert code == 0, out
    code, out = cli("diff", tmp_path / "drawn", tmp_path / "given")
    assert code == 0 and "IDENTICAL" in out, out  # the same x0 values, given or drawn
