"""The suspects users report: each variant makes its one change, each probe's declared expectation
holds for strict and for the production family (the probe runs are the slow part)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.model.rope import image_positions, rope_table, text_positions
from drifttool.ops.registry import call, implementation
from drifttool.probes import suspect_variants as SU
from drifttool.probes.catalog import TINY_SETTINGS, catalog
from drifttool.probes.results import NOT_APPLICABLE, OBSERVED, PASS, PENDING
from drifttool.probes.runner import baseline_settings, run_probe
from drifttool.probes.suspects import PRODUCTION, Paired
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec

SUSPECTS = ("lora_unmerged", "lora_merge_bf16", "rope_tables_on_device", "text_mask_all_ones",
            "dp_split_strided", "train_micro_batch", "attention_fallback", "text_encoder_batch")


def _rt(mode: str, *variants):
    return Runtime(mode=mode, variants={v.op: (v.name, v) for v in variants})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# -- declarations --------------------------------------------------------------------------------
def test_every_suspect_is_in_both_matrices_with_an_expectation_per_device():
    strict = {p.name: p for p in catalog()}
    prod = {p.name: p for p in catalog(family="production")}
    assert set(SUSPECTS) <= set(strict) and set(prod) == set(SUSPECTS)
    for name in SUSPECTS:
        assert set(PRODUCTION[name]) == {"cpu", "cuda"}, name
        assert prod[name].source and prod[name].change and prod[name].factor == strict[name].factor
        assert not prod[name].pending, name  # every production expectation on the CPU is measured
    # every suspect runs in strict (an unmerged adapter: LoRA mode unfused-fp32)
    assert [n for n in SUSPECTS if strict[n].pending] == []
    assert strict["rope_tables_on_device"].expect.verdict == "identical"
    # measured on an H200: the rest wait for a measurement there (or cannot run on it)
    assert [p.name for p in catalog(family="production", device="cuda") if not p.pending] == [
        n for n in SUSPECTS if not isinstance(PRODUCTION[n]["cuda"], str)]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown family"):
        catalog(family="fast")


# -- the variants --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_lora_merge_bf16_rounds_the_delta_and_the_sum_to_bf16(mode):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 29, generator=g).to(torch.bfloat16)
    a, b = torch.randn(3, 29, generator=g), torch.randn(37, 3, generator=g) * 0.05
    v = SU.LoraMergeBf16()
    got = call(_rt(mode, v), "lora_merge", w, a, b, 2.0, stream="img")
    base = implementation("lora_merge", "strict" if mode == "strict" else "production")
    fp32 = base(w, a, b, 2.0)
    delta = base(torch.zeros(37, 29), a, b, 2.0)
    want = (w + delta.to(torch.bfloat16)).to(fp32.dtype)  # bf16 + bf16: one rounding
    assert got.dtype == fp32.dtype and torch.equal(_bits(got), _bits(want))
    assert not torch.equal(_bits(got), _bits(fp32))  # the fp32 merge rounds elsewhere


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_rope_tables_on_device_finds_the_table_and_rebuilds_it(mode):
    axes, (h, w), L = (4, 6, 6), (3, 5), 7
    alg = "exact" if mode == "strict" else "polar"
    v = SU.RopeTablesOnDevice(axes, 10000)
    rt = _rt(mode, v)
    x = torch.randn(2, 15, 2, 16)
    img = rope_table(image_positions(h, w), axes, 10000, algorithm=alg)
    txt = rope_table(text_positions(h, w, L), axes, 10000, algorithm=alg)
    own = implementation("multi_axis_rope", "strict" if mode == "strict" else "production")
    with rt.scope(img_grid=(h, w)):
        assert torch.equal(call(rt, "multi_axis_rope", x, img, stream="img"), own(x, img))
        xt = torch.randn(2, L, 2, 16)
        assert torch.equal(call(rt, "multi_axis_rope", xt, txt, stream="txt"), own(xt, txt))
        assert v.applied == 2
        with pytest.raises(UnsupportedConfigError, match="neither the image nor the text"):
            call(rt, "multi_axis_rope", x, img * 1j, stream="img")


def test_text_mask_all_ones_replaces_none_and_keeps_a_given_mask():
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 2, 70, 70, generator=g)  # [B, H, S, S]
    v = SU.TextMaskAllOnes("joint_attn_softmax")
    rt = _rt("strict", v)
    own = implementation("joint_attn_softmax", "strict")
    got = call(rt, "joint_attn_softmax", scores, None, text_len=6, stream="joint")
    assert v.applied == 1 and torch.equal(got, own(scores, None, text_len=6))  # strict: invariant
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[0, 4:6] = False
    got = call(rt, "joint_attn_softmax", scores, mask, text_len=6, stream="joint")
    assert v.applied == 1 and torch.equal(got, own(scores, mask, text_len=6))


def test_attention_kernel_math_runs_sdpa_math():
    g = torch.Generator().manual_seed(7)
    q, k, val = (torch.randn(2, 40, 2, 16, generator=g) for _ in range(3))
    got = call(_rt("auto", SU.AttentionKernelMath()), "joint_attention_fused", q, k, val, None,
               stream="joint")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        want = implementation("joint_attention_fused", "production")(q, k, val, None)
    assert torch.equal(got, want)


def test_strict_refuses_an_unmerged_adapter_in_the_model_dtype(tmp_path):
    """Strict runs ``unfused-fp32`` (``lora_unmerged``); ``unfused`` (factors in the model dtype,
    diffusers' arithmetic) is refused before the run starts."""
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    _, _, folder = baseline_settings(RunSpec())
    model = load_checkpoint(folder)
    add_lora(model, rank=2, alpha=4.0, seed=1, init_b_std=0.05)
    adapter = save_lora(model, tmp_path / "lora")
    with pytest.raises(UnsupportedConfigError, match="runs LoRA modes 'merged' and 'unfused-fp32'"):
        execute(RunSpec(lora=adapter, lora_mode="unfused", steps=2), tmp_path / "run")
    assert not (tmp_path / "run" / "manifest.json").exists()


# -- the probes, run (slow) -------------------------------------------------------------------------
def _runnable(family: str) -> list:
    return [p for p in catalog(TINY_SETTINGS, family=family) if p.name in SUSPECTS and not p.pending]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """``{family: (base spec, baseline run, checkpoint, out dir)}``, each baseline run once."""
    out = {}
    for family, mode in (("strict", "strict"), ("production", "auto")):
        d = tmp_path_factory.mktemp(family)
        base = RunSpec(mode=mode)
        _, _, checkpoint = baseline_settings(base)
        execute(base, d / "runs" / "baseline", overwrite=True)
        out[family] = (base, d / "runs" / "baseline", checkpoint, d)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,p", [(f, p) for f in ("strict", "production") for p in _runnable(f)],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_suspect_probe_meets_its_declared_expectation(baselines, family, p):
    base, baseline, checkpoint, out = baselines[family]
    r = run_probe(p, base, baseline, out, checkpoint)
    on_cpu_noop = isinstance(p.execute, Paired) and p.execute.noop_on is not None
    if on_cpu_noop:  # the RoPE tables: one device on a CPU run, identical and evidence of nothing
        assert r.status == NOT_APPLICABLE and r.verdict == "identical", r.reasons
        assert "built on the CPU either way" in r.reasons[0]
        return
    if p.expect.verdict == "observed":
        assert r.status == OBSERVED and r.verdict in ("identical", "drift"), r.reasons
        return
    assert r.status == PASS, r.reasons
    assert r.verdict == p.expect.verdict
    if p.expect.verdict == "drift":
        assert (r.first_op, r.first_step, r.first_block, r.first_stream) == (
            p.expect.op, p.expect.step, p.expect.block, p.expect.stream)
        assert r.origin is p.expect.origin


@pytest.mark.slow
def test_strict_attention_fallback_is_recorded_in_the_trace(baselines):
    from drifttool.artifact.reader import open_run

    base, baseline, checkpoint, out = baselines["strict"]
    (p,) = [p for p in catalog() if p.name == "attention_fallback"]
    r = run_probe(p, base, baseline, out, checkpoint)
    assert r.status == PASS, r.reasons
    rows = [t for t in open_run(r.run_dir).trace_rows() if t["op"] == "joint_attention_fused"]
    assert rows and all(t["fallback"] and t["requested"] == "strict" and t["actual"] == "production"
                        and "unavailable" in t["reason"].lower() for t in rows), rows[:1]
    assert not any(t["fallback"] for t in open_run(baseline).trace_rows())


def test_text_mask_probe_runs_where_the_model_passes_no_mask():
    """The reference settings of ``text_mask_all_ones`` pad no prompt, so the mask is None there
    (a padded batch would leave the variant nothing to change: NOT APPLICABLE)."""
    (p,) = [p for p in catalog() if p.name == "text_mask_all_ones"]
    spec = dataclasses.replace(RunSpec(), **p.execute.settings)
    assert spec.samples == [TINY_SETTINGS["samples"][-1]] and spec.cfg_layout == "sequential"


def test_pending_is_never_run():
    (p,) = [p for p in catalog(family="production", device="cuda") if p.name == "dp_split_strided"]
    r = run_probe(p, RunSpec(), None, None, None)
    assert r.status == PENDING and r.reasons[0] == p.pending


# -- the command line ----------------------------------------------------------------------------
def _cli(*args):
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    res = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def test_probe_mode_auto_lists_the_production_matrix():
    import json

    code, text = _cli("probe", "--mode", "auto", "--list", "--json")
    assert code == 0, text
    listed = {p["name"]: p for p in json.loads(text)["probes"]}
    assert set(listed) == set(SUSPECTS)
    assert listed["attention_fallback"]["expected"] == "drift at joint_attention_fused (joint, step 0, block 0)"
    assert listed["dp_split_strided"]["expected"] == "observed"


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_the_cuda_catalog_lists_on_any_machine_with_its_pending_reasons(mode):
    # listing runs nothing: a CPU machine shows what --device cuda would run, and why not the rest
    import json

    code, text = _cli("probe", "--mode", mode, "--device", "cuda", "--list", "--json")
    assert code == 0, text
    listed = {p["name"]: p.get("pending") for p in json.loads(text)["probes"]}
    family = "production" if mode == "auto" else "strict"
    want = {p.name: p.pending or None for p in catalog({"device": "cuda"}, family=family, device="cuda")}
    assert listed == want and want["dp_split_strided"] and want["text_encoder_batch"]
    code, text = _cli("probe", "--device", "tpu", "--list")
    assert code == 2 and "unknown device 'tpu'" in text


def test_probe_mode_auto_runs_and_judges_on_the_production_family(tmp_path):
    import json

    from drifttool.artifact.reader import open_run

    code, text = _cli("probe", "--mode", "auto", "--only", "attention_fallback", "--json",
                      "--no-heatmaps", "-o", tmp_path / "m")
    assert code == 0, text
    (r,) = json.loads(text)["results"]
    assert r["status"] == PASS and r["first_op"] == "joint_attention_fused", r["reasons"]
    assert open_run(tmp_path / "m" / "runs" / "baseline").manifest["settings"]["mode"] == "auto"
    kernels = {t["actual"] for t in open_run(r["run_dir"]).trace_rows() if t["op"] == "joint_attention_fused"}
    assert kernels == {"variant:attention_kernel_math"}


@pytest.mark.parametrize("args,needle", [
    (["--mode", "fast"], "unknown --mode 'fast'"),
    (["--mode", "auto", "--distributed"], "--peer and --distributed take no --mode"),
    (["--mode", "AUTO", "--distributed"], "--peer and --distributed take no --mode"),  # read in any case
])
def test_bad_mode_is_one_line_and_exit_2(tmp_path, args, needle):
    code, text = _cli("probe", *args, "-o", tmp_path / "o")
    assert code == 2 and needle in text and len(text.strip().splitlines()) == 1, text


def test_sample_parallel_spawn_takes_no_layout_and_no_faults(tmp_path):
    """``dp_split_strided``'s launcher: ``run_parallel(sample_parallel=N)`` refuses a TP layout or a
    planted fault beside it (a sample-parallel run has neither), before any rank starts."""
    from drifttool.distributed.plan import FAULTS, ParallelDims
    from drifttool.launch import run_parallel

    for dims, faults in ((ParallelDims(tp=2), ()), (ParallelDims(), (sorted(FAULTS)[0],))):
        with pytest.raises(UnsupportedConfigError, match="sample-parallel run has no"):
            run_parallel(RunSpec(), tmp_path / "r", dims, faults=faults, sample_parallel=2)
    assert not (tmp_path / "r").exists()
