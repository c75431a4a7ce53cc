"""Sampler operators (sigma table, CFG combine, SDE step) sit at their own position,
``schema.SAMPLER_BLOCK``, not at block −1 ("before the blocks"), and are named "sampler"."""

from __future__ import annotations

import math

import torch
from rich.console import Console

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.recorder import Recorder
from drifttool.diff import Verdict, diff_runs, render
from drifttool.ops.scheduler import flow_sde_step_logp_strict
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.inputs import RolloutInputs
from drifttool.sampling.rollout import rollout

SAMPLER_OPS = {"flow_sigma_table", "cfg_combine_renorm", "flow_sde_step_logp"}


def _model(x, txt, txt_mask, tau, img_grid, rt):
    """Elementwise stand-in for the MMDiT (records nothing): v [B, N, C] fp32."""
    return torch.tanh(x) * 0.5 + tau[:, None, None]


def _inputs() -> RolloutInputs:
    g = torch.Generator().manual_seed(0)
    return RolloutInputs(sample_ids=[0, 1], x0=torch.randn(2, 4, 8, generator=g),
                         txt=torch.randn(2, 3, 4, generator=g), img_grid=(2, 2),
                         neg_txt=torch.randn(2, 3, 4, generator=g),
                         noise=torch.randn(3, 2, 4, 8, generator=g))


def _ulp_sde(*args, **kwargs):
    """``flow_sde_step_logp`` with x_next[1, 2, 3] moved by one ULP."""
    x_next, logp, mu, std_t = flow_sde_step_logp_strict(*args, **kwargs)
    x_next = x_next.clone()
    x_next[1, 2, 3] = torch.nextafter(x_next[1, 2, 3], torch.tensor(math.inf))
    return x_next, logp, mu, std_t


def _run(path, variants=None):
    writer = ArtifactWriter(path, manifest={"fingerprint": {"arch": {"num_layers": 1}}})
    rec = Recorder("L1", writer)
    rt = Runtime(recorder=rec, variants=variants or {})
    rollout(_model, _inputs(), SamplerConfig(num_steps=3), rt)
    writer.write_trace(rt.trace.rows())
    rec.close(complete=True)
    return path


def test_sampler_operators_have_their_own_block(tmp_path):
    ops = open_run(_run(tmp_path / "a")).ops_table().select(["op", "block"]).to_pylist()
    assert {r["op"] for r in ops} == SAMPLER_OPS
    assert {r["block"] for r in ops} == {S.SAMPLER_BLOCK} and S.SAMPLER_BLOCK != -1
    rows = open_run(tmp_path / "a").trace_rows()
    assert {r["block"] for r in rows} == {S.SAMPLER_BLOCK}


def test_sampler_drift_is_named_sampler(tmp_path):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", {"flow_sde_step_logp": ("ulp", _ulp_sde)})
    r = diff_runs(open_run(a), open_run(b))
    assert r.verdict is Verdict.DRIFT
    fd = r.first_drift
    assert (fd.op, fd.step, fd.block, fd.sample) == ("flow_sde_step_logp", 0, S.SAMPLER_BLOCK, 1)
    assert fd.where() == "rollout step 0 cfg sampler img flow_sde_step_logp#0 sample 1 (owning rank 0)"
    assert str(r.steps[1].first_op).startswith("cfg sampler img ")
    console = Console(record=True, width=300, color_system=None)
    render(r, console)
    out = console.export_text()
    assert "│ block       │ sampler" in out
    assert ["rollout", "0", "=", "cfg", "sampler", "img", "flow_sde_step_logp#0", "1"] in [
        ln.split() for ln in out.splitlines()]
    assert "trace sampler img flow_sde_step_logp#0: actual strict->variant:ulp" in "\n".join(
        r.context)
