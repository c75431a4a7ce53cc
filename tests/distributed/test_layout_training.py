"""RFC ``ws2_lora_grad_invariance`` on the CPU (gloo): a strict training recompute with LoRA
gradients gives the one-process artifact — v_t, logp_t and every gradient record — when its
CFG branches run on two ranks (CFG-parallel) and when its samples run on two ranks
(sample-parallel data parallelism); TP/SP training is refused in one line."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest

from drifttool.artifact import open_run
from drifttool.distributed.plan import ParallelDims
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora, save_lora
from drifttool.runner import execute
from drifttool.settings import RunSpec, resolve
from drifttool.training.options import TrainOptions
from drifttool.training.recompute import recompute_run
from tests.distributed.layout_runs import assert_identical
from tests.distributed.plan_ranks import RankCrash, on_ranks


def train_rank(ctx, dims, arg):
    """Rank body: recompute ``arg = (rollout, out, layout)`` with gradients, ``layout`` one of
    ``cfg`` (a CFG-parallel plan), ``samples`` (sample-parallel: no plan), ``tp``/``sp``."""
    rollout, out, layout = arg
    parallel = {"cfg": ParallelDims(cfg=2), "samples": None, "tp": ParallelDims(tp=2),
                "sp": ParallelDims(sp=2)}[layout]
    if parallel is not None and parallel.world_size != ctx.world_size:
        raise AssertionError("launch the layout's world size")
    recompute_run(rollout, out, train=TrainOptions(grad=True), dist=ctx, parallel=parallel)
    return ctx.rank


@pytest.fixture(scope="module")
def lora_rollout(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-train")
    fx, s = resolve(RunSpec())
    model = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(model, rank=4, alpha=8, seed=3, init_b_std=0.05)
    save_lora(model, root / "adapter")
    execute(RunSpec(lora=root / "adapter", capture="L1", batch=3), root / "rollout")
    recompute_run(root / "rollout", root / "one", train=TrainOptions(grad=True))
    return root


@pytest.mark.parametrize("layout", ["cfg", "samples"])
def test_layout_training_equals_one_process(lora_rollout, layout):
    root = lora_rollout
    out = root / f"train-{layout}"
    assert on_ranks(ParallelDims(cfg=2), "tests.distributed.test_layout_training:train_rank",
                    (root / "rollout", out, layout)) == [0, 1]
    assert_identical(root / "one", out)
    ops = open_run(out).ops_table()
    grads = ops.filter(pc.equal(ops["role"], "grad_weight"))
    one = open_run(root / "one").ops_table()
    assert grads.num_rows == one.filter(pc.equal(one["role"], "grad_weight")).num_rows > 0
    assert set(grads["rank"].to_pylist()) == {0}  # every rank holds them; the root records them


@pytest.mark.parametrize("layout, needle", [("tp", "training under TP/SP"), ("sp", "training under TP/SP")])
def test_tp_sp_training_is_refused(lora_rollout, layout, needle):
    dims = ParallelDims(tp=2) if layout == "tp" else ParallelDims(sp=2)
    with pytest.raises(RankCrash, match=needle):
        on_ranks(dims, "tests.distributed.test_layout_training:train_rank",
                 (lora_rollout / "rollout", lora_rollout / f"x-{layout}", layout))
