"""``experiment train-rollout`` under a launch (``train_rollout(dist=, parallel=)``: what
``torchrun -m drifttool experiment train-rollout --tp 2`` runs): the strict/strict rollout and its
training recompute on both ranks under TP2 write the one-process artifacts — the rollout, and
the recompute's v_t, logp_t and LoRA gradient records — and rank 0 alone returns the rows."""

from __future__ import annotations

import json

import pytest

from drifttool.distributed.plan import ParallelDims
from drifttool.training.experiment import train_rollout
from tests.distributed.layout_runs import assert_identical
from tests.distributed.plan_ranks import on_ranks

STRICT = (("strict", "strict"),)


def experiment_rank(ctx, dims, out):
    rows = train_rollout(out, combos=STRICT, dist=ctx, parallel=dims)
    return [(r["combo"], r["identical"], r["grad_rel_l2"]) for r in rows]


@pytest.mark.slow  # about 14 s on 2 cores
def test_train_rollout_under_tp2_writes_the_one_process_artifacts(tmp_path):
    one = train_rollout(tmp_path / "one", combos=STRICT)
    got = on_ranks(ParallelDims(tp=2), "tests.distributed.test_experiment_launch:experiment_rank",
                   tmp_path / "tp2")
    assert got[1] == []  # rank 1 ran every run and returns no rows
    assert got[0] == [(r["combo"], r["identical"], r["grad_rel_l2"]) for r in one] == [("strict/strict", True, 0.0)]
    for name in ("rollout-strict", "train-strict-on-strict"):
        assert_identical(tmp_path / "one" / name, tmp_path / "tp2" / name)
    assert (tmp_path / "tp2" / "train_rollout.json").exists() and (tmp_path / "tp2" / "lora").is_dir()
    launch = json.loads((tmp_path / "tp2" / "train_rollout.settings.json").read_text())["launch"]
    assert (launch["kind"], launch["tp"], launch["world_size"]) == ("parallel", 2, 2)
    one_launch = json.loads((tmp_path / "one" / "train_rollout.settings.json").read_text())["launch"]
    assert one_launch == {"kind": "single", "world_size": 1}
