"""The small Flow-GRPO loop on the GPU (``drifttool.training.grpo``): its rollouts replay
``GraphedForward`` graphs, reused by the next group's fresh samples of the same prompt, and every
row (rewards, ratios, KL, loss) equals the same loop run eagerly; strict/strict's first inner epoch
has a ratio of exactly 1, and the training steps replay ``GraphedTraining`` graphs (with one sample
per micro-batch too). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from drifttool.model.graphs import GraphedForward
from drifttool.model.graphs_train import GraphedTraining
from drifttool.training import grpo
from drifttool.training.grpo import GRPOConfig, grpo_loop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIMES = ("rollout_seconds", "train_seconds")


@pytest.mark.parametrize("micro_batch", [None, 1])
def test_a_graphed_grpo_loop_equals_the_eager_loop(monkeypatch, micro_batch):
    made = []
    for cls in (GraphedForward, GraphedTraining):
        def tracked(self, *a, _init=cls.__init__, **k):
            _init(self, *a, **k)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", tracked)
    real = grpo.group_inputs  # every group the same prompt: the same shapes, fresh sample ids
    monkeypatch.setattr(grpo, "group_inputs", lambda fx, seed, ids, rows, *a: real(fx, seed, ids, [0] * len(rows), *a))
    cfg = GRPOConfig(rollout_mode="strict", train_mode="strict", steps=2, inner_epochs=2, groups=1,
                     device="cuda", train_micro_batch=micro_batch)
    graphed = grpo_loop(cfg)
    assert [type(m) for m in made] == [GraphedForward, GraphedTraining]
    # 4 sampling steps a rollout: a signature's first call is eager and its next three replay; the
    # second group (fresh sample ids) replays all four only if it reused the first group's graphs
    assert made[0].replays > 0 and made[0].replays == 7 * made[0].captures, (
        "the second group did not reuse the rollout's graphs", made[0].captures, made[0].replays)
    training = made[1]
    with monkeypatch.context() as m:
        for cls in (GraphedForward, GraphedTraining):
            m.setattr(cls, "eligible", staticmethod(lambda *a, **k: False))
        eager = grpo_loop(cfg)
    assert len(graphed) == len(eager) == 4
    for g, e in zip(graphed, eager):
        assert {k: v for k, v in g.items() if k not in TIMES} == {k: v for k, v in e.items() if k not in TIMES}
    assert all(r["ratio_exactly_one"] for r in graphed if r["epoch"] == 0)
    # micro-batches before one backward: the capture waits for a step whose earlier graphs are gone
    assert training.refused is None and training.replays > 0, (training.refused, training.captures)
