"""``benchmarks/profile_recompute.py``: the CLI's ``recompute --grad`` of a small rollout, its
step phases counted and timed (CPU), and a refusal passed through without a table."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

PROFILE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "profile_recompute.py"),
                         run_name="profile_recompute")


@pytest.fixture()
def restored(monkeypatch):
    """The names ``instrument`` wraps, put back after the test."""
    import torch

    import drifttool.training.recompute as rec

    for name in ("capture_lora_grads", "micro_batched", "recompute_run"):
        monkeypatch.setattr(rec, name, getattr(rec, name))
    monkeypatch.setattr(rec.GradLedger, "finish_step", rec.GradLedger.finish_step)
    monkeypatch.setattr(torch.Tensor, "backward", torch.Tensor.backward)


def _rows(out: str) -> dict[str, list[str]]:
    return {c[0]: c[1:] for c in (re.split(r"\s*\|\s*", ln.strip("| ")) for ln in out.splitlines()
                                  if ln.startswith("| ") and not ln.startswith("| phase"))}


def test_every_phase_of_every_step_is_counted(tmp_path, capsys, monkeypatch, restored):
    from drifttool.cli.app import main as cli
    from drifttool.fixture import locate
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=4, init_b_std=0.05)
    save_lora(m, tmp_path / "ad")
    monkeypatch.setattr(sys, "argv", ["drifttool", "run", "-o", str(tmp_path / "roll"), "--steps", "4", "--lora",
                                      str(tmp_path / "ad"), "--lora-mode", "unfused-fp32", "--capture", "L1"])
    with pytest.raises(SystemExit) as e:
        cli()
    assert e.value.code in (0, None)
    capsys.readouterr()
    assert PROFILE["main"]([str(tmp_path / "roll"), "--gradient-checkpointing", "-o", str(tmp_path / "rec")]) == 0
    rows = _rows(capsys.readouterr().out)
    # 4 steps' forwards; the SDE window's steps (the last step is deterministic) each a backward,
    # a ledger reduction (strict) and the gradients' records
    assert rows["forward"][1] == "4", rows
    assert rows["backward"][1] == rows["ledger"][1] == rows["grad records"][1] == "3", rows
    phases = sum(float(rows[p][0]) for p in PROFILE["PHASES"])
    assert abs(phases + float(rows["the rest"][0]) - float(rows["recompute (its `seconds`)"][0])) < 0.01
    assert (tmp_path / "rec" / "manifest.json").exists()
    # -o names a new folder: an earlier run there is not replaced
    before = (tmp_path / "rec" / "manifest.json").read_bytes()
    assert PROFILE["main"]([str(tmp_path / "roll"), "-o", str(tmp_path / "rec")]) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "rec" / "manifest.json").read_bytes() == before


def test_a_refusal_is_its_line_and_status(tmp_path, capsys, restored):
    assert PROFILE["main"]([str(tmp_path / "missing")]) == 2
    out = capsys.readouterr()
    assert "no such artifact directory" in out.out + out.err and "| phase" not in out.out
