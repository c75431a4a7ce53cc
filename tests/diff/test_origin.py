"""Where the first drift comes from: a record is an origin only if the inputs it consumed match.

A change of B's latent between steps k and k+1 (after step k's records, before step k+1 reads
it) leaves every record of step k equal; the first drift is the step boundary, not the first
operator of step k+1."""

from __future__ import annotations

import json

from rich.console import Console
from typer.testing import CliRunner

from drifttool.artifact import open_run
from drifttool.cli.app import app
from drifttool.diff import Verdict, diff_runs, render


def _text(report) -> str:
    console = Console(record=True, width=400, color_system=None)
    render(report, console)
    return console.export_text()


def test_latent_changed_between_steps_is_the_step_boundary(make_run):
    a, b = make_run("a"), make_run("b", between={"step": 0, "sample": 1, "row": 4})
    r = diff_runs(open_run(a), open_run(b))
    assert r.verdict is Verdict.DRIFT and r.exit_code == 1
    assert r.steps[1].carried_in is True and r.steps[0].identical  # the change is real in B
    fd = r.first_drift
    assert (fd.kind, fd.phase, fd.step, fd.op, fd.branch, fd.sample) == (
        "step", "rollout", 1, "x_t", "cfg", 1)
    assert fd.origin and fd.origin_kind == "between_steps"
    assert r.reason.startswith(
        "first drift at rollout step 1 cfg x_t sample 1 (owning rank 0): x_t of step 1 differs; step 0's "
        "outputs match — changed between steps; ")
    assert "every earlier record matches" not in r.reason
    lines = _text(r).splitlines()
    assert lines[0] == "DRIFT  " + r.reason
    assert ("│ origin      │ x_t of step 1 differs; step 0's outputs match — changed between steps"
            in "\n".join(lines))


def test_between_steps_in_json_and_exit_code(make_run):
    a, b = make_run("a"), make_run("b", between={"step": 1, "sample": 0, "row": 0})
    res = CliRunner().invoke(app, ["diff", str(a), str(b), "--json"])
    assert res.exit_code == 1, res.output
    fd = json.loads(res.output)["first_drift"]
    assert (fd["kind"], fd["step"], fd["op"], fd["sample"]) == ("step", 2, "x_t", 0)
    assert fd["origin"] is True and fd["origin_kind"] == "between_steps"


def test_between_steps_at_l0(make_run):
    a = make_run("a", level="L0")
    b = make_run("b", level="L0", between={"step": 0, "sample": 0, "row": 2})
    r = diff_runs(open_run(a), open_run(b))
    fd = r.first_drift
    assert (fd.step, fd.op, fd.origin_kind) == (1, "x_t", "between_steps")


def test_differing_initial_latent_is_an_input_difference(make_run):
    r = diff_runs(open_run(make_run("a")), open_run(make_run("b", x_seed=1)))
    fd = r.first_drift  # the first record the differing latent reaches, not an origin of its own
    assert (fd.kind, fd.step, fd.op, fd.origin_kind) == ("op", 0, "img_mlp", "inputs")
    assert "x_t of step 0, the first step of phase rollout, differs — the replay inputs differ" \
        in r.reason


def test_differing_initial_latent_at_l0(make_run):
    r = diff_runs(open_run(make_run("a", level="L0")), open_run(make_run("b", x_seed=1)))
    fd = r.first_drift
    assert (fd.kind, fd.step, fd.op, fd.origin_kind) == ("step", 0, "x_t", "inputs")


def test_operator_drift_stays_a_record_origin(make_run):
    plant = {"step": 1, "block": 0, "op": "img_mlp", "sample": 0, "row": 1}
    r = diff_runs(open_run(make_run("a")), open_run(make_run("b", plant=plant)))
    fd = r.first_drift
    assert (fd.kind, fd.op, fd.origin, fd.origin_kind) == ("op", "img_mlp", True, "record")
    assert "origin (every earlier record matches)" in r.reason


def test_differing_prompt_with_matching_x_t_is_an_input_origin(make_run):
    """Run B's prompt differs in one element while x0 and the noise match: x_t of step 0 is
    equal, and the first differing operator consumed the differing prompt. Its origin kind is
    ``inputs`` naming the prompt, never 'every earlier record matches'."""
    a, b = make_run("a"), make_run("b", txt_bump={"sample": 1, "row": 0, "add": 0.5})
    r = diff_runs(open_run(a), open_run(b))
    fd = r.first_drift
    assert r.verdict is Verdict.DRIFT
    assert (fd.kind, fd.step, fd.op, fd.sample, fd.origin_kind) == ("op", 0, "txt_mlp", 1, "inputs")
    assert r.input_differences == ["inputs.txt: differs (dtype, shape or bytes)"]
    assert "the replay inputs differ (inputs.txt: differs (dtype, shape or bytes)); x_t of step 0 " \
           "matches" in r.reason
    assert "every earlier record matches" not in r.reason


def test_replay_inputs_in_one_run_only_are_never_identical(make_run, tmp_path):
    """Every record equal, but run B lost its replay inputs (and its manifest does not pin
    them): the inputs were not compared, so the verdict is inconclusive, not identical."""
    import json
    import os

    a, b = make_run("a"), make_run("b")
    m = json.loads((b / "manifest.json").read_text())
    os.remove(b / m["files"]["inputs"])
    m["files"]["inputs"] = None
    m.pop("input_digests", None)
    (b / "manifest.json").write_text(json.dumps(m))
    r = diff_runs(open_run(a), open_run(b))
    assert r.verdict is Verdict.INCONCLUSIVE, r.reason
    assert "replay inputs differ (inputs.safetensors: only in run A)" in r.reason


def test_prompt_difference_absorbed_by_every_record_is_inconclusive(make_run):
    """A prompt change that no record shows (on a padding row of sample 0, which the records
    never hold): every record is equal but a replay input is not, so the verdict is
    inconclusive, never identical."""
    a, b = make_run("a"), make_run("b", txt_bump={"sample": 0, "row": 4, "add": 0.5})
    r = diff_runs(open_run(a), open_run(b))
    assert r.counts["steps"].differ == 0 and r.counts["ops"].differ == 0
    assert r.verdict is Verdict.INCONCLUSIVE and r.exit_code == 3
    assert "replay inputs differ (inputs.txt: differs (dtype, shape or bytes))" in r.reason
