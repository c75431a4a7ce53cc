"""A run's ``settings.samples`` names the samples its records hold. ``diff``, ``report`` and
``replay`` refuse a manifest whose samples no run has (none, one named twice, a negative id) or
that disagrees with its records (a sample the records hold left out) as a corrupt manifest: one
``error:`` line naming the manifest and what is wrong, exit 2 (bad input), nothing written. A
verdict over a mislabelled run is not trustworthy, and a replay of it would write other samples
than its records."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import one_error_line

# the strict run of the embedded default holds samples 0 and 1
BAD_SAMPLES = {
    "duplicate": ([0, 0], "corrupt manifest (settings.samples has duplicate sample ids: [0] "
                          "named more than once)"),
    "empty": ([], "corrupt manifest (settings.samples is empty: the run names no sample)"),
    "negative": ([-1, 0, 1], "corrupt manifest (settings.samples holds negative sample id(s) [-1]"),
    "a recorded sample left out": ([0], "corrupt manifest (settings.samples [0] disagrees with "
                                        "the records: steps.rank* holds sample(s) [1], which it "
                                        "does not name)"),
    "another sample": ([0, 2], "corrupt manifest (settings.samples [0, 2] disagrees with the "
                               "records: steps.rank* holds sample(s) [1]"),
}


def _with_samples(src, dst, samples):
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["settings"]["samples"] = samples
    (dst / "manifest.json").write_text(json.dumps(m, indent=2))
    return dst


@pytest.mark.parametrize("case", sorted(BAD_SAMPLES))
@pytest.mark.parametrize("command", ["diff", "diff reversed", "report", "replay"])
def test_a_manifest_whose_samples_are_wrong_is_refused_as_corrupt(cli, tmp_path, strict_run,
                                                                  command, case):
    samples, needle = BAD_SAMPLES[case]
    bad = _with_samples(strict_run, tmp_path / "bad", samples)
    args = {"diff": ("diff", strict_run, bad), "diff reversed": ("diff", bad, strict_run),
            "report": ("report", strict_run, bad, "-o", tmp_path / "r.html"),
            "replay": ("replay", bad, "-o", tmp_path / "out")}[command]
    code, out = cli(*args)
    one_error_line(code, out, f"{bad / 'manifest.json'}: {needle}")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "out").exists()


def test_diff_json_refuses_a_mislabelled_run_in_one_line(cli, tmp_path, strict_run):
    """``--json`` too: no document for a run whose manifest leaves out a recorded sample."""
    bad = _with_samples(strict_run, tmp_path / "bad", [1])
    code, out = cli("diff", strict_run, bad, "--json")
    one_error_line(code, out, f"{bad / 'manifest.json'}: corrupt manifest", "holds sample(s) [0]")


def test_a_run_naming_its_samples_in_another_order_diffs_identical(cli, tmp_path, strict_run):
    """The control: the samples as a set are the records', whatever their order."""
    good = _with_samples(strict_run, tmp_path / "good", [1, 0])
    code, out = cli("diff", strict_run, good)
    assert code == 0 and "IDENTICAL" in out, out
