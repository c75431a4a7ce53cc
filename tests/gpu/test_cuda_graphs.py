"""A forward replayed from a CUDA graph (``drifttool.model.graphs.GraphedForward``) is byte-equal
to the eager forward, leaves the same operator trace, sees in-place weight changes, re-captures
when a parameter is replaced, and runs eagerly where a graph would lose records. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.graphs import GraphedForward
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


def _inputs(seed: int, batch: int, grid=(5, 7), slots=11, lens=(11, 6, 9)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g).bfloat16().cuda()
    txt = torch.randn(batch, slots, tiny().joint_attention_dim, generator=g).bfloat16().cuda()
    mask = (torch.arange(slots)[None, :] < torch.tensor(lens[:batch])[:, None]).cuda()
    tau = torch.rand(batch, generator=g).cuda()
    return x, txt, mask, tau, grid


@pytest.fixture(scope="module")
def model():
    return random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=3).cuda()


def _trace(rt: Runtime) -> list[tuple]:
    return sorted((e.op, e.block, e.stream, e.call, e.calls, e.kernel, e.contract, e.device)
                  for e in rt.trace.entries())


@pytest.mark.parametrize("mode", ["strict", "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_replay_is_byte_equal_to_eager_with_the_same_trace(model, mode, batch):
    fast = GraphedForward(model)
    eager_rt, graph_rt = Runtime(mode=mode), Runtime(mode=mode)
    with torch.no_grad():
        for seed in range(4):  # eager warm-up, capture + replay, then replays on fresh inputs
            x, txt, mask, tau, grid = _inputs(seed, batch)
            with eager_rt.scope(step=seed, phase="rollout"):
                want = model(x, txt, mask, tau, grid, eager_rt)
            with graph_rt.scope(step=seed, phase="rollout"):
                got = fast(x, txt, mask, tau, grid, graph_rt)
            assert torch.equal(_bits(got), _bits(want)), (mode, batch, seed)
    assert (fast.captures, fast.replays) == (1, 3)
    assert _trace(graph_rt) == _trace(eager_rt)


def test_no_mask_and_another_grid_are_other_graphs(model):
    fast = GraphedForward(model)
    rt = Runtime(mode="strict")
    with torch.no_grad():
        for grid, masked in [((5, 7), True), ((4, 4), True), ((5, 7), False)] * 3:
            x, txt, mask, tau, _ = _inputs(7, 1, grid=grid)
            mask = mask if masked else None
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), _bits(model(x, txt, mask, tau, grid, rt)))
    assert (fast.captures, fast.replays) == (3, 6)


def test_weights_changed_in_place_are_seen_and_replaced_ones_recaptured(model):
    fast = GraphedForward(model)
    rt = Runtime(mode="strict")
    x, txt, mask, tau, grid = _inputs(1, 2)
    w = model.proj_out.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            fast(x, txt, mask, tau, grid, rt)
            fast(x, txt, mask, tau, grid, rt)
            w.mul_(0.5)  # in place: the graph reads it
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), _bits(model(x, txt, mask, tau, grid, rt)))
            model.proj_out.weight = torch.nn.Parameter(saved.clone())  # replaced: recapture
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), _bits(model(x, txt, mask, tau, grid, rt)))
        assert fast.captures == 1  # the replaced parameter dropped the graph; the call ran eagerly
    finally:
        model.proj_out.weight = torch.nn.Parameter(saved)


def test_l1_capture_and_autograd_run_eagerly(model):
    fast = GraphedForward(model)
    x, txt, mask, tau, grid = _inputs(2, 1)
    rec = Recorder("L1")
    rt = Runtime(mode="strict", recorder=rec)
    with torch.no_grad(), rt.scope(step=0, phase="rollout", samples=[0], branch="cond", txt_lens=[11], img_grid=grid):
        for _ in range(3):
            fast(x, txt, mask, tau, grid, rt)
    rec.flush()
    assert fast.captures == 0 and rec.ops_table().num_rows > 0
    assert not GraphedForward.eligible(x, Runtime(mode="strict"))  # autograd is recording here


def test_an_l0_run_replays_graphs_with_the_step_bytes_of_an_eager_l1_run(cli, tmp_path):
    from drifttool.artifact.reader import open_run

    steps = {}
    for level in ("L0", "L1"):
        code, out = cli("run", "-o", tmp_path / level, "--device", "cuda", "--mode", "strict",
                        "--capture", level, "--batch", "3")
        assert code == 0, out
        rows = open_run(tmp_path / level).steps_table().to_pylist()
        steps[level] = sorted((r["phase"], r["step"], r["branch"], r["sample"], r["quantity"], r["digest"])
                              for r in rows)
    assert steps["L0"] and steps["L0"] == steps["L1"]
    code, out = cli("diff", tmp_path / "L0", tmp_path / "L1")
    assert code == 0 and "IDENTICAL" in out, out  # compared at the common level, L0
