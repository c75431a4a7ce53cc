"""``drifttool experiment … --overwrite`` replaces an earlier experiment's output only: a folder
that holds a drifttool run (its ``manifest.json``) or no earlier experiment is refused in one
line before anything is written (it mixed the experiment's files into a run, which no reader
then opened), and an earlier experiment's entries are removed, so no result of other
combinations is left beside the new ones; a user's own file in the folder is kept, and so is
another experiment's output (``grpo`` beside ``train-rollout``). Without ``--overwrite`` such a
folder is refused in the same words (not with advice to pass it), and an earlier experiment's
folder of the same kind with that advice."""

from __future__ import annotations

import shutil

import pytest


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("command", ["train-rollout", "grpo"])
def test_overwrite_refuses_a_run_or_a_folder_of_no_experiment(cli, tmp_path, strict_run, command):
    run = tmp_path / "run"
    shutil.copytree(strict_run, run)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for folder, what in ((run, "a drifttool run (manifest.json)"), (mine, "no earlier experiment")):
        before = _listing(folder)
        for overwrite in (["--overwrite"], []):  # without it: no advice to pass it
            code, out = cli("experiment", command, "-o", folder, *overwrite)
            assert code == 2 and out.count("\n") <= 1 and what in out and "Traceback" not in out, out
            assert "give another -o" in out and "pass --overwrite" not in out, out
        assert _listing(folder) == before


def test_overwrite_replaces_an_earlier_experiment_and_keeps_other_files(cli, tmp_path):
    out = tmp_path / "ex"
    code, text = cli("experiment", "train-rollout", "-o", out, "--combos", "strict/strict")
    assert code == 0, text
    (out / "notes.txt").write_text("mine")
    code, text = cli("experiment", "train-rollout", "-o", out, "--combos", "production/strict")
    assert code == 2 and "holds an earlier train-rollout experiment (pass --overwrite to replace it)" in text, text
    code, text = cli("experiment", "train-rollout", "-o", out, "--combos", "production/strict", "--overwrite")
    assert code == 0, text
    entries = {p.name for p in out.iterdir()}
    assert {"rollout-production", "train-strict-on-production", "notes.txt", "lora"} <= entries, entries
    assert not {"rollout-strict", "train-strict-on-strict"} & entries, entries  # the earlier combination's


def test_one_experiment_leaves_anothers_output_in_the_folder(cli, tmp_path):
    out = tmp_path / "ex"
    code, text = cli("experiment", "train-rollout", "-o", out, "--combos", "strict/strict")
    assert code == 0, text
    trained = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    grpo = ("experiment", "grpo", "-o", out, "--combos", "strict/strict", "--steps", "1", "--groups", "1")
    code, text = cli(*grpo)  # no earlier grpo experiment there: nothing to replace
    assert code == 0, text
    code, text = cli(*grpo)
    assert code == 2 and "holds an earlier grpo experiment (pass --overwrite to replace it)" in text, text
    code, text = cli(*grpo, "--overwrite")
    assert code == 0, text
    after = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert {k: after.get(k) for k in trained} == trained  # train-rollout's entries, untouched
    assert {"grpo.arrow", "grpo.json", "grpo.settings.json"} <= set(after), after
