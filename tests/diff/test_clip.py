"""``diff --clip-range``: log-prob drift per step and branch in units of the PPO clip range."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from drifttool.artifact.reader import open_run
from drifttool.diff.clip import check_clip_range, percent
from drifttool.diff.compare import diff_runs
from drifttool.diff.values import values
from drifttool.errors import DriftToolError
from drifttool.runner import execute
from drifttool.settings import RunSpec


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Strict and auto runs of the embedded default at L0."""
    root = tmp_path_factory.mktemp("clip")
    for mode in ("strict", "auto"):
        execute(RunSpec(capture="L0", mode=mode), root / mode)
    return root / "strict", root / "auto"


def _logp(path) -> dict[tuple[int, int], float]:
    t = open_run(path).steps_table().to_pylist()
    return {(r["step"], r["sample"]): float(values(r["dtype"], r["shape"], r["data"]))
            for r in t if r["quantity"] == "logp_t"}


def test_per_step_numbers_are_the_stored_logps(pair):
    r = diff_runs(open_run(pair[0]), open_run(pair[1]), clip_range=1e-4)
    a, b = _logp(pair[0]), _logp(pair[1])
    assert [(s.phase, s.step, s.branch, s.samples) for s in r.clip.steps] == [
        ("rollout", k, "cfg", 2) for k in range(3)]  # the SDE window: steps 0..2
    for s in r.clip.steps:
        d = np.array([b[(s.step, i)] - a[(s.step, i)] for i in (0, 1)])
        assert s.mean_abs == pytest.approx(np.abs(d).mean(), rel=0, abs=0)
        assert s.max_abs == np.abs(d).max()
        assert s.ratio_dev_max == np.abs(np.expm1(d)).max()
        assert s.fraction == s.ratio_dev_max / 1e-4
    assert r.clip.verdict == "below" and r.clip.worst.ratio_dev_max < 1e-4
    assert r.clip.words().endswith("below the clip noise floor")
    tight = diff_runs(open_run(pair[0]), open_run(pair[1]), clip_range=1e-9)
    assert tight.clip.verdict == "above" and "above the clip noise floor" in tight.clip.words()
    assert tight.exit_code == r.exit_code == 1  # the clip range never changes the exit code


def test_cli_and_json(cli, pair):
    code, out = cli("diff", *pair, "--clip-range", "1e-4")
    flat = " ".join(out.split())
    assert code == 1 and "BELOW CLIP NOISE FLOOR max |exp(Δlogp) − 1|" in flat, out
    assert "of the clip range 0.0001" in flat and "log-prob drift against the clip range" in flat
    assert "below the clip noise floor" not in flat  # the verdict's words once, heading the line
    code, out = cli("diff", *pair, "--clip-range", "1e-4", "--json")
    data = json.loads(out)
    assert code == 1 and data["clip"]["verdict"] == "below" and data["clip"]["clip_range"] == 1e-4
    assert {"step", "branch", "mean_abs", "max_abs", "ratio_dev_max", "fraction"} <= set(
        data["clip"]["steps"][0])
    assert data["semantic"] == {"verdict": "match", "differences": [], "unrecorded": []}
    code, out = cli("diff", *pair, "--json")
    assert json.loads(out)["clip"] is None
    code, out = cli("diff", *pair, "--clip-range", "0")
    assert code == 2 and "error:" in out and "clip range must be a finite number > 0" in out


def test_words():
    assert percent(0.37) == "37 %" and percent(5e-4) == "0.05 %"
    with pytest.raises(DriftToolError):
        check_clip_range(math.nan)
