"""The diffusers capture adapter replayed from CUDA graphs (``DiffusersQwenImage`` under
``GraphedForward``, as a rollout through the adapter uses it on a GPU): the same velocities, trace and
records as its eager calls. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer  # noqa: E402
from drifttool.capture.recorder import Recorder  # noqa: E402
from drifttool.model.graphs import GraphedForward, graphable  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.sampling.rollout import rollout  # noqa: E402
from drifttool.sampling.step import sampler_model  # noqa: E402
from drifttool.settings import RunSpec, resolve  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]


def records(recorder: Recorder) -> list[dict]:
    """The op records, NaN written as a string: a step's records hold sigma NaN, and NaN != NaN."""
    nan = lambda v: "nan" if isinstance(v, float) and v != v else v  # noqa: E731
    return [{k: nan(v) for k, v in r.items()} for r in recorder.ops_table().to_pylist()]


@pytest.mark.parametrize("cfg_layout", ["sequential", "batched"])
@pytest.mark.parametrize("level", ["L1", "L2"])
def test_replayed_adapter_calls_equal_its_eager_calls(cfg_layout, level):
    tr = load_transformer("fixtures/tiny-t2i/transformer", torch.bfloat16).to("cuda")
    fx, s = resolve(RunSpec(mode="auto", cfg_layout=cfg_layout, batch=3, steps=4))
    inp = s.inputs(fx, DiffusersQwenImage(tr).config)[0].to("cuda")
    fast = GraphedForward(DiffusersQwenImage(tr))
    assert graphable(fast.model)
    got = {}
    for name, model in (("eager", DiffusersQwenImage(tr)), ("graph", fast)):
        rt = Runtime(mode="auto", recorder=Recorder(level))
        traj = rollout(sampler_model(model), inp, s.sampler(), rt)
        rt.recorder.flush()
        got[name] = (traj, records(rt.recorder), [(e.op, e.calls) for e in rt.trace.entries()])
    assert fast.refused is None and fast.replays > 0, (fast.refused, fast.captures, fast.replays)
    (ea, er, et), (ga, gr, gt) = got["eager"], got["graph"]
    assert_same_bytes(ga.latents.cpu(), ea.latents.cpu(), "latents")
    assert_same_bytes(ga.velocities.cpu(), ea.velocities.cpu(), "velocities")
    assert gr and gr == er and gt == et


def test_a_diffusers_run_on_cuda_replays_graphs(tmp_path, monkeypatch, cli):
    """``run_diffusers`` on a GPU (graphed) writes the artifact its eager calls write."""
    import drifttool.runner as runner
    from drifttool.adapters.diffusers_qwenimage import run_diffusers
    from drifttool.settings import RunSpec

    tr = load_transformer("fixtures/tiny-t2i/transformer", torch.bfloat16).to("cuda")
    use = run_diffusers(RunSpec(device="cuda", batch=3, capture="L2"), tmp_path / "graph",
                        transformer=tr)["cuda_graphs"]
    assert use and use["captures"] > 0 and use["replays"] > 0 and use["refused"] is None, use
    monkeypatch.setattr(runner, "rollout_forward", lambda model, device: model)  # the eager run
    tr = load_transformer("fixtures/tiny-t2i/transformer", torch.bfloat16).to("cuda")
    assert run_diffusers(RunSpec(device="cuda", batch=3, capture="L2"), tmp_path / "eager",
                         transformer=tr)["cuda_graphs"] is None
    code, out = cli("diff", tmp_path / "graph", tmp_path / "eager")
    assert code == 0 and "IDENTICAL" in out, out
