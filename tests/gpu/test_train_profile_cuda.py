"""The shipped training tolerance profile ``strict-cuda1-vs-cpu-train`` holds on a seed it was not
derived from: a strict CPU rollout of ``tiny-t2i`` with the adapter ``tools/train_profile.sh``
draws, recomputed with gradients by the strict CPU trainer and the strict CUDA one (L2 without
the attention's internals), diffs within the profile — operators, step quantities and LoRA
gradients. Skipped without CUDA; run on the GPU machine with ``python -m pytest tests/gpu``."""

from __future__ import annotations

import json

import pytest
import torch

from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_io import save_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FIXTURE_MODEL = "fixtures/tiny-t2i/transformer"


def test_a_held_out_seed_trains_within_the_shipped_profile(cli, tmp_path):
    model = load_checkpoint(FIXTURE_MODEL)
    add_lora(model, rank=4, alpha=8, init_b_std=0.05, seed=0)  # tools/train_profile.sh's adapter
    adapter = save_lora(model, tmp_path / "adapter")
    code, out = cli("run", "--seed", "7", "--device", "cpu", "--capture", "L2", "--lora", adapter,
                    "--lora-mode", "unfused-fp32", "-o", tmp_path / "rollout")
    assert code == 0, out
    for name, device in (("a", "cpu"), ("b", "cuda")):
        code, out = cli("recompute", tmp_path / "rollout", "--grad", "--no-internals", "--device", device,
                        "--mode", "strict", "-o", tmp_path / f"train-{name}")
        assert code == 0, out
    code, out = cli("diff", tmp_path / "train-a", tmp_path / "train-b", "--tolerance", "strict-cuda1-vs-cpu-train",
                    "--json")
    rep = json.loads(out)
    print(f"\nstrict CUDA trainer vs strict CPU trainer, seed 7: {rep['verdict']}, tolerance "
          f"{rep['tolerance']['verdict']}, first beyond {rep['tolerance'].get('first_beyond')}")
    assert rep["verdict"] == "drift" and rep["first_drift"]  # the two arithmetics do differ
    assert code == 0 and rep["tolerance"]["verdict"] == "within", out
