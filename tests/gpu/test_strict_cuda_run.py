"""The main job in strict mode on the GPU: ``drifttool run --device cuda --mode strict`` on the
embedded default fixture, every transformer and sampler operator on the strict CUDA family.

Twice → IDENTICAL; ``--samples 1`` equals row 1 of ``--batch 3`` (and the diff says identical);
``replay`` IDENTICAL; strict vs ``--mode auto`` on CUDA drifts (exit 1) and names the first
drifting operator; strict CUDA vs strict CPU drifts (exit 1, naming an operator: the GEMMs' K order
differs; the tolerance profile comes separately). Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

from drifttool.artifact.reader import open_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RUN = ("--device", "cuda", "--mode", "strict")


@pytest.fixture(scope="module")
def strict_cuda_run(tmp_path_factory):
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    out = tmp_path_factory.mktemp("strict_cuda") / "a"
    res = CliRunner().invoke(app, ["run", "-o", str(out), *RUN], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return out


def _sample_digests(run_dir, sample):
    run = open_run(run_dir)
    key = ("phase", "step", "branch", "block", "stream", "op", "call", "index")
    ops = {tuple(r[k] for k in key): r["digest"] for r in run.ops_table().to_pylist() if r["sample"] == sample}
    steps = {(r["phase"], r["step"], r["branch"], r["quantity"]): r["digest"]
             for r in run.steps_table().to_pylist() if r["sample"] == sample}
    return ops, steps


def test_strict_run_on_cuda_uses_the_strict_cuda_family(strict_cuda_run):
    run = open_run(strict_cuda_run)
    m = run.manifest
    assert m["complete"] and m["settings"]["device"] == "cuda" and m["settings"]["mode"] == "strict"
    devices, contracts = {}, {}
    for r in run.trace_rows():
        devices.setdefault(r["op"], set()).add(r["device"])
        if "contract" in r:
            contracts.setdefault(r["op"], set()).add(r["contract"])
    assert devices.pop("flow_sigma_table") == {"cpu"}  # no tensors: it runs on the CPU
    assert devices and all(d == {"cuda:0"} for d in devices.values()), devices
    for op, ids in contracts.items():
        if op != "flow_sigma_table":
            assert all(c.endswith(".cuda1") for c in ids), (op, ids)


def test_two_strict_cuda_runs_are_identical(cli, tmp_path, strict_cuda_run):
    code, out = cli("run", "-o", tmp_path / "b", *RUN)
    assert code == 0, out
    code, out = cli("diff", strict_cuda_run, tmp_path / "b")
    assert code == 0 and "IDENTICAL" in out, out


def test_batch_3_row_1_equals_samples_1(cli, tmp_path):
    assert cli("run", "--batch", "3", "-o", tmp_path / "b3", *RUN)[0] == 0
    assert cli("run", "--samples", "1", "-o", tmp_path / "b1", *RUN)[0] == 0
    ops3, steps3 = _sample_digests(tmp_path / "b3", 1)
    ops1, steps1 = _sample_digests(tmp_path / "b1", 1)
    assert len(ops1) > 100 and len(steps1) > 10
    assert ops1 == ops3 and steps1 == steps3
    code, out = cli("diff", tmp_path / "b1", tmp_path / "b3", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["verdict"] == "identical", out


def test_replay_of_a_strict_cuda_run_is_identical(cli, tmp_path, strict_cuda_run):
    code, out = cli("replay", strict_cuda_run, "-o", tmp_path / "replay")
    assert code == 0, out
    code, out = cli("diff", strict_cuda_run, tmp_path / "replay")
    assert code == 0 and "IDENTICAL" in out, out


def test_strict_vs_auto_on_cuda_names_the_first_drifting_operator(cli, tmp_path, strict_cuda_run):
    assert cli("run", "-o", tmp_path / "auto", "--device", "cuda", "--mode", "auto")[0] == 0
    code, out = cli("diff", strict_cuda_run, tmp_path / "auto", "--json")
    assert code == 1, out
    rep = json.loads(out)
    assert rep["verdict"] == "drift" and rep["first_drift"]["op"], rep["first_drift"]
    print(f"\nstrict CUDA vs auto CUDA: first drift at {rep['first_drift']}")


def test_strict_cuda_vs_strict_cpu_drifts_naming_an_operator(cli, tmp_path, strict_cuda_run):
    assert cli("run", "-o", tmp_path / "cpu", "--device", "cpu", "--mode", "strict")[0] == 0
    code, out = cli("diff", tmp_path / "cpu", strict_cuda_run, "--json")
    assert code == 1, out
    rep = json.loads(out)
    assert rep["verdict"] == "drift" and rep["first_drift"]["op"], rep["first_drift"]
    print(f"\nstrict CPU vs strict CUDA: first drift at {rep['first_drift']}")
