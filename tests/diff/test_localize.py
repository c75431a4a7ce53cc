"""``drifttool diff --localize``: an L0 pair of runs ends with the answer an L2 pair gives.

Each planted difference is run four times on the tiny fixture (A and B at L0, A and B at L2);
``localize`` on the L0 pair must name the same first drift — operator, block, branch, stream,
sample, rows, digests — as the plain diff of the L2 pair. Identical runs, a drift that starts in
x_0, and inputs that cannot be re-executed are checked too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport, StepDrift, Verdict
from drifttool.training.localize import localize, pick_step
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.probes import sampler_variants as SV
from drifttool.probes import variants as V
from drifttool.runner import execute
from drifttool.settings import RunSpec
from drifttool.training.step_replay import replay_step, step_model
from drifttool.training.stored import load_rollout


def _plant(step: int = 2):
    """A one-ULP change in the output projection (``latent_proj_gemm`` after the last block) at
    ``step``, uncond row of sample 1, patch row 7: visible in v_t at L0 (a one-ULP change inside
    a block may round away before v_t). A fresh instance: the variant counts its calls."""
    return {"latent_proj_gemm": V.PlantUlp("latent_proj_gemm", step=step, block=2, call=0,
                                           sample=1, branch="uncond", row=7, rest=(3,)).entry()}


def _mask_dropped():
    """Padded prompt tokens attended (strict joint attention's softmax internal)."""
    return {"joint_attn_softmax": V.AttnMaskDropped("joint_attn_softmax").entry()}


def _latents_bf16():
    """The next latent rounded to bf16 between steps: the drift starts in the SDE step."""
    return {"flow_sde_step_logp": SV.LatentsBf16().entry()}


def _sigma_pixels():
    """The sigma table's dynamic shift from 4N: the drift starts before step 0 (step -1)."""
    return {"flow_sigma_table": SV.SigmaSeqLenPixels().entry()}


PLANTS = {"plant_ulp_step2": _plant, "attn_mask_dropped": _mask_dropped,
          "latents_bf16": _latents_bf16, "sigma_seq_len_pixels": _sigma_pixels}
EXPECT = {"plant_ulp_step2": ("latent_proj_gemm", 2, 2),
          "attn_mask_dropped": ("joint_attn_softmax", 0, 0),
          "latents_bf16": ("flow_sde_step_logp", 0, -2),
          "sigma_seq_len_pixels": ("flow_sigma_table", -1, -2)}
"""(operator, step, block) of each plant's first drift (independent of the code under test:
where the variant acts)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, level, **spec)`` -> path of a run made once per module."""
    root = tmp_path_factory.mktemp("localize")
    made = {}

    def make(name: str, level: str, **spec):
        key = (name, level)
        if key not in made:
            made[key] = root / f"{name}-{level}"
            execute(RunSpec(capture=level, **spec), made[key])
        return made[key]

    return make


def _same_first_drift(loc_fd, l2_fd):
    # as JSON text: sigma is NaN for records made before step 0 (NaN != NaN as floats)
    a, b = (json.dumps(dataclasses.asdict(fd), sort_keys=True) for fd in (loc_fd, l2_fd))
    assert a == b, f"localized {loc_fd.where()} vs L2 pair {l2_fd.where()}"


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_variant_localizes_as_an_l2_pair(runs, plant, tmp_path):
    make = PLANTS[plant]
    a0 = runs("base", "L0")
    b0 = runs(plant, "L0", variants=make())
    l2 = diff_runs(open_run(runs("base", "L2")), open_run(runs(plant, "L2", variants=make())))
    assert l2.first_drift is not None and l2.first_drift.kind == "op"
    report, loc = localize(a0, b0, variants_b=make(), out_dir=tmp_path / "loc")
    assert report.level == "L0" and report.first_drift.kind == "step"
    assert loc.status == "localized", loc.reason
    assert loc.step == report.first_drift.step == max(0, l2.first_drift.step)
    assert loc.reproduced == {"A": True, "B": True}, loc.mismatches
    _same_first_drift(loc.first_drift, l2.first_drift)
    fd = loc.first_drift
    assert (fd.op, fd.step, fd.block) == EXPECT[plant], fd.where()
    if plant == "attn_mask_dropped":  # attention unfused: the softmax internal is named
        assert (loc.first_drift.op, loc.first_drift.role, loc.first_drift.block) == \
            ("joint_attn_softmax", "internal", 0), loc.first_drift.where()
    if plant == "plant_ulp_step2":  # drift from step 2 on: localized at step 2, with its row
        assert loc.step == 2 and loc.first_drift.op == "latent_proj_gemm"
        assert (loc.first_drift.block, loc.first_drift.branch, loc.first_drift.sample) == (2, "uncond", 1)
        assert loc.first_drift.rows is not None and loc.first_drift.rows.n_differ == 1
        assert str(loc.first_drift.rows.first[0]) == str(l2.first_drift.rows.first[0])
    kept = [open_run(p) for p in loc.artifacts]
    for run in kept:  # the re-executed artifacts hold the sigma table and the one step, at L2
        run.check()
        assert run.capture_level == "L2" and not run.complete
        assert set(run.steps_table()["step"].to_pylist()) == {loc.step}
        assert set(run.ops_table()["step"].to_pylist()) == {-1, loc.step}
    assert kept[1].manifest["replay_of"]["path"] == str(b0)
    assert loc.estimate_l2_pair_seconds > 0 and loc.seconds > 0
    assert loc.step_seconds["A"] > 0 and loc.num_steps == {"A": 4, "B": 4}


def test_a_first_drift_before_the_first_step_has_nothing_to_localize(runs, cli, tmp_path):
    """Runs of other step counts at L1 part at the sigma table, made before step 0: re-executing
    step 0 at L2 (which it did, "localized" at the table it started from) tells nothing more."""
    a = runs("base", "L1")
    b = runs("five-steps", "L1", steps=5)
    report, loc = localize(a, b, out_dir=tmp_path / "loc")
    assert report.first_drift.step == -1 and report.first_drift.op == "flow_sigma_table"
    assert loc.status == "nothing_to_localize" and loc.step is None, loc.reason
    assert "before the first step (the sigma table)" in loc.reason and not (tmp_path / "loc").exists()
    code, out = cli("diff", a, b, "--localize")
    assert code == 1 and "nothing to localize" in out and "nothing_to_localize" not in out, out


def test_an_l2_pair_is_already_localized_by_its_own_records(runs, cli, tmp_path):
    """Both runs at L2 with the attention's internals: their records name the first drift, with
    its rows, as a re-executed step would; nothing is re-executed. Without the internals the
    re-executed step still adds them."""
    a, b = runs("base", "L2"), runs("plant_ulp_step2", "L2", variants=_plant())
    report, loc = localize(a, b, variants_b=_plant(), out_dir=tmp_path / "loc")
    assert loc.status == "already_localized" and loc.step == 2 == loc.first_drift.step, loc.reason
    assert not (tmp_path / "loc").exists() and not loc.step_seconds and not loc.reexecuted
    _same_first_drift(loc.first_drift, report.first_drift)
    assert loc.first_drift.op == "latent_proj_gemm" and loc.first_drift.rows is not None
    assert "their own records name the first drift" in loc.reason and "step 2" in loc.reason
    code, out = cli("diff", a, b, "--localize")
    assert code == 1 and "already localized" in out and "nothing re-executed" in out, out
    assert "re-executed at L2" not in out and "│ artifacts" not in out, out  # nothing re-executed
    # the step of the first drift, as the diff's own JSON names it (it was null)
    code, out = cli("diff", a, b, "--localize", "--json")
    data = json.loads(out)
    assert code == 1 and data["localize"]["step"] == data["first_drift"]["step"] == 2, out
    assert "nothing re-executed" in data["localize"]["why_step"], out
    # --localize-dir serves a re-execution: unused here, said in one note on stderr
    code, out = cli("diff", a, b, "--localize-dir", tmp_path / "keep")
    assert code == 1 and not (tmp_path / "keep").exists(), out
    assert (f"note: --localize-dir {tmp_path / 'keep'}: unused, as no step was re-executed (already "
            "localized)") in out.splitlines(), out
    # runs from another x_0: their first operator record consumed the difference, born nowhere
    _, loc = localize(a, runs("seed-1", "L2", seed=1))
    assert loc.status == "nothing_to_localize" and "different x_0" in loc.reason, loc.reason
    bare = runs("plant_ulp_step2-nointernals", "L2", variants=_plant(), internals=False)
    _, loc = localize(runs("base-nointernals", "L2", internals=False), bare, variants_b=_plant())
    assert loc.status == "localized" and loc.step == 2, loc.reason


def test_identical_runs_have_nothing_to_localize(runs, cli):
    a = runs("base", "L0")
    b = runs("base-again", "L0")
    report, loc = localize(a, b)
    assert report.verdict.value == "identical"
    assert loc.status == "nothing_to_localize" and loc.step is None and loc.first_drift is None
    assert "identical" in loc.reason
    code, out = cli("diff", a, b, "--localize", "--json")
    data = json.loads(out)
    assert code == 0 and data["verdict"] == "identical", out
    assert data["localize"]["status"] == "nothing_to_localize", out


def test_cli_timestep_policy_localizes_at_step_1_as_an_l2_pair(runs, cli, tmp_path):
    """A difference the manifest describes (the model timestep encoding): sigma_0 = 1 encodes
    exactly, so the runs drift from step 1 on; --localize names that step's first operator."""
    a0, b0 = runs("base", "L0"), runs("bf16-timestep", "L0", timestep_policy="pipeline_bf16")
    l2 = diff_runs(open_run(runs("base", "L2")),
                   open_run(runs("bf16-timestep", "L2", timestep_policy="pipeline_bf16")))
    code, out = cli("diff", a0, b0, "--localize", "--json")
    assert code == 1, out
    data = json.loads(out)
    loc = data["localize"]
    assert data["verdict"] == "drift" and data["level"] == "L0"
    assert loc["status"] == "localized" and loc["step"] == 1 == l2.first_drift.step, loc["reason"]
    fd = loc["first_drift"]
    want = json.loads(json.dumps(dataclasses.asdict(l2.first_drift)))
    assert {k: fd[k] for k in want} == want
    assert loc["estimate_l2_pair_seconds"] > 0 and "estimate" in loc["estimate_basis"]
    assert loc["artifacts"] is None  # temporary
    code, text = cli("diff", a0, b0, "--localize-dir", tmp_path / "keep")
    assert code == 1, text
    for needle in ("localize: step 1 re-executed at L2", "L2 pair of runs", "estimate",
                   l2.first_drift.where(), "reproduced"):
        assert needle in text, text
    assert (tmp_path / "keep" / "a" / "manifest.json").is_file()


def test_drift_in_x0_has_nothing_to_localize(runs):
    a = runs("base", "L0")
    b = runs("seed-7", "L0", seed=7)
    report, loc = localize(a, b)
    assert report.verdict.value == "drift"
    assert loc.status == "nothing_to_localize" and loc.step is None
    assert "x_t of step 0 differs" in loc.boundary and "x_0" in loc.boundary, loc.boundary


def test_a_variant_the_manifest_only_names_is_refused_in_one_line(runs, cli):
    a0, b0 = runs("base", "L0"), runs("plant_ulp_step2", "L0", variants=_plant())
    with pytest.raises(DriftToolError, match="replaced operators"):
        localize(a0, b0)
    code, out = cli("diff", a0, b0, "--localize")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert "latent_proj_gemm=plant_ulp" in lines[0], out


def test_a_variant_elsewhere_is_not_reproduced(runs):
    """A variant of the right name planted at another place does not reproduce run B's stored
    step: the result says so instead of reporting a localization."""
    a0, b0 = runs("base", "L0"), runs("plant_ulp_step2", "L0", variants=_plant())
    elsewhere = {"latent_proj_gemm": V.PlantUlp("latent_proj_gemm", step=2, block=2, call=0,
                                                sample=0, branch="cond", row=3, rest=(1,)).entry()}
    _, loc = localize(a0, b0, variants_b=elsewhere)
    assert loc.step == 2 and loc.reproduced == {"A": True, "B": False}
    assert loc.status == "unconfirmed" and loc.mismatches["B"], loc.reason
    assert "did not reproduce run B" in loc.reason


def test_missing_fixture_is_one_line(runs, cli, tmp_path):
    a0 = runs("base", "L0")
    b = tmp_path / "b"
    shutil.copytree(runs("bf16-timestep", "L0", timestep_policy="pipeline_bf16"), b)
    m = json.loads((b / "manifest.json").read_text())
    m["settings"]["fixture"] = "no-such-fixture"
    (b / "manifest.json").write_text(json.dumps(m))
    code, out = cli("diff", a0, b, "--localize")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert "no-such-fixture" in lines[0], out


def test_missing_replay_inputs_are_one_line(runs, cli, tmp_path):
    a0 = runs("base", "L0")
    b = tmp_path / "b"
    shutil.copytree(runs("bf16-timestep", "L0", timestep_policy="pipeline_bf16"), b)
    (b / "inputs.safetensors").unlink()
    m = json.loads((b / "manifest.json").read_text())
    m["complete"] = False  # an interrupted run that never wrote its inputs
    (b / "manifest.json").write_text(json.dumps(m))
    code, out = cli("diff", a0, b, "--localize")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert "no replay inputs" in lines[0], out


def test_a_step_the_run_lacks_is_one_line(tmp_path):
    out = tmp_path / "cut"
    execute(RunSpec(capture="L0"), out, max_steps=2)  # incomplete: steps 0 and 1
    stored = load_rollout(out, need_latents=False)
    with pytest.raises(ArtifactError, match="no stored x_t of step 3") as e:
        replay_step(stored, 3, tmp_path / "re", model=step_model(stored))
    assert "\n" not in str(e.value)


def test_localize_dir_must_not_hold_the_artifacts_already(runs, cli, tmp_path):
    a0, b0 = runs("base", "L0"), runs("bf16-timestep", "L0", timestep_policy="pipeline_bf16")
    assert cli("diff", a0, b0, "--localize-dir", tmp_path / "k")[0] == 1
    code, out = cli("diff", a0, b0, "--localize-dir", tmp_path / "k")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert f"{tmp_path / 'k' / 'a'} exists" in lines[0], out


def test_localize_dir_refuses_a_run_directory(runs, cli):
    """A --localize-dir that is an artifact (one of the compared runs, or any other) is refused
    before anything is written into it: the run stays readable and unchanged."""
    a0, b0 = runs("base", "L0"), runs("bf16-timestep", "L0", timestep_policy="pipeline_bf16")
    before = sorted(p.name for p in a0.iterdir())
    code, out = cli("diff", a0, b0, "--localize-dir", a0)
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is a drifttool artifact" in lines[0], out
    assert sorted(p.name for p in a0.iterdir()) == before
    assert cli("diff", a0, a0)[0] == 0


def test_cli_model_dtype_loads_each_runs_model(runs, cli):
    """Another difference the manifest describes (the model dtype): each run is re-executed with
    its own model, and the answer is the L2 pair's."""
    a0, b0 = runs("base", "L0"), runs("fp32", "L0", dtype="float32")
    l2 = diff_runs(open_run(runs("base", "L2")), open_run(runs("fp32", "L2", dtype="float32")))
    code, out = cli("diff", a0, b0, "--localize", "--json")
    loc = json.loads(out)["localize"]
    assert code == 1 and loc["status"] == "localized", out
    assert loc["shared_model"] is False and loc["reproduced"] == {"A": True, "B": True}
    want = json.loads(json.dumps(dataclasses.asdict(l2.first_drift)))
    assert {k: loc["first_drift"][k] for k in want} == want


def _step(step, identical=False, carried_in=False):
    return StepDrift(phase="rollout", step=step, sigma=1.0, sigma_next=0.5, identical=identical,
                     carried_in=carried_in, first_op=None, ops_differ=0, missing=0)


def _report(*steps):
    return DiffReport(verdict=Verdict.DRIFT, reason="", run_a="a", run_b="b", steps=list(steps))


def test_pick_step_between_steps():
    """x_t of step 2 differs after a matching step 1: said, and a later step whose x_t matches
    again is taken; without one, nothing is localized."""
    c = pick_step(_report(_step(0, True), _step(1, True), _step(2, carried_in=True),
                          _step(3, carried_in=True)))
    assert c.step is None and "x_t of step 2 differs" in c.boundary and "between steps" in c.boundary
    c = pick_step(_report(_step(0, True), _step(1, carried_in=True), _step(2, True), _step(3)))
    assert c.step == 3 and "x_t of step 1 differs" in c.boundary
    c = pick_step(_report(_step(0, True), _step(1), _step(2, carried_in=True)))
    assert c.step == 1 and c.boundary is None
    c = pick_step(_report(_step(0, carried_in=None)))
    assert c.step is None and "no x_t record" in c.why


def test_a_recompute_is_refused_in_one_line(runs, cli, tmp_path):
    from drifttool.training.recompute import recompute_run

    a0, b0 = runs("base", "L0"), runs("bf16-timestep", "L0", timestep_policy="pipeline_bf16")
    recompute_run(b0, tmp_path / "train")
    code, out = cli("diff", a0, tmp_path / "train", "--localize")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is not a rollout artifact" in lines[0], out
    # two recomputes that drift (train records only): refused, not "no rollout step differs"
    recompute_run(a0, tmp_path / "train-a")
    code, out = cli("diff", tmp_path / "train-a", tmp_path / "train", "--localize")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is not a rollout artifact" in lines[0], out


def test_a_fixture_that_does_not_exist_is_refused_with_nothing_to_localize(runs, cli):
    a = runs("base", "L0")
    code, out = cli("diff", a, a, "--localize", "--fixture", "no-such-fixture")
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "no fixture 'no-such-fixture'" in lines[0], out
