"""The text lane on a GPU (``drifttool.model.lanes``): a captured forward runs every text-stream
operator on the second CUDA stream and every other on the capture stream; with lanes the bytes
and the capture records are those of one stream, eager or replayed, at the tiny width and at
full width (6889 image tokens, a padded prompt). The dependency order itself is checked off a
GPU (``tests/model/test_lanes_order.py``). Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import drifttool.model.mmdit_block as mmdit_block
from drifttool.capture import gpu_row_batch
from drifttool.capture.recorder import Recorder
from drifttool.model.config import full, tiny
from drifttool.model.graphs import GraphedForward
from drifttool.model.lanes import Lanes
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime
from tests.conftest import assert_same_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def _inputs(cfg, seed: int, batch: int, grid, slots: int, lens):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, grid[0] * grid[1], cfg.in_channels, generator=g).bfloat16().cuda()
    txt = torch.randn(batch, slots, cfg.joint_attention_dim, generator=g).bfloat16().cuda()
    mask = (torch.arange(slots)[None, :] < torch.tensor(lens[:batch])[:, None]).cuda()
    tau = torch.rand(batch, generator=g).cuda()
    scope = dict(phase="rollout", step=seed, sigma=float(tau[0]), samples=list(range(batch)),
                 txt_lens=list(lens[:batch]), img_grid=grid)
    return (x, txt, mask, tau, grid), scope


@pytest.fixture(scope="module")
def model():
    return random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=5).cuda()


def test_captured_text_operators_run_on_the_text_lane(model, monkeypatch):
    """Warm-up eager (one stream), then the capture: its txt calls on the text lane."""
    streams = []
    inner = mmdit_block.call

    def call(rt, op, *args, stream, **kw):
        streams.append((op, stream, rt.lanes, torch.cuda.current_stream()))
        return inner(rt, op, *args, stream=stream, **kw)

    monkeypatch.setattr(mmdit_block, "call", call)
    fast = GraphedForward(model)
    args, scope = _inputs(tiny(), 0, 3, (5, 7), 11, (11, 6, 9))
    rt = Runtime(mode="strict")
    with torch.no_grad(), rt.scope(**scope):
        fast(*args, rt)
        warm = len(streams)
        fast(*args, rt)
    assert fast.captures == 1
    assert all(lanes is None for _, _, lanes, _ in streams[:warm])
    captured = streams[warm:]
    assert {s for _, s, _, _ in captured} == {"img", "txt", "joint"}
    lanes = captured[0][2]
    assert isinstance(lanes, Lanes)
    assert all((st == lanes.text) == (s == "txt") for _, s, _, st in captured), \
        [(op, s) for op, s, _, st in captured if (st == lanes.text) != (s == "txt")]


@pytest.mark.parametrize("level", ["L1", "L2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_eager_lanes_equal_one_stream(model, level, batch):
    """Eager forwards with and without lanes: the same velocity and records, byte for byte."""
    tables, outs = {}, {}
    for name in ("one stream", "lanes"):
        rec = Recorder(level)
        rt = Runtime(mode="strict", recorder=rec, lanes=Lanes("cuda") if name == "lanes" else None)
        outs[name] = []
        with torch.no_grad():
            for seed in range(3):
                args, scope = _inputs(tiny(), seed, batch, (5, 7), 11, (11, 6, 9))
                with rt.scope(**scope):
                    outs[name].append(_bits(model(*args, rt)))
        rec.flush()
        tables[name] = rec.ops_table().to_pylist()
    assert all(torch.equal(a, b) for a, b in zip(outs["lanes"], outs["one stream"]))
    assert tables["lanes"] and tables["lanes"] == tables["one stream"]


@pytest.fixture(scope="module")
def full_width():
    cfg = replace(full(), num_layers=2)
    return random_init_(MMDiT(cfg, dtype=torch.bfloat16), seed=1).cuda(), cfg


@pytest.mark.parametrize("batch, digest_lane", [(1, False), (2, False), (2, True)])
def test_full_width_replays_with_lanes_equal_one_stream(full_width, batch, digest_lane, monkeypatch):
    """Two full-width blocks at 6889 image tokens and a 128-slot prompt (77 valid in the second
    sample): replays with lanes, replays on one stream and eager forwards agree byte for byte
    on fresh inputs, and so do their L1 records; also with the batched digests on a stream of
    their own (``gpu_row_batch.LANE``)."""
    monkeypatch.setattr(gpu_row_batch, "LANE", digest_lane)
    model, cfg = full_width
    fast = {"lanes": GraphedForward(model), "one stream": GraphedForward(model, lanes=False)}
    recs = {name: Recorder("L1") for name in (*fast, "eager")}
    rts = {name: Runtime(mode="strict", recorder=rec) for name, rec in recs.items()}
    with torch.no_grad():
        for seed in range(4):  # warm-up, capture + replay, two more replays
            args, scope = _inputs(cfg, seed, batch, (83, 83), 128, (128, 77))
            out = {}
            for name, rt in rts.items():
                with rt.scope(**scope):
                    out[name] = _bits(model(*args, rt) if name == "eager" else fast[name](*args, rt))
            assert torch.equal(out["lanes"], out["eager"]) and torch.equal(out["one stream"], out["eager"]), seed
    assert [f.replays for f in fast.values()] == [3, 3]
    tables = {}
    for name, rec in recs.items():
        rec.flush()
        tables[name] = rec.ops_table().to_pylist()
    assert tables["lanes"] == tables["one stream"]  # the same kernels: l2 too
    # eager, the producers digest what a graph's batched row kernel reads: l2 in another order
    assert_same_records(tables["lanes"], tables["eager"], "lanes against eager")


def test_one_stream_graphs_ignore_a_callers_lanes(model, monkeypatch):
    """``GraphedForward(lanes=False)`` captures on one stream even when the caller's runtime
    carries lanes."""
    streams = []
    inner = mmdit_block.call

    def call(rt, op, *args, stream, **kw):
        streams.append(torch.cuda.current_stream())
        return inner(rt, op, *args, stream=stream, **kw)

    monkeypatch.setattr(mmdit_block, "call", call)
    fast = GraphedForward(model, lanes=False)
    args, scope = _inputs(tiny(), 1, 1, (5, 7), 11, (11,))
    rt = Runtime(mode="strict", lanes=Lanes(torch.device("cuda")))
    with torch.no_grad(), rt.scope(**scope):
        fast(*args, rt)
        del streams[:]
        fast(*args, rt)
    assert fast.captures == 1 and streams
    assert len(set(streams)) == 1, "a one-stream capture ran operators on a second stream"
