"""Records made before a component's first block (``schema.BEFORE_BLOCKS``, −1: the MMDiT's
timestep embedding and input projections) are said in words wherever a first drift shows them:
``before block 0`` in a one-line location, ``before 0`` in a block cell (as step −1 is), ``before b0``
in a short site; never ``block -1``."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.diff import diff_runs, render
from drifttool.probes.peer_catalog import PeerExpect
from drifttool.probes.spec import Expectation
from drifttool.reports.html import render_html


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The embedded default strict against production: its first drift is the timestep
    embedding, before block 0."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("before")
    execute(RunSpec(), out / "strict")
    execute(RunSpec(mode="auto"), out / "auto")
    return diff_runs(open_run(out / "strict"), open_run(out / "auto"))


def test_a_first_drift_before_the_blocks_is_said_in_words(report):
    fd = report.first_drift
    assert fd.block == S.BEFORE_BLOCKS
    assert fd.where() == "rollout step 0 cond before block 0 timestep_embed_mlp#0 sample 0 (owning rank 0)"
    first_op = next(s.first_op for s in report.steps if s.first_op is not None)
    assert str(first_op) == "cond before b0 timestep_embed_mlp#0 s0"  # a stream none left out
    console = Console(record=True, width=200, color_system=None)
    render(report, console)
    out = console.export_text()
    assert "│ block       │ before 0 " in out
    assert ["rollout", "0", "=", "cond", "before", "0", "-", "timestep_embed_mlp#0", "0"] in [
        ln.split() for ln in out.splitlines()]
    assert '<td><b>block</b></td><td class="id">before 0</td>' in render_html(report)
    assert '<td class="id">cond before b0 timestep_embed_mlp#0 s0</td>' in render_html(report)
    for shown in (out, render_html(report)):
        assert "block -1" not in shown and "b-1" not in shown


def test_probe_expectations_say_before_block_0():
    assert (Expectation(verdict="drift", op="latent_proj_gemm", step=0, block=S.BEFORE_BLOCKS,
                        stream="img").describe() == "drift at latent_proj_gemm (img, step 0, before block 0)")
    assert (PeerExpect(verdict="drift", op="txt_in_rmsnorm_linear", stream="txt", block=-1, step=0)
            .describe() == "drift at txt_in_rmsnorm_linear (txt, step 0, before block 0)")  # the same order
    assert S.short_block(S.BEFORE_BLOCKS) == "before b0" and S.short_block(S.SAMPLER_BLOCK) == "sampler"


@pytest.fixture(scope="module")
def after_report(tmp_path_factory):
    """A one-ULP change in the output projection (``latent_proj_gemm`` after the last of the
    embedded default's 2 blocks: block 2) at step 0: the first drift is after block 1."""
    from drifttool.probes import variants as V
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("after")
    plant = V.PlantUlp("latent_proj_gemm", step=0, block=2, call=0, sample=1, branch="uncond", row=7,
                       rest=(3,)).entry()
    execute(RunSpec(), out / "a")
    execute(RunSpec(variants={"latent_proj_gemm": plant}), out / "b")
    return diff_runs(open_run(out / "a"), open_run(out / "b"))


def test_a_first_drift_after_the_blocks_is_said_in_words(after_report):
    """Records after the last block (the final norm, the output projection: block = the number
    of blocks) are said as those before the first are: ``after block 1`` in a location, ``after
    1`` in a block cell, ``after b1`` in a short site; never ``block 2`` of a 2-block model."""
    from drifttool.training.render_localize import localize_rows
    from drifttool.training.localize import LocalizeResult

    fd = after_report.first_drift
    assert (fd.block, fd.blocks, fd.op) == (2, 2, "latent_proj_gemm")
    assert fd.where() == "rollout step 0 uncond after block 1 img latent_proj_gemm#0 sample 1 (owning rank 0)"
    first_op = next(s.first_op for s in after_report.steps if s.first_op is not None)
    assert str(first_op) == "uncond after b1 img latent_proj_gemm#0 s1"
    console = Console(record=True, width=200, color_system=None)
    render(after_report, console)
    out = console.export_text()
    assert "│ block       │ after 1 " in out, out
    assert ["rollout", "0", "=", "uncond", "after", "1", "img", "latent_proj_gemm#0", "1"] in [
        ln.split() for ln in out.splitlines()], out
    html = render_html(after_report)
    assert '<td><b>block</b></td><td class="id">after 1</td>' in html
    assert '<td class="id">uncond after b1 img latent_proj_gemm#0 s1</td>' in html
    rows = dict(localize_rows(LocalizeResult(status="already_localized", reason="", first_drift=fd)))
    assert rows["block / branch"] == "after 1 / uncond (stream img)"
    of_no_stream = dataclasses.replace(fd, stream="none")  # the timestep embedding's, say
    rows = dict(localize_rows(LocalizeResult(status="already_localized", reason="", first_drift=of_no_stream)))
    assert rows["block / branch"] == "after 1 / uncond"  # not "(stream -)"
    for shown in (out, html, fd.where()):
        assert "block 2" not in shown and " b2 " not in shown


def test_probe_expectations_say_after_the_last_block():
    from drifttool.probes.catalog import catalog

    final = next(p for p in catalog(num_layers=2) if p.expect.op == "final_adaln_out")
    assert final.expect.describe() == "drift at final_adaln_out (img, step 0, after block 1)"
    assert S.block_name(2, 2) == "after 1" and S.short_block(2, 2) == "after b1"
    assert S.block_name(2) == "2" and S.block_name(1, 2) == "1"  # no number of blocks: the number
