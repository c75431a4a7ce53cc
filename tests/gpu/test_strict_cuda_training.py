"""Strict training on the GPU, end to end at the tiny size: a strict CUDA rollout with a LoRA
adapter (batch 3, prompts of different lengths), then its training recompute with gradients —
the whole strict CUDA backward (GEMMs, row operators, joint attention, norm_out, the sampler's
CFG renorm and SDE step) and the gradient ledger's canonical reduction. Every recompute diffs
IDENTICAL against the rollout (v_t, x_t, logp_t of phase train equal the rollout's), and the
recomputes with micro-batches of 1 and 2 and with gradient checkpointing diff IDENTICAL against
the whole-batch one, LoRA gradients included; a recompute whose steps replay CUDA graphs is
identical to the same recompute run eagerly. Skipped without CUDA; run on the GPU machine with
``python -m pytest tests/gpu/test_strict_cuda_training.py -n 0``.
"""

from __future__ import annotations

import pytest
import torch

from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_io import save_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FIXTURE_MODEL = "fixtures/tiny-t2i/transformer"


def _cli(*args) -> tuple[int, str]:
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    res = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A rank-4 adapter on the default targets with random non-zero B (FP32)."""
    model = load_checkpoint(FIXTURE_MODEL, dtype=torch.float32)
    add_lora(model, rank=4, alpha=6.0, seed=3, init_b_std=0.05)
    return save_lora(model, tmp_path_factory.mktemp("lora") / "adapter")


@pytest.fixture(scope="module")
def rollout(adapter, tmp_path_factory):
    out = tmp_path_factory.mktemp("strict_training") / "rollout"
    code, text = _cli("run", "-o", out, "--device", "cuda", "--mode", "strict", "--lora", adapter,
                      "--batch", "3", "--capture", "L1")
    assert code == 0, text
    return out


def test_recompute_matches_the_rollout_and_its_gradients_do_not_depend_on_the_layout(rollout, adapter, tmp_path):
    layouts = {"whole": [], "micro-1": ["--micro-batch", "1"], "checkpointing": ["--gradient-checkpointing"],
               "micro-2-checkpointing": ["--micro-batch", "2", "--gradient-checkpointing"]}
    outs = {}
    for name, extra in layouts.items():
        outs[name] = tmp_path / name
        code, text = _cli("recompute", rollout, "-o", outs[name], "--lora", adapter, "--grad", *extra)
        assert code == 0, f"recompute {name}: {text}"
    code, text = _cli("diff", rollout, outs["whole"])
    assert code == 0, f"train vs rollout: {text}"
    for name in layouts:
        if name != "whole":
            code, text = _cli("diff", outs["whole"], outs[name])
            assert code == 0, f"whole batch vs {name}: {text}"


@pytest.mark.parametrize("extra", [[], ["--gradient-checkpointing"]])
def test_a_graphed_recompute_equals_an_eager_one(rollout, adapter, tmp_path, monkeypatch, extra):
    """On a GPU the training steps replay CUDA graphs (``model.graphs_train``: forward, backward,
    the records and the ledger's atoms): the recompute, its LoRA gradient records included, is
    identical to the same recompute with every step run eagerly."""
    from drifttool.model.graphs_train import GraphedTraining

    replays = []
    reset = GraphedTraining.reset

    def counted(self):  # recompute_run resets its graphs at the end: count their replays there
        replays.append(self.replays)
        reset(self)

    monkeypatch.setattr(GraphedTraining, "reset", counted)
    for name in ("graph", "eager"):
        with monkeypatch.context() as m:
            if name == "eager":
                m.setattr(GraphedTraining, "eligible", staticmethod(lambda *a, **k: False))
            code, text = _cli("recompute", rollout, "-o", tmp_path / name, "--lora", adapter, "--grad", *extra)
        assert code == 0, f"recompute {name}: {text}"
    assert replays[0] > 0 and replays[1] == 0, replays
    code, text = _cli("diff", tmp_path / "graph", tmp_path / "eager")
    assert code == 0 and "IDENTICAL" in text, text


def test_a_recompute_at_l2_without_the_internals_trains_through_the_fused_attention(rollout, adapter, tmp_path):
    """``recompute --grad --capture L2 --no-internals``: L2's row digests while the strict CUDA
    fused attention runs forward and backward (its internals are never unfused); identical to the
    rollout (compared at its L1) and its LoRA gradients to the L1 recompute's."""
    from drifttool.artifact import open_run

    outs = {"L1": tmp_path / "l1", "L2": tmp_path / "l2"}
    for level, out in outs.items():
        extra = ["--no-internals"] if level == "L2" else []
        code, text = _cli("recompute", rollout, "-o", out, "--lora", adapter, "--grad", "--capture", level, *extra)
        assert code == 0, f"recompute {level}: {text}"
    run = open_run(outs["L2"])
    assert run.manifest["settings"]["internals"] is False
    ops = run.ops_table()
    assert "internal" not in ops.column("role").to_pylist() and ops.column("row_digests").null_count < ops.num_rows
    attention = [r for r in run.trace_rows() if r["op"] == "joint_attention_fused"]
    assert attention and {r["actual"] for r in attention} == {"strict"}, attention
    for a, b in ((rollout, outs["L2"]), (outs["L1"], outs["L2"])):
        code, text = _cli("diff", a, b)
        assert code == 0, f"{a.name} vs {b.name}: {text}"
