"""RFC ``ws2_lora_grad_invariance`` on the CPU (gloo): a strict training recompute with LoRA
gradients gives the one-process artifact — v_t, logp_t and every gradient record — when its
CFG branches run on two ranks (CFG-parallel), its samples on two ranks (sample-parallel data
parallelism), its heads and MLP channels on two ranks (TP) or its image rows on two ranks (SP with
AG/RS, Ulysses or Ring attention, unequal shards: one rank without rows, then 192/158 rows),
and their combinations (slow)."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest

from drifttool.artifact import open_run
from drifttool.distributed.plan import ParallelDims
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_io import save_lora
from drifttool.runner import execute
from drifttool.settings import RunSpec, resolve
from drifttool.training.options import TrainOptions
from drifttool.training.recompute import recompute_run
from tests.distributed.layout_runs import assert_identical
from tests.distributed.plan_ranks import on_ranks


LAYOUTS = {"cfg": ParallelDims(cfg=2), "samples": None, "tp": ParallelDims(tp=2),
           "sp-agrs": ParallelDims(sp=2), "sp-ulysses": ParallelDims(sp=2, sp_attention="ulysses"),
           "sp-ring": ParallelDims(sp=2, sp_attention="ring"),
           "tp-sp": ParallelDims(tp=2, sp=2), "sp-cfg": ParallelDims(sp=2, cfg=2, sp_attention="ulysses")}


def train_rank(ctx, dims, arg):
    """Rank body: recompute ``arg = (rollout, out, layout)`` with gradients, ``layout`` one of
    ``LAYOUTS`` (``samples``: sample-parallel, no plan)."""
    rollout, out, layout = arg
    parallel = LAYOUTS[layout]
    if parallel is not None and parallel.world_size != ctx.world_size:
        raise AssertionError("launch the layout's world size")
    recompute_run(rollout, out, train=TrainOptions(grad=True), dist=ctx, parallel=parallel)
    return ctx.rank


def _rollout(root, **size):
    fx, s = resolve(RunSpec())
    model = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(model, rank=4, alpha=8, seed=3, init_b_std=0.05)
    save_lora(model, root / "adapter")
    execute(RunSpec(lora=root / "adapter", capture="L1", batch=3, **size), root / "rollout")
    recompute_run(root / "rollout", root / "one", train=TrainOptions(grad=True))
    return root


@pytest.fixture(scope="module")
def lora_rollout(tmp_path_factory):
    """The fixture's 4×6 patches: with SP 2 the second rank holds no image rows."""
    return _rollout(tmp_path_factory.mktemp("layout-train"))


@pytest.fixture(scope="module")
def wide_rollout(tmp_path_factory):
    """160×560 px: 350 image tokens, SP shards of 192 and 158 rows."""
    return _rollout(tmp_path_factory.mktemp("layout-train-350"), height=160, width=560)


def _check(root, layout):
    out = root / f"train-{layout}"
    world = 2 if LAYOUTS[layout] is None else LAYOUTS[layout].world_size
    dims = ParallelDims(cfg=2) if LAYOUTS[layout] is None else LAYOUTS[layout]
    assert world == dims.world_size
    assert on_ranks(dims, "tests.distributed.test_layout_training:train_rank",
                    (root / "rollout", out, layout)) == list(range(world))
    assert_identical(root / "one", out)
    ops = open_run(out).ops_table()
    grads = ops.filter(pc.equal(ops["role"], "grad_weight"))
    one = open_run(root / "one").ops_table()
    assert grads.num_rows == one.filter(pc.equal(one["role"], "grad_weight")).num_rows > 0
    assert set(grads["rank"].to_pylist()) == {0}  # every rank holds them; the root records them


@pytest.mark.parametrize("layout", ["cfg", pytest.param("samples", marks=pytest.mark.slow), "tp",
                                    pytest.param("sp-agrs", marks=pytest.mark.slow)])
def test_layout_training_equals_one_process(lora_rollout, layout):
    _check(lora_rollout, layout)


@pytest.mark.parametrize("layout", ["sp-agrs", pytest.param("sp-ulysses", marks=pytest.mark.slow),
                                    pytest.param("sp-ring", marks=pytest.mark.slow)])
def test_sp_training_on_unequal_shards(wide_rollout, layout):
    _check(wide_rollout, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp-sp", "sp-cfg"])
def test_combined_layout_training(wide_rollout, layout):
    _check(wide_rollout, layout)
