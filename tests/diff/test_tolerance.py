"""``diff --tolerance``: differing records judged within or beyond a declared profile, the first
record beyond named; profiles derived from a pair of runs; bad profiles refused in one line."""

from __future__ import annotations

import json
import types

import pytest

from drifttool.artifact import open_run
from drifttool.diff import Verdict, diff_runs
from drifttool.diff.compare import aligned_tables
from drifttool.diff.tolerance import (PROFILE_SCHEMA, PROFILE_VERSION, available, load_profile, measure,
                                      run_scope)
from drifttool.errors import DriftToolError

PLANT = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9, "add": 1e-3}


def _profile(tmp_path, ops, steps, name="p"):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "name": name,
                                "ops": ops, "steps": steps}))
    return path


@pytest.fixture
def pair(make_run):
    return make_run("a"), make_run("b", plant=PLANT)


def test_measured_bounds_hold_their_own_pair(pair, tmp_path):
    ra, rb = (open_run(p) for p in pair)
    derived = measure(ra, rb, *aligned_tables(ra, rb), factor=4.0)
    assert derived["ops"]["joint_attn"]["rel_l2"] > 0  # the planted record moved its summary
    assert derived["steps"]["v_t"]["max_abs"] > 0
    assert set(derived["ops"]["txt_mlp"].values()) == {0.0}  # never differs: bound 0 (byte-equal)
    bounds = [v for table in ("ops", "steps") for b in derived[table].values() for v in b.values() if v]
    assert bounds and all(float(f"{v:.2g}") == v for v in bounds), bounds  # 2 significant digits, no float noise
    path = _profile(tmp_path, derived["ops"], derived["steps"])
    r = diff_runs(ra, rb, tolerance=load_profile(path))
    assert r.verdict is Verdict.DRIFT and r.tolerance.ok and r.exit_code == 0
    assert r.tolerance.beyond == {"steps": 0, "ops": 0}
    assert r.tolerance.within["ops"] == r.counts["ops"].differ
    assert r.tolerance.within["steps"] == r.counts["steps"].differ


def test_a_tight_profile_names_the_first_record_beyond(pair, tmp_path):
    path = _profile(tmp_path, {"*": {"rel_l2": 0, "rel_maxabs": 0}}, {"*": {"rel_l2": 0, "max_abs": 0}})
    r = diff_runs(*(open_run(p) for p in pair), tolerance=load_profile(path))
    assert not r.tolerance.ok and r.exit_code == 1 and r.tolerance.verdict == "beyond"
    fb = r.tolerance.first_beyond
    assert fb.where == r.first_drift.where()  # the first drift is the first record beyond
    assert "rel_l2" in fb.why
    assert r.to_dict()["tolerance"]["first_beyond"]["where"] == fb.where


def test_a_record_without_a_bound_is_beyond(pair, tmp_path):
    path = _profile(tmp_path, {"img_mlp": {"rel_l2": 1.0}}, {"*": {"rel_l2": 1.0, "max_abs": 1.0}})
    r = diff_runs(*(open_run(p) for p in pair), tolerance=load_profile(path))
    assert not r.tolerance.ok and r.tolerance.first_beyond.why == "no bound declared"
    assert r.tolerance.beyond["steps"] == 0 and r.tolerance.beyond["ops"] > 0


def test_identical_runs_stay_identical_with_a_profile(make_run, tmp_path):
    path = _profile(tmp_path, {}, {})
    r = diff_runs(open_run(make_run("a")), open_run(make_run("b")), tolerance=load_profile(path))
    assert r.verdict is Verdict.IDENTICAL and r.exit_code == 0 and r.tolerance.ok


@pytest.mark.parametrize("data,words", [
    ({"schema": "other", "version": 1, "name": "p"}, "not a tolerance profile"),
    ({"schema": PROFILE_SCHEMA, "version": 2, "name": "p"}, "version 2 is not supported"),
    ({"schema": PROFILE_SCHEMA, "version": 1, "name": "p", "ops": {"*": {"rel_l2": -1}}}, ">= 0"),
    ({"schema": PROFILE_SCHEMA, "version": 1, "name": "p", "ops": {"*": {"max_abs": 1}}}, "unknown bound"),
    ({"schema": PROFILE_SCHEMA, "version": 1, "name": "p", "steps": {"v_t": {"rel_l2": "x"}}}, "not a finite"),
    ({"schema": PROFILE_SCHEMA, "version": 1}, "needs a name"),
])
def test_bad_profiles_are_refused(tmp_path, data, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DriftToolError, match=words):
        load_profile(path)


def test_unknown_names_and_unreadable_files_are_refused(tmp_path):
    with pytest.raises(DriftToolError, match="unknown tolerance profile"):
        load_profile("no-such-profile")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(DriftToolError, match="not JSON"):
        load_profile(tmp_path / "x.json")
    for name in available():  # every shipped profile loads
        assert load_profile(name).name


def test_cli_tolerance(pair, tmp_path, cli):
    loose = _profile(tmp_path, {"*": {"rel_l2": 1.0, "rel_maxabs": 1.0}}, {"*": {"rel_l2": 1.0, "max_abs": 1.0}}, "loose")
    code, out = cli("diff", *pair, "--tolerance", loose)
    assert code == 0 and "WITHIN" in out and "DRIFT" in out
    code, out = cli("diff", *pair, "--tolerance", loose, "--json")
    assert code == 0 and json.loads(out)["tolerance"]["verdict"] == "within"
    tight = _profile(tmp_path, {"*": {"rel_l2": 0}}, {"*": {"max_abs": 0}}, "tight")
    code, out = cli("diff", *pair, "--tolerance", tight)
    assert code == 1 and "BEYOND" in out and "first beyond" in out
    code, out = cli("diff", *pair, "--tolerance", tmp_path / "missing.json")
    assert code == 2 and out.count("error") == 1 and "Traceback" not in out


LOOSE_OPS, LOOSE_STEPS = {"*": {"rel_l2": 1e9, "rel_maxabs": 1e9}}, {"*": {"rel_l2": 1e9, "max_abs": 1e9}}


def test_a_pair_with_other_inputs_or_missing_records_is_never_within(make_run, tmp_path):
    prof = load_profile(_profile(tmp_path, LOOSE_OPS, LOOSE_STEPS))
    other_inputs = diff_runs(open_run(make_run("a")), open_run(make_run("x", x_seed=5)), tolerance=prof)
    assert other_inputs.verdict is Verdict.DRIFT and other_inputs.exit_code == 1
    assert not other_inputs.tolerance.ok and other_inputs.tolerance.verdict == "not judged"
    assert "the replay inputs differ" in other_inputs.tolerance.blocked
    cut = diff_runs(open_run(make_run("a2")), open_run(make_run("c", crash_after=1, plant=PLANT)),
                    tolerance=prof)
    assert cut.exit_code != 0 and not cut.tolerance.ok
    assert any("one run only" in b or "incomplete" in b for b in cut.tolerance.blocked)


def test_a_pair_with_a_sample_in_one_run_only_fails_whatever_its_common_records_say(cli, tmp_path):
    """Common records bitwise identical, a sample only in run B: IDENTICAL bitwise (exit 0), and
    with a profile NOT JUDGED, exit 1 (the verdict word said once)."""
    for name, batch in (("one", "1"), ("two", "2")):
        assert cli("run", "-o", tmp_path / name, "--steps", "2", "--capture", "L0", "--batch", batch)[0] == 0
    code, out = cli("diff", tmp_path / "one", tmp_path / "two")
    assert code == 0 and "IDENTICAL" in out, out
    code, out = cli("diff", tmp_path / "one", tmp_path / "two", "--tolerance", "strict-cuda1-vs-cpu")
    assert code == 1 and "NOT JUDGED  tolerance profile strict-cuda1-vs-cpu:" in out, out
    assert "records are in one run only" in out and "not judged tolerance" not in out, out
    code, out = cli("diff", tmp_path / "one", tmp_path / "two", "--tolerance", "strict-cuda1-vs-cpu", "--json")
    assert code == 1 and json.loads(out)["tolerance"]["verdict"] == "not judged"


def test_the_api_takes_a_profile_by_name_or_file(pair, tmp_path):
    ra, rb = (open_run(p) for p in pair)
    path = _profile(tmp_path, LOOSE_OPS, LOOSE_STEPS, "loose")
    assert diff_runs(ra, rb, tolerance=str(path)).tolerance.ok
    assert diff_runs(ra, rb, tolerance=path).tolerance.profile == "loose"
    assert diff_runs(ra, rb, tolerance="strict-cuda1-vs-cpu").tolerance.profile == "strict-cuda1-vs-cpu"
    with pytest.raises(DriftToolError, match="unknown tolerance profile 'nope'"):
        diff_runs(ra, rb, tolerance="nope")
    with pytest.raises(DriftToolError, match="got dict"):
        diff_runs(ra, rb, tolerance={"ops": {}})
    with pytest.raises(DriftToolError, match="^tolerance profile: .*empty name"):  # no CLI flag named
        diff_runs(ra, rb, tolerance=" ")


def test_settings_outside_the_profiles_scope_are_noted(pair, tmp_path):
    path = tmp_path / "scoped.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "version": 1, "name": "scoped",
                                "applies_to": {"b": {"device": "cuda"}}, "ops": LOOSE_OPS,
                                "steps": LOOSE_STEPS}))
    r = diff_runs(*(open_run(p) for p in pair), tolerance=load_profile(path))
    assert any("measured on other settings than run B's: device 'cpu'" in n for n in r.notes), r.notes


def test_a_training_profile_notes_a_pair_that_did_not_train(pair, tmp_path):
    """A profile measured on training recomputes (kind, gradients, adapter mode in its
    ``applies_to``) judging a pair of runs that are none of these says so for each run."""
    scope = {"mode": "strict", "kind": "recompute", "grad": True, "lora_mode": "unfused-fp32"}
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "version": 1, "name": "train",
                                "applies_to": {"a": scope, "b": scope}, "ops": LOOSE_OPS,
                                "steps": LOOSE_STEPS}))
    r = diff_runs(*(open_run(p) for p in pair), tolerance=load_profile(path))
    notes = [n for n in r.notes if "measured on other settings" in n]
    assert len(notes) == 2, r.notes
    for n in notes:
        assert "kind not recorded (profile: 'recompute')" in n and "grad False (profile: True)" in n, n
        assert "lora_mode none (no adapter) (profile: 'unfused-fp32')" in n and "None" not in n, n


@pytest.mark.parametrize("settings, internals", [
    ({"mode": "strict", "capture": "L2"}, True),  # recorded only when left out
    ({"mode": "audit", "capture": "L2", "internals": False}, False),
    ({"mode": "auto", "capture": "L2"}, None),  # production attention has none
    ({"mode": "strict", "capture": "L1"}, None)])
def test_the_scope_says_whether_an_L2_run_took_the_attentions_internals(settings, internals):
    scope = run_scope(types.SimpleNamespace(manifest={"kind": "rollout", "settings": settings}))
    assert scope.get("internals") == internals and ("internals" in scope) == (internals is not None), scope


@pytest.mark.parametrize("extra,words", [({"opz": {}}, "unknown key"), ({"version": True}, "version True")])
def test_typos_and_odd_versions_are_refused(tmp_path, extra, words):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "version": 1, "name": "t", **extra}))
    with pytest.raises(DriftToolError, match=words):
        load_profile(path)
    with pytest.raises(DriftToolError, match="empty"):
        load_profile("")


def _tool(*argv):
    """``tools/tolerance_profile.py``'s main, run in this process; its exit code."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "tolerance_profile.py"
    return runpy.run_path(str(path), run_name="tool")["main"]([str(a) for a in argv])


def test_a_profile_from_several_pairs_bounds_each(make_run, tmp_path, capsys):
    """``tools/tolerance_profile.py A B A2 B2``: each bound is the larger of the pairs' (a larger
    drift in the second pair, at another operator), so both pairs are within it, while the
    first pair's own profile leaves the second beyond; an odd number of runs is refused in one
    line."""
    small = make_run("a"), make_run("b", plant=PLANT)
    large = make_run("a2", noise_seed=2), make_run("b2", noise_seed=2,
                                                   plant={**PLANT, "op": "img_mlp", "row": 3, "add": 0.5})
    assert _tool(*small, "--name", "one", "-o", tmp_path / "one.json") == 0
    assert _tool(*small, *large, "--name", "two", "-o", tmp_path / "two.json") == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    for kind in ("ops", "steps"):
        for name, bounds in two[kind].items():
            for b, v in bounds.items():
                assert v >= one[kind].get(name, {}).get(b, 0.0), (kind, name, b)
    assert two["ops"]["img_mlp"]["rel_l2"] > one["ops"]["img_mlp"]["rel_l2"]
    assert two["measured_on"]["runs"] == [str(p) for p in (*small, *large)]
    runs = [tuple(open_run(p) for p in pr) for pr in (small, large)]
    assert all(diff_runs(*pr, tolerance=load_profile(tmp_path / "two.json")).tolerance.ok for pr in runs)
    assert not diff_runs(*runs[1], tolerance=load_profile(tmp_path / "one.json")).tolerance.ok
    capsys.readouterr()
    assert _tool(*small, large[0], "--name", "odd", "-o", tmp_path / "odd.json") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pairs" in err and not (tmp_path / "odd.json").exists()


@pytest.mark.slow
def test_the_training_profile_script_judges_gradients(tmp_path, capsys):
    """``tools/train_profile.sh`` on the CPU, the strict trainer against the production one (its
    dry run): the derived profile bounds the LoRA gradients' records by name, the pair is within
    it, and the same profile with the gradients' bounds tightened to 0 is beyond at a gradient."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "B_DEVICE": "cpu", "B_MODE": "auto", "PYTHON": sys.executable,
           "PROFILE_OUT": str(tmp_path / "train.json"), "SEEDS": "0 1", "CHECK_SEEDS": "2"}
    done = subprocess.run(["bash", str(root / "tools" / "train_profile.sh"), str(tmp_path / "w")], env=env,
                          capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("WITHIN") == 3 and "24 LoRA gradients" in done.stdout  # seeds 0 and 1, held-out 2
    assert "seeds 0, 1;" in json.loads((tmp_path / "train.json").read_text())["description"]
    data = json.loads((tmp_path / "train.json").read_text())
    grads = {n: b for n, b in data["ops"].items() if n.endswith((".lora_A", ".lora_B"))}
    assert grads and any(b["rel_l2"] > 0 for b in grads.values()), sorted(data["ops"])
    ra, rb = open_run(tmp_path / "w" / "s2" / "train-a"), open_run(tmp_path / "w" / "s2" / "train-b")
    assert diff_runs(ra, rb, tolerance=load_profile(tmp_path / "train.json")).tolerance.ok
    data["ops"].update({n: {"rel_l2": 0.0, "rel_maxabs": 0.0} for n in grads})
    tight = _profile(tmp_path, data["ops"], data["steps"], "tight")
    result = diff_runs(ra, rb, tolerance=load_profile(tight)).tolerance
    assert not result.ok and any(n in result.first_beyond.where for n in grads), result.first_beyond.where
    assert data["applies_to"]["a"] == {"mode": "strict", "device": "cpu", "dtype": "bfloat16", "capture": "L2",
                                       "steps": 4, "fixture": "tiny-t2i", "kind": "recompute", "grad": True,
                                       "lora_mode": "unfused-fp32", "internals": False}
    w = tmp_path / "w"  # a rollout pair beside training pairs: another program, refused in one line
    code = _tool(w / "s0" / "train-a", w / "s0" / "train-b", w / "s1" / "rollout", w / "s1" / "rollout",
                 "--name", "mixed", "-o", tmp_path / "mixed.json")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "kind 'rollout'" in err and "grad False" in err, err
    assert not (tmp_path / "mixed.json").exists()
