"""The small Flow-GRPO loop (drifttool.training.grpo) on the tiny preset: strict/strict gives a
ratio of exactly 1 and no clipping on the first inner epoch; a mismatched trainer does not."""

from __future__ import annotations

import math

import pytest
import torch

from drifttool.errors import DriftToolError
from drifttool.training.grpo import GRPOConfig, check_lr, group_advantages, grpo_loop, toy_reward


def test_advantages_and_reward():
    r = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 4.0])
    adv = group_advantages(r, 2, clip=5.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-3)
    assert group_advantages(r * 100, 2, clip=0.5).abs().max() == 0.5
    x = torch.zeros(2, 6, 64)
    x[1, :, 0:4] = 1.0
    assert toy_reward(x).tolist() == [0.0, 1.0]


def test_strict_strict_first_epoch_ratio_is_exactly_one():
    rows = grpo_loop(GRPOConfig(rollout_mode="strict", train_mode="strict", steps=2, inner_epochs=2,
                                groups=1, train_micro_batch=None))
    assert [(r["step"], r["epoch"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "ratio_mean", "approx_kl", "kl", "loss"))
        if r["epoch"] == 0:  # the parameters that sampled
            assert r["ratio_exactly_one"] and r["ratio_min"] == r["ratio_max"] == 1.0
            assert r["clip_fraction"] == 0.0 and r["approx_kl"] == 0.0 and r["kl"] == 0.0
        else:  # after an AdamW step on the LoRA parameters the policy moved
            assert not r["ratio_exactly_one"] and r["approx_kl"] > 0
    assert rows[2]["reward_mean"] != rows[0]["reward_mean"]  # fresh samples, updated policy


def test_mismatched_trainer_shows_ratio_drift_before_any_update():
    rows = grpo_loop(GRPOConfig(rollout_mode="production", train_mode="strict", steps=1, inner_epochs=1,
                                groups=1))
    (r,) = rows
    assert not r["ratio_exactly_one"] and r["kl"] > 0 and r["approx_kl"] > 0
    assert 0.0 <= r["clip_fraction"] <= 1.0


def test_group_inputs_widths_come_from_the_config():
    """Latent channels and text width follow the model config (diffusers' unit-test shape:
    16 packed channels = 4 latent channels, text width 16), not Qwen-Image's 16/3584."""
    from drifttool.fixture import load_fixture
    from drifttool.model.config import MMDiTConfig
    from drifttool.training.grpo import group_inputs

    cfg = MMDiTConfig(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                      num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    inputs = group_inputs(load_fixture("tiny-t2i"), 3, [0, 1], [0, 1], (4, 6), 4, cfg)
    assert inputs.x0.shape == (2, 24, 16) and inputs.noise.shape[-1] == 16
    assert inputs.txt.shape[-1] == inputs.neg_txt.shape[-1] == 16


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1.0, -1e-9, True, "0.1"])
def test_a_learning_rate_adamw_cannot_take_is_refused_in_one_line(lr):
    with pytest.raises(DriftToolError, match=r"^the learning rate must be a finite number >= 0, got "):
        GRPOConfig(lr=lr)


def test_a_zero_or_positive_learning_rate_is_taken():
    assert GRPOConfig(lr=0.0).lr == 0.0 and check_lr(3e-2) == 3e-2 and check_lr(1) == 1.0
