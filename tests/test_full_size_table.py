"""``benchmarks/full_size_table.py``'s plan of commands: every part in order, the recomputes
``--checkpointing`` asks for, each case's artifacts under its shape, batch, mode and steps."""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import pytest

TABLE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "full_size_table.py"),
                       run_name="full_size_table")


def _labels(tmp_path, **kw):
    args = argparse.Namespace(**{"device": "cuda", "lora_mode": "unfused-fp32", "steps": 10,
                                 "parts": "run,replay,recompute,localize", "checkpointing": "both", **kw})
    return [(label, argv) for label, argv, _ in TABLE["cases"](args, tmp_path, "1664x928", 2)]


@pytest.mark.parametrize("checkpointing, want", [("both", [False, True]), ("on", [True]), ("off", [False])])
def test_the_recomputes_checkpointing_asks_for(tmp_path, checkpointing, want):
    cases = _labels(tmp_path, checkpointing=checkpointing, parts="recompute")
    recomputes = [argv for label, argv in cases if argv[0] == "recompute"]
    assert [("--gradient-checkpointing" in argv) for argv in recomputes] == want
    assert all("--grad" in argv for argv in recomputes)
    outs = [r[r.index("-o") + 1] for r in recomputes]
    diffs = [argv for label, argv in cases if argv[0] == "diff"]  # each against the rollout
    assert [d[2] for d in diffs[:len(outs)]] == outs
    # with both, the two recomputes against each other: their LoRA gradients too
    assert diffs[len(outs):] == ([["diff", *outs]] if len(outs) == 2 else [])


def test_every_part_in_order_under_its_case_folder(tmp_path):
    cases = _labels(tmp_path)
    labels = [label for label, _ in cases]
    assert labels[:5] == ["run strict L0", "run strict L1", "run strict L2", "run auto L0", "run auto L2"]
    assert labels.index("replay (L1)") < labels.index("recompute --grad") < labels.index("diff --localize, L0 pair")
    where = tmp_path / "1664x928-b2-unfused-fp32-s10"
    run = dict(cases)["run strict L1"]
    assert run[run.index("-o") + 1] == str(where / "strict-L1") and run[run.index("--batch") + 1] == "2"
    assert (run[run.index("--height") + 1], run[run.index("--width") + 1]) == ("1664", "928")


def test_a_device_other_than_cuda_gets_folders_of_its_own(tmp_path):
    for device, tail in (("cpu", "-cpu"), ("cuda:1", "-cuda1"), ("cuda", "")):
        run = dict(_labels(tmp_path, device=device))["run strict L1"]
        assert run[run.index("-o") + 1] == str(tmp_path / f"1664x928-b2-unfused-fp32-s10{tail}" / "strict-L1")


@pytest.mark.parametrize("argv, says", [(["--batches", "1,x"], "--batches '1,x'"), (["--shapes", "1024x50"], "multiples of 16"),
                                        (["--steps", "1"], "2 to 1000 steps"), (["--parts", "run,nope"], "unknown parts")])
def test_bad_arguments_are_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.setattr("sys.argv", ["full_size_table.py", "--work", str(tmp_path / "w"), "--device", "cpu", *argv])
    with pytest.raises(SystemExit) as e:
        TABLE["main"]()
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "w").exists()
