"""``benchmarks/diffusers_jobs.py``: diffusers' trajectory and peft's LoRA recompute on a small
pipeline folder (CPU), run through ``full_size_table.py``'s ``measured`` as the table runs them,
and its refusals."""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
JOBS = runpy.run_path(str(BENCH / "diffusers_jobs.py"), run_name="diffusers_jobs")
TABLE = runpy.run_path(str(BENCH / "full_size_table.py"), run_name="full_size_table")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A table's work folder: a 2-block pipeline folder (``qwen``) and a rank-2 adapter (``lora``)."""
    from drifttool.model.checkpoint import load_checkpoint, save_checkpoint
    from drifttool.model.config import tiny
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora
    from drifttool.model.mmdit import MMDiT, random_init_

    root = tmp_path_factory.mktemp("table")
    save_checkpoint(random_init_(MMDiT(tiny()), seed=3), root / "qwen" / "transformer")
    (root / "qwen" / "model_index.json").write_text(json.dumps(
        {"_class_name": "QwenImagePipeline", "transformer": ["diffusers", "QwenImageTransformer2DModel"]}))
    model = load_checkpoint(root / "qwen")
    add_lora(model, rank=2, alpha=4.0, seed=1, init_b_std=0.05)
    save_lora(model, root / "lora")
    return root


def _args(work: Path, job: str, *extra: str) -> list[str]:
    return [job, "--checkpoint", str(work / "qwen"), "--lora", str(work / "lora"), "--height", "48",
            "--width", "80", "--steps", "2", "--device", "cpu", *extra]


def _with_lora(argv: list[str], lora: Path) -> list[str]:
    return [str(lora) if a == argv[argv.index("--lora") + 1] else a for a in argv]


def test_the_table_runs_both_jobs_with_each_checkpointing(tmp_path, work):
    plan = argparse.Namespace(device="cpu", lora_mode="unfused-fp32", steps=2, parts="diffusers",
                              checkpointing="both")
    cases = list(TABLE["cases"](plan, work, "48x80", 3))
    assert [label for label, _, _ in cases] == [
        "diffusers trajectory, adapter loaded", "diffusers + peft recompute --grad",
        "diffusers + peft recompute --grad, checkpointing"]
    for label, argv, expect in cases:
        row = TABLE["measured"](argv, tmp_path / "job.log")
        log = (tmp_path / "job.log").read_text()
        assert (row["rc"], expect) == (0, 0), log
        assert row["command"].startswith("python benchmarks/diffusers_jobs.py "), row["command"]
        assert row["wall_s"] > 0 and row["peak_host_gib"] > 0
        assert ("--gradient-checkpointing" in argv) == label.endswith("checkpointing")
        assert "--gradient-checkpointing" not in argv or "recompute" in argv
        assert argv[argv.index("--batch") + 1] == "3"
        if "trajectory" in argv:  # batch 3 of 3 × 5 patches, 64 channels; 2 blocks × 12 adapted layers
            assert "latents (3, 15, 64), finite True, LoRA layers 24" in log, log
        else:  # every factor outside the last block's unused text-stream outputs has a gradient
            assert (f"gradient checkpointing {'--gradient-checkpointing' in argv}, trainable tensors 48, "
                    f"with gradients 42, gradients finite True") in log, log


def test_the_jobs_take_drifttool_runs_inputs(work):
    args = JOBS["parse"](_args(work, "trajectory", "--batch", "3"))
    x = JOBS["inputs"](args, work / "qwen" / "transformer")
    assert x.x0.shape == (3, 15, 64) and x.sample_ids == [0, 1, 2]
    assert x.txt.shape[2] == 32 and x.neg_txt is not None  # the model's width; CFG's negative prompt


def test_bad_input_is_one_line_and_exit_2(tmp_path, work, capsys):
    bad = [["trajectory", "--checkpoint", str(tmp_path / "missing"), "--device", "cpu"],
           ["trajectory", "--checkpoint", str(work / "qwen" / "model_index.json"), "--device", "cpu"],
           _with_lora(_args(work, "trajectory"), tmp_path / "no-adapter"),
           ["recompute", "--checkpoint", str(work / "qwen"), "--device", "cpu"],  # an adapter to train
           _args(work, "trajectory", "--height", "50"), _args(work, "trajectory", "--steps", "1")]
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            JOBS["main"](argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith("diffusers_jobs.py: error: "), (argv, err)
    # an adapter diffusers loads nothing from (peft's files only): refused, not timed without it
    peft_only = tmp_path / "peft-only"
    peft_only.mkdir()
    for f in (work / "lora").iterdir():
        if f.name != "pytorch_lora_weights.safetensors":
            (peft_only / f.name).write_bytes(f.read_bytes())
    assert JOBS["main"](_with_lora(_args(work, "trajectory"), peft_only)) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "loaded no LoRA layer" in out[0], out
    # an adapter whose weights are cut short: the job's one error line, then what it measured
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in (work / "lora").iterdir():
        (cut / f.name).write_bytes(f.read_bytes()[:100] if f.suffix == ".safetensors" else f.read_bytes())
    assert JOBS["main"](_with_lora(_args(work, "recompute"), cut)) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("error: ") and out[1].startswith("MEASURED "), out
