"""The semantic pre-check: a planted schedule mismatch is the first finding; ordinary comparisons
(strict vs auto, replay, recompute, CFG layout) are the same program; each program field is named."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from rich.console import Console

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.render import render
from drifttool.diff.report import Verdict
from drifttool.diff.semantic import semantic_check
from drifttool.runner import execute
from drifttool.settings import RunSpec
from drifttool.training.recompute import recompute_run
from drifttool.training.replay import replay_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny-fixture runs at L0: strict with 14 and 15 steps, auto with 14, the 14-step run's
    replay and training recompute, and sequential CFG."""
    root = tmp_path_factory.mktemp("semantic")
    out = {}
    for name, spec in (("s14", {"steps": 14}), ("s15", {"steps": 15}),
                       ("auto14", {"steps": 14, "mode": "auto"}),
                       ("seq14", {"steps": 14, "cfg_layout": "sequential"})):
        out[name] = root / name
        execute(RunSpec(capture="L0", **spec), out[name])
    out["replay14"] = root / "replay14"
    replay_run(out["s14"], out["replay14"])
    out["train14"] = root / "train14"
    recompute_run(out["s14"], out["train14"])
    return out


def _diff(runs, a, b, **kw):
    return diff_runs(open_run(runs[a]), open_run(runs[b]), **kw)


def test_planted_schedule_mismatch_is_the_first_finding(runs, capsys):
    r = _diff(runs, "s14", "s15")
    assert r.semantic.mismatch
    first = r.semantic.differences[0]
    assert first.field == "schedule"
    assert str(first) == "schedule: 14 vs 15 steps (sigma tables of 15 vs 16 points)"
    assert first.a == {"steps": 14, "points": 15} and first.b == {"steps": 15, "points": 16}
    # same seed and generator: the SDE noise differs in shape only, not in provenance
    assert [d.field for d in r.semantic.differences] == ["schedule"]
    assert r.verdict is Verdict.DRIFT and r.exit_code == 1
    render(r)
    out = capsys.readouterr().out
    assert out.startswith("SEMANTIC MISMATCH  1 program difference: the runs are different programs\n"
                          "  - schedule: 14 vs 15 steps (sigma tables of 15 vs 16 points)\nDRIFT")
    data = json.loads(r.to_json())
    assert data["semantic"]["verdict"] == "mismatch"
    assert data["semantic"]["differences"][0]["field"] == "schedule"
    assert data["verdict"] == "drift"


@pytest.mark.parametrize("b", ["auto14", "replay14", "train14", "seq14"])
def test_ordinary_comparisons_are_the_same_program(runs, b):
    r = _diff(runs, "s14", b)
    assert r.semantic.verdict == "match", [str(d) for d in r.semantic.differences]
    assert r.semantic.unrecorded == []


def test_strict_vs_auto_is_drift_not_a_semantic_mismatch(runs, capsys):
    r = _diff(runs, "s14", "auto14", clip_range=1e-4)
    assert r.verdict is Verdict.DRIFT and not r.semantic.mismatch and r.exit_code == 1
    render(r)
    out = capsys.readouterr().out
    assert "SEMANTIC" not in out and out.startswith("DRIFT")


def test_replay_is_identical_and_exit_0(runs):
    r = _diff(runs, "s14", "replay14")
    assert r.verdict is Verdict.IDENTICAL and r.exit_code == 0


# -- each program field, on manifests edited by hand ---------------------------------------------
class _Run:
    """What ``semantic_check`` reads of a run: its manifest and trace rows."""

    def __init__(self, manifest: dict, trace: list[dict] | None = None) -> None:
        self.manifest, self._trace = manifest, trace or []

    def trace_rows(self) -> list[dict]:
        return self._trace


@pytest.fixture(scope="module")
def manifest(runs):
    return json.loads((runs["s14"] / "manifest.json").read_text())


def _check(ma, mb, inputs=(), ta=None, tb=None):
    return semantic_check(_Run(ma, ta), _Run(mb, tb), list(inputs))


def _edit(m, path, value):
    m = copy.deepcopy(m)
    d = m
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return m


@pytest.mark.parametrize("path,value,field,words", [
    (("fingerprint", "scheduler", "image_seq_len"), 96, "shift", "image_seq_len 24 vs 96"),
    (("fingerprint", "scheduler", "timestep_policy"), "pipeline_bf16", "timestep encoding",
     "'sigma_fp32' vs 'pipeline_bf16'"),
    (("fingerprint", "cfg", "cfg_scale"), 4.5, "CFG", "scale 4.0 vs 4.5"),
    (("fingerprint", "cfg", "cfg_scale"), 1.0, "CFG", "on (scale 4.0) vs off"),
    (("fingerprint", "sde", "eta"), 0.7, "SDE", "eta 1.2 vs 0.7"),
    (("fingerprint", "sde", "sde_window"), [0, 3], "SDE", "window [0, 13) vs [0, 3)"),
    (("fingerprint", "weights"), "xxh3_128:0", "weights", "digest"),
])
def test_each_program_field_is_named(manifest, path, value, field, words):
    check = _check(manifest, _edit(manifest, path, value))
    assert [d.field for d in check.differences] == [field]
    assert words in str(check.differences[0])


def test_execution_fields_are_not_program_fields(manifest):
    b = manifest
    for path, value in ((("fingerprint", "cfg", "cfg_layout"), "sequential"),
                        (("fingerprint", "runtime", "mode"), "auto"),
                        (("fingerprint", "dtype_policy", "latents_between_steps"), "bfloat16"),
                        (("settings", "device"), "cuda:0"), (("capture_level",), "L2"),
                        (("layout", "world_size"), 2), (("variants",), ["gelu_exact"])):
        b = _edit(b, path, value)
    assert _check(manifest, b).verdict == "match"


def test_noise_provenance_only_when_the_noise_differs(manifest):
    other = _edit(manifest, ("settings", "seed"), 387)
    assert _check(manifest, other).verdict == "match"  # same noise bytes: nothing consumed differs
    check = _check(manifest, other, ["inputs.x0: differs for common samples 0, 1"])
    assert [str(d) for d in check.differences] == ["noise: x0 differ: seed 386 vs 387"]
    foreign = _edit(_edit(manifest, ("settings", "seed"), None), ("replay", "noise"), None)
    check = _check(manifest, foreign, ["inputs.noise: only in run A"])
    assert check.verdict == "match"
    assert check.unrecorded == ["noise: SDE noise differ and run B records no seed or generator",
                                "seed: not recorded in run B"]


def test_the_mismatch_line_counts_every_line_it_lists(runs, manifest, capsys):
    """A mismatch beside unrecorded fields (a pipeline capture against a drifttool run: no seed):
    the header counts both, as many as the lines under it."""
    foreign = _edit(_edit(manifest, ("settings", "seed"), None), ("replay", "noise"), None)
    check = _check(manifest, _edit(foreign, ("fingerprint", "weights"), "xxh3_128:0"),
                   ["inputs.noise: only in run A"])
    assert (len(check.differences), len(check.unrecorded)) == (1, 2)
    render(dataclasses.replace(_diff(runs, "s14", "s15"), semantic=check), Console(width=200))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("SEMANTIC MISMATCH  1 program difference, 2 unrecorded fields: the runs are "
                        "different programs")
    assert [ln.startswith("  - ") for ln in lines[1:5]] == [True, True, True, False], lines


def test_lora_digest_scale_and_mode(manifest):
    lora = {"digest": "xxh3_128:1", "scale": 1.0, "mode": "merged"}
    a = {**manifest, "lora": lora}
    assert _check(manifest, a).differences[0].detail == "an adapter in run B only"
    b = {**manifest, "lora": {**lora, "mode": "unmerged", "scale": 0.5}}
    (d,) = _check(a, b).differences
    assert d.field == "LoRA" and d.detail == "scale 1.0 vs 0.5, mode 'merged' vs 'unmerged'"


def _site(**kw):
    row = {"rank": 0, "device": "cpu", "component": "mmdit", "op": "joint_attention_fused",
           "block": 0, "stream": "joint", "call": 0, "requested": "strict", "actual": "strict",
           "kernel": "strict.attn", "fallback": False, "reason": ""}
    return {**row, **kw}


def test_attention_fallback_and_kernel(manifest):
    fell = _site(actual="production", kernel="sdpa", fallback=True, reason="no strict kernel")
    (d,) = _check(manifest, manifest, ta=[_site()], tb=[fell]).differences
    assert d.field == "attention backend"
    assert d.detail.startswith("requested strict in both, actual strict vs production")
    assert d.detail.endswith("fallback: no strict kernel")
    kern = _check(manifest, manifest, ta=[_site(kernel="flash")], tb=[_site(kernel="math")])
    assert "kernel flash vs math" in str(kern.differences[0])
    # another family or device on purpose: strict vs auto, CPU vs CUDA
    prod = _site(requested="production", actual="production", kernel="sdpa")
    assert _check(manifest, manifest, ta=[_site()], tb=[prod]).verdict == "match"
    gpu = _site(device="cuda:0", kernel="triton")
    assert _check(manifest, manifest, ta=[_site()], tb=[gpu]).verdict == "match"
    # a non-attention operator's kernel is an execution detail
    gemm = _site(op="mlp_up_gemm_gelu", kernel="other")
    assert _check(manifest, manifest, ta=[_site(op="mlp_up_gemm_gelu")], tb=[gemm]).verdict == "match"
