"""The Flow-GRPO loop under a launch (``grpo_loop(dist=, parallel=)``): strict/strict under TP2
and under SP2 (Ulysses) takes the one-process optimizer steps — every reward, ratio (exactly 1
on the first inner epoch), clip fraction, KL and loss equal, and the trained adapter's bytes
too — on every rank."""

from __future__ import annotations

import pytest
import torch

from drifttool.distributed.plan import ParallelDims
from drifttool.model.lora import lora_parameters
from drifttool.training.grpo import GRPOConfig, _policy, grpo_loop
from drifttool.settings import RunSpec, resolve
from tests.distributed.plan_ranks import on_ranks

CFG = dict(rollout_mode="strict", train_mode="strict", steps=1, inner_epochs=2)
TIMES = ("rollout_seconds", "train_seconds")
LAYOUTS = {"tp2": ParallelDims(tp=2), "sp2-ulysses": ParallelDims(sp=2, sp_attention="ulysses")}


def _run(dist=None, parallel=None):
    cfg = GRPOConfig(**CFG)
    fx, s = resolve(RunSpec(height=cfg.height, width=cfg.width))
    model = _policy(cfg, fx, s.torch_dtype, "cpu")
    rows = grpo_loop(cfg, model=model, dist=dist, parallel=parallel)
    adapter = {n: p.detach().clone() for n, p in lora_parameters(model).items()}
    return [{k: v for k, v in r.items() if k not in TIMES} for r in rows], adapter


def grpo_rank(ctx, dims, name):
    return _run(ctx, LAYOUTS[name])


@pytest.fixture(scope="module")
def one_process():
    return _run()


@pytest.mark.slow  # a GRPO loop on spawned gloo ranks (about 10 s a layout)
@pytest.mark.parametrize("name", ["tp2", "sp2-ulysses"])
def test_grpo_under_a_layout_takes_the_one_process_steps(one_process, name):
    rows, adapter = one_process
    assert rows[0]["ratio_exactly_one"] and rows[0]["clip_fraction"] == 0.0
    assert any(r["epoch"] == 1 and not r["ratio_exactly_one"] for r in rows)  # the adapter did move
    for got_rows, got_adapter in on_ranks(LAYOUTS[name], "tests.distributed.test_grpo_launch:grpo_rank", name):
        assert got_rows == rows
        assert got_adapter.keys() == adapter.keys()
        for n, p in adapter.items():
            assert torch.equal(got_adapter[n].view(torch.int16), p.view(torch.int16)), n
