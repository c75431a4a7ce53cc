"""``text_encoder_batch``: a prompt encoded alone vs batched with a longer prompt (so padded),
through the prompt chain on the shipped tiny pipeline (2 steps), judged on the shared sample's
records: identical in strict; in production (CPU) observed, not judged (the text encoder's first
attention drifts on an AVX-512 machine, not on an AVX2 one); pending on CUDA; the strict
expectation fails when the production family runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")

from drifttool.probes.catalog import catalog  # noqa: E402
from drifttool.probes.results import FINDING, OBSERVED, PASS, PENDING  # noqa: E402
from drifttool.probes.runner import open_pair, run_matrix  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402

NAME = "text_encoder_batch"


def _probe(family: str = "strict", device: str = "cpu", settings: dict | None = None):
    (p,) = [p for p in catalog(settings, family=family, device=device) if p.name == NAME]
    return p


def _matrix(p, out, mode: str):
    m = run_matrix([p], out, base=RunSpec(mode=mode, steps=2))
    (r,) = m.results
    return r


def test_declared_per_family_and_device():
    strict, prod = _probe(), _probe("production")
    assert strict.kind == "invariant" and strict.expect.verdict == "identical" and not strict.pending
    assert strict.compare == prod.compare == "common_samples"
    assert prod.expect.verdict == "observed"
    assert "runs on the CPU only" in _probe("production", "cuda").pending
    assert "runs on the CPU only" in _probe("strict", "cuda").pending


def test_a_transformer_only_checkpoint_leaves_it_pending(tmp_path):
    (tmp_path / "transformer").mkdir()
    for family in ("strict", "production"):
        p = _probe(family, settings={"checkpoint": str(tmp_path)})
        assert "needs a pipeline folder" in p.pending
        r = run_matrix([p], tmp_path / f"m-{family}", base=RunSpec(steps=2)).results[0]
        assert r.status == PENDING and r.reference is None


def test_strict_alone_vs_padded_batch_is_identical_on_the_shared_sample(tmp_path):
    import pyarrow.compute as pc

    from drifttool.artifact.reader import open_run

    r = _matrix(_probe(), tmp_path / "m", "strict")
    assert r.status == PASS and r.verdict == "identical", r.reasons
    batched = open_run(r.run_dir).manifest
    assert batched["settings"]["samples"] == [0, 1] and batched["settings"]["steps"] == 2
    lens = batched["replay"]["prompt_lengths"]
    assert lens[1] > lens[0]  # sample 0's prompt was padded in the batched run
    assert open_run(r.reference).manifest["settings"]["samples"] == [0]
    a, b = open_pair(r.reference, r.run_dir, r.compare)
    ops = b.ops_table()
    assert set(ops["sample"].to_pylist()) <= {0, -1}  # sample 1's records are left out
    assert {"text_encoder", "mmdit", "vae"} <= set(ops["component"].to_pylist())
    te = ops.filter(pc.equal(ops["component"], "text_encoder"))
    assert set(te["sample"].to_pylist()) == {0} and "te_causal_attention" in te["op"].to_pylist()
    assert set(b.steps_table()["sample"].to_pylist()) == {0}  # the trajectory's step records
    assert a.ops_table().num_rows == ops.num_rows > 0


def test_production_is_reported_with_its_first_drift(tmp_path):
    """The verdict depends on the CPU SDPA kernel (its SIMD width), so it is observed; a drift
    is reported with where it starts, on the shared sample."""
    r = _matrix(_probe("production"), tmp_path / "m", "auto")
    assert r.status == OBSERVED, r.reasons
    assert r.verdict in ("drift", "identical")
    if r.verdict == "drift":
        assert r.first_op in ("te_causal_attention", "joint_attention_fused"), r.first_op
        assert r.first_sample == 0 and r.origin is True


def test_strict_expectation_fails_when_the_production_family_runs(tmp_path):
    r = _matrix(_probe(), tmp_path / "m", "auto")
    assert r.status == FINDING and r.verdict == "drift"
    assert any("expected identical, got drift" in why for why in r.reasons), r.reasons


def test_cli_only_lists_and_runs_it(tmp_path):
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    def cli(*args):
        res = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        return res.exit_code, res.output

    code, text = cli("probe", "--only", NAME, "--list", "--json")
    assert code == 0, text
    (listed,) = json.loads(text)["probes"]
    assert listed["name"] == NAME and listed["expected"] == "identical" and listed["pending"] is None
    code, text = cli("probe", "--mode", "auto", "--only", NAME, "--json", "-o", tmp_path / "m")
    assert code == 0, text
    (r,) = json.loads(text)["results"]
    assert r["status"] == OBSERVED and r["verdict"] in ("drift", "identical"), r["reasons"]
    assert (tmp_path / "m" / "heatmaps" / f"{NAME}.png").is_file()
