"""An edit run from its condition images (``drifttool.chain_edit``): the VAE encode captured under
component ``vae`` before the trajectory, the decode after it; its replay re-runs every stage."""

from __future__ import annotations

import json
import shutil

import pytest

PIL = pytest.importorskip("PIL.Image")

from drifttool.chain_edit import read_image, run_edit  # noqa: E402
from drifttool.cli.app import app  # noqa: E402
from drifttool.errors import DriftToolError  # noqa: E402
from drifttool.exit_codes import ExitCode  # noqa: E402
from drifttool.fixture import locate  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory):
    """(a copy of the tiny-edit fixture folder, an edit run on it with 2 steps)."""
    d = tmp_path_factory.mktemp("edit")
    fx = d / "fx"
    shutil.copytree(locate("tiny-edit"), fx, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    summary = run_edit(RunSpec(fixture=fx, checkpoint=fx, mode="auto", preset="diffusers-edit", steps=2),
                       d / "a", condition_images=[fx / "condition.png"])
    assert summary["complete"] and summary["images"] == [str(d / "a.png")]
    return fx, d / "a"


def test_the_encode_is_captured_before_the_trajectory_and_the_replay_is_identical(edit_run, tmp_path):
    from typer.testing import CliRunner

    from drifttool.artifact.reader import Run

    fx, a = edit_run
    ops = Run(a).ops_table().to_pylist()
    first = ops[0]
    assert (first["component"], first["step"]) == ("vae", -1), first
    assert {r["op"] for r in ops if r["component"] == "vae" and r["step"] == -1} >= {
        "vae_causal_conv3d", "vae_latent_normalize", "latent_pack_unpack"}
    runner = CliRunner()
    res = runner.invoke(app, ["replay", str(a), "-o", str(tmp_path / "r")])
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, ["diff", str(a), str(tmp_path / "r")])
    assert res.exit_code == ExitCode.OK, res.output
    assert (tmp_path / "r.png").read_bytes() == a.with_name("a.png").read_bytes()
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["edit"]["condition_images"]


def test_prompt_embeds_files_are_the_prompts_of_an_edit_run_from_images(edit_run, tmp_path):
    """``--image`` with ``--prompt-embeds``: the run's prompts are the file's, not the fixture's."""
    import torch
    from safetensors.torch import load_file, save_file

    fx, a = edit_run
    stored = load_file(str(a / "inputs.safetensors"))
    gen = torch.Generator().manual_seed(7)
    txt = torch.randn(stored["txt"].shape, generator=gen)
    save_file({"prompt_embeds": txt}, str(tmp_path / "pe.safetensors"))
    run_edit(RunSpec(fixture=fx, checkpoint=fx, mode="auto", preset="diffusers-edit", steps=2,
                     prompt_embeds=tmp_path / "pe.safetensors"), tmp_path / "b",
             condition_images=[fx / "condition.png"])
    got = load_file(str(tmp_path / "b" / "inputs.safetensors"))
    assert torch.equal(got["txt"], txt)
    assert torch.equal(got["cond"], stored["cond"])


def test_a_changed_condition_image_refuses_the_replay(edit_run, tmp_path):
    from typer.testing import CliRunner

    fx, a = edit_run
    cond = json.loads((a / "manifest.json").read_text())["edit"]["condition_images"][0]["path"]
    keep = tmp_path / "keep.png"
    shutil.copyfile(cond, keep)
    try:
        PIL.new("RGB", (80, 48), (1, 2, 3)).save(cond)
        res = CliRunner().invoke(app, ["replay", str(a), "-o", str(tmp_path / "r")])
    finally:
        shutil.copyfile(keep, cond)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == ExitCode.USAGE and len(lines) == 1 and "condition image" in lines[0], res.output


def test_a_condition_image_drifttool_cannot_take_is_one_error(tmp_path):
    p = tmp_path / "c.png"
    PIL.new("L", (80, 48)).save(p)
    with pytest.raises(DriftToolError, match="RGB only"):
        read_image(p)
    PIL.new("RGB", (97, 61)).save(p)  # any RGB size: the pipeline resizes it
    assert read_image(p).shape == (61, 97, 3)
