"""The peer probe matrix on the CPU: diffusers' ``QwenImageTransformer2DModel`` (the tiny
fixture's weights, loaded with diffusers) as the production peer.

Invariant probes must come out IDENTICAL with every record of both runs compared; a planted
1-ULP weight change must be found at the operator it feeds; a wrong declaration must be a
FINDING; CPU expectations that production arithmetic makes machine-dependent are OBSERVED
(reported, not judged) and do not move the exit code. The full matrix on the CPU is the slow
test at the end; the CUDA verdicts are ``tests/gpu/test_peer_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.errors import DriftToolError  # noqa: E402
from drifttool.probes import peer as P  # noqa: E402
from drifttool.probes import peer_catalog as PC  # noqa: E402
from drifttool.probes.runner import FINDING, OBSERVED, PASS, PENDING  # noqa: E402

FAST = ("repeat", "batch_order_reversed", "grad_enabled", "timestep_bf16", "pad_garbage",
        "sdpa_math", "sdpa_efficient", "ulp_norm_q_gain")
INVARIANTS = ("repeat", "batch_order_reversed", "grad_enabled", "timestep_bf16", "pad_garbage")


@pytest.fixture(scope="module")
def transformer():
    return P.load_peer(None)


@pytest.fixture(scope="module")
def matrix(transformer, tmp_path_factory):
    out = tmp_path_factory.mktemp("peer")
    wrong = [
        # an invariant declaration on a run that changes a weight: must be a finding
        PC.PeerProbe(name="planted_but_declared_identical", factor="control", kind="invariant",
                    change="one ULP planted, declared identical", plant=PC.PLANT,
                    expect={"cpu": PC.PeerExpect(verdict="identical")}),
        # batch 1 against batch 2: identical on the common sample, but not every record compared
        PC.PeerProbe(name="batch_single_declared_identical", factor="control", kind="invariant",
                    change="sample 1 alone", spec={"samples": [1]},
                    expect={"cpu": PC.PeerExpect(verdict="identical")}),
        # the right operator, the wrong block
        PC.PeerProbe(name="planted_wrong_block", factor="control", kind="sensitivity",
                    change="one ULP planted, declared at block 1", plant=PC.PLANT,
                    expect={"cpu": PC.PeerExpect(verdict="drift", op="qk_rmsnorm", block=1)}),
    ]
    probes = PC.select(PC.peer_catalog(), ",".join(FAST)) + wrong
    m = P.run_peer_matrix(probes, out, transformer=transformer, device="cpu")
    return m, {r.name: r for r in m.results}, out


def _diff(out, name):
    return json.loads((out / "diffs" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", INVARIANTS)
def test_invariants_identical_with_every_record_compared(matrix, name):
    _, res, out = matrix
    r = res[name]
    assert (r.status, r.verdict, r.differing_records) == (PASS, "identical", 0), r
    counts = _diff(out, name)["counts"]
    base = open_run(out / "runs" / "baseline")
    assert counts["ops"]["matched"] == counts["ops"]["a"] == counts["ops"]["b"] \
        == base.ops_table().num_rows > 0
    assert counts["steps"]["matched"] == counts["steps"]["a"] == base.steps_table().num_rows > 0
    assert base.manifest["capture_level"] == "L2"  # row digests compared too


def test_baseline_is_the_declared_peer_baseline(matrix):
    m, _, out = matrix
    s = m.settings
    assert (s["mode"], s["steps"], s["pad_prompts_to"], s["timestep_policy"], s["cfg_layout"]) == (
        "auto", PC.PEER_STEPS, PC.PEER_SLOTS, "pipeline_bf16", "batched")
    man = open_run(out / "runs" / "baseline").manifest
    assert man["model_source"]["implementation"] == "diffusers.QwenImageTransformer2DModel"
    assert s["peer"]["device"] == "cpu" and s["peer"]["diffusers_version"]


def test_planted_ulp_found_at_its_operator(matrix):
    _, res, out = matrix
    r = res["ulp_norm_q_gain"]
    assert r.status == PASS and r.verdict == "drift", r
    assert (r.first_op, r.first_stream, r.first_block, r.first_step, r.origin) == (
        "qk_rmsnorm", "img", 0, 0, True)
    fd = _diff(out, "ulp_norm_q_gain")["first_drift"]
    assert fd["call"] == 0 and fd["rows"]["n_differ"] >= 1  # norm_q (call 0), rows named (L2)


def test_wrong_declarations_are_findings(matrix):
    m, res, _ = matrix
    r = res["planted_but_declared_identical"]
    assert r.status == FINDING and "expected identical, got drift" in r.reasons[0]
    r = res["batch_single_declared_identical"]
    assert r.verdict == "identical" and r.status == FINDING
    assert any("only in A" in why for why in r.reasons), r.reasons
    r = res["planted_wrong_block"]
    assert r.status == FINDING and any("block 0, expected 1" in why for why in r.reasons)
    assert m.exit_code == 1


def test_sdpa_kernel_read_back_per_call(matrix):
    m, res, out = matrix
    kernels = m.settings["attention_kernels"]
    assert kernels["sdpa_math"] == ["diffusers.attention:native/torch.sdpa:MATH"]
    assert kernels["baseline"] != kernels["sdpa_math"] and len(kernels["baseline"]) == 1
    rows = [r for r in open_run(out / "runs" / "sdpa_math").trace_rows()
            if r["op"] == "joint_attention_fused"]
    # one trace site per block, read back at each of its calls: 2 steps (batched CFG: one
    # forward a step); a site whose kernel changed between calls would keep the latest
    assert len(rows) == 2 and [r["calls"] for r in rows] == [PC.PEER_STEPS] * 2
    assert {r["device"] for r in rows} == {"cpu"}
    assert {r["kernel"] for r in rows} == {"diffusers.attention:native/torch.sdpa:MATH"}
    ctx = _diff(out, "sdpa_math")["context"]
    assert any("trace" in c and "MATH" in c for c in ctx), ctx


def test_cpu_observed_and_pending_are_not_judged(matrix):
    m, res, _ = matrix
    assert res["sdpa_math"].status == OBSERVED
    assert res["sdpa_math"].verdict == "drift"  # reported as measured
    assert res["sdpa_math"].first_op == "joint_attention_fused"
    r = res["sdpa_efficient"]
    assert r.status == PENDING and r.run_dir is None and "EFFICIENT_ATTENTION" in r.reasons[0]
    assert all(res[n].ok for n in FAST)


def test_planted_weight_is_restored(transformer):
    w = dict(transformer.named_parameters())[PC.PLANT[0]]
    before = w.detach().clone()
    with P.planted_ulp(transformer, PC.PLANT):
        flat = w.detach().view(-1)
        assert flat[PC.PLANT[1]] > before.view(-1)[PC.PLANT[1]]
        assert torch.equal(flat[1:].view(torch.int16), before.view(-1)[1:].view(torch.int16))
    assert torch.equal(w.detach().view(torch.int16), before.view(torch.int16))
    with pytest.raises(DriftToolError, match="no such weight"):
        with P.planted_ulp(transformer, ("no.such.weight", 0)):
            pass


def test_batch_of_three_on_an_odd_grid(transformer, tmp_path):
    """Batch 3 (odd prompt lengths 7, 13, 7), a 3x5 patch grid: batch position and masked
    garbage stay invariant; repetition too."""
    fx = P.grid_fixture(tmp_path / "fx", (3, 5))
    base = dataclasses.replace(P.peer_baseline(fixture=fx), samples=[0, 1, 2])
    probes = PC.select(PC.peer_catalog(samples=(0, 1, 2)), "batch_order_reversed,pad_garbage")
    m = P.run_peer_matrix(probes, tmp_path / "m", transformer=transformer, base=base)
    assert m.settings["img_grid"] == [3, 5] and m.settings["samples"] == [0, 1, 2]
    assert [(r.name, r.status, r.verdict) for r in m.results] == [
        ("batch_order_reversed", PASS, "identical"), ("pad_garbage", PASS, "identical")]


def test_declarations():
    with pytest.raises(ValueError, match="invariant cannot expect drift"):
        PC.PeerProbe(name="x", factor="f", kind="invariant", change="c",
                    expect={"cpu": PC.PeerExpect(verdict="drift")})
    with pytest.raises(ValueError, match="names its operator"):
        PC.PeerProbe(name="x", factor="f", kind="sensitivity", change="c",
                    expect={"cpu": PC.PeerExpect(verdict="observed")})
    with pytest.raises(ValueError, match="only a drift expectation"):
        PC.PeerExpect(verdict="identical", op="qk_rmsnorm")
    cat = {p.name: p for p in PC.peer_catalog()}
    assert {p.expect["cuda"].verdict for n, p in cat.items() if p.kind == "invariant"} == {"identical"}
    assert all(cat[n].expect["cuda"].verdict == "drift"
               for n in ("pad_100", "pad_160", "sdpa_math", "sdpa_efficient"))
    assert "cpu" not in cat["sdpa_efficient"].expect
    with pytest.raises(DriftToolError, match="unknown peer probe"):
        PC.select(list(cat.values()), "repeat,nope")
    with pytest.raises(DriftToolError, match="multiple of 16"):
        P.pixel_grid(1000, 1024)
    with pytest.raises(DriftToolError, match="multiple of 16 pixels from 16 to 16384"):
        P.pixel_grid(1_600_000, 1_600_000)  # the bound of drifttool run, not an allocation
    assert P.pixel_grid(1664, 928) == (104, 58) and P.pixel_grid(None, None) is None
    with pytest.raises(DriftToolError, match="unknown device"):
        P.check_device("tpu")


@pytest.mark.slow  # the whole peer matrix on the CPU (≈ 15 s on 2 cores)
def test_full_peer_matrix_on_the_cpu(transformer, tmp_path):
    m = P.run_peer_matrix(PC.peer_catalog(), tmp_path, transformer=transformer, device="cpu")
    got = {r.name: r.status for r in m.results}
    assert m.exit_code == 0, [(r.name, r.reasons) for r in m.findings]
    assert got["sdpa_efficient"] == PENDING
    assert {got[n] for n in ("pad_100", "pad_160", "sdpa_math")} == {OBSERVED}
