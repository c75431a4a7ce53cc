"""``drifttool run --image``: an edit run from condition images on the command line (prompt encode
with the image → VAE encode → trajectory on the noisy and condition tokens → VAE decode → PNG), on
the shipped ``tiny-edit`` pipeline folder (its prompts when none is given); the same artifact and
image as ``chain_edit.run_edit``; the README's edit line on the fixture's own image is the run
``fixture verify tiny-edit`` compares with; bad inputs in one line."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

from typer.testing import CliRunner  # noqa: E402

from drifttool.cli.app import app  # noqa: E402
from drifttool.exit_codes import ExitCode  # noqa: E402
from drifttool.fixture import locate  # noqa: E402

runner = CliRunner()


def _args(fx, out, *extra):
    return ["run", "--image", str(fx / "condition.png"), "--checkpoint", str(fx), "--fixture", str(fx),
            "--preset", "diffusers-edit", "--mode", "auto", "--steps", "2", "-o", str(out), *extra]


def test_image_run_equals_the_api_and_captures_the_encode(tmp_path):
    from drifttool.artifact.reader import Run
    from drifttool.chain_edit import run_edit
    from drifttool.settings import RunSpec

    fx = locate("tiny-edit")
    res = runner.invoke(app, _args(fx, tmp_path / "cli"))
    assert res.exit_code == ExitCode.OK, res.output
    run_edit(RunSpec(fixture=fx, checkpoint=fx, preset="diffusers-edit", mode="auto", steps=2),
             tmp_path / "api", condition_images=[fx / "condition.png"])
    diff = runner.invoke(app, ["diff", str(tmp_path / "cli"), str(tmp_path / "api")])
    assert diff.exit_code == ExitCode.OK, diff.output
    assert (tmp_path / "cli.png").read_bytes() == (tmp_path / "api.png").read_bytes()
    ops = Run(tmp_path / "cli").ops_table()
    encode = {op for op, comp, step in zip(ops["op"].to_pylist(), ops["component"].to_pylist(),
                                           ops["step"].to_pylist()) if comp == "vae" and step == -1}
    assert "vae_latent_normalize" in encode


def test_the_shipped_edit_fixture_is_its_own_pipeline_preset_and_prompts(tmp_path):
    """``--image --fixture tiny-edit``: the fixture's folder is the pipeline, its preset, prompts
    and prompt positions the run's (the README's edit line); the same run as with all given."""
    import json

    fx = locate("tiny-edit")
    short = ["run", "--image", str(fx / "condition.png"), "--fixture", "tiny-edit", "--mode", "auto",
             "--steps", "2", "-o", str(tmp_path / "short")]
    res = runner.invoke(app, short)
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, _args(fx, tmp_path / "full", "--prompt", "make it blue", "--negative-prompt", "cat",
                                   "--prompt-positions", "sequential"))
    assert res.exit_code == ExitCode.OK, res.output
    assert (tmp_path / "short.png").read_bytes() == (tmp_path / "full.png").read_bytes()
    diff = runner.invoke(app, ["diff", str(tmp_path / "short"), str(tmp_path / "full")])
    assert diff.exit_code == ExitCode.OK, diff.output
    edit = json.loads((tmp_path / "short" / "manifest.json").read_text())["edit"]
    assert (edit["prompts"], edit["negative_prompts"], edit["prompt_positions"]) == (["make it blue"], ["cat"], "sequential")
    res = runner.invoke(app, short[:-2] + ["--mode", "strict", "-o", str(tmp_path / "strict")])
    assert res.exit_code == ExitCode.USAGE, res.output
    assert "runs under its preset 'diffusers-edit'" in res.output and "needs --mode auto" in res.output, res.output


def test_the_readme_edit_line_on_the_fixtures_image_is_its_expected_run(tmp_path):
    """``drifttool run --image IMAGE --fixture tiny-edit --mode auto --preset diffusers-edit``
    (README) on the fixture's own condition image: IDENTICAL to the fixture's expected artifact,
    the same PNG (production arithmetic: where the fixture was built)."""
    import json

    from drifttool.environment import environment
    from drifttool.verify import environment_note

    fx = locate("tiny-edit")
    if (why := environment_note(json.loads((fx / "expected" / "manifest.json").read_text()),
                                {"environment": environment()})) is not None:
        pytest.skip(why)
    res = runner.invoke(app, ["run", "--image", str(fx / "condition.png"), "--fixture", "tiny-edit", "--mode", "auto",
                              "--preset", "diffusers-edit", "-o", str(tmp_path / "edit")])
    assert res.exit_code == ExitCode.OK, res.output
    assert "text_encoder → vae (encode) → mmdit → vae (decode)" in res.output, res.output
    diff = runner.invoke(app, ["diff", str(fx / "expected"), str(tmp_path / "edit"), "--json"])
    assert diff.exit_code == ExitCode.OK and json.loads(diff.output)["verdict"] == "identical", diff.output
    assert (tmp_path / "edit.png").read_bytes() == (fx / "expected.png").read_bytes()


@pytest.mark.parametrize("extra,expect", [
    (["--negative-prompt", "blurry"], "--negative-prompt goes with --prompt"),
    (["--tp", "2"], "one process"),
])
def test_image_run_refusals_are_one_line(tmp_path, extra, expect):
    res = runner.invoke(app, _args(locate("tiny-edit"), tmp_path / "r", *extra))
    assert res.exit_code == ExitCode.USAGE, res.output
    assert expect in res.output and "Traceback" not in res.output


def test_prompts_on_a_pipeline_without_a_text_encoder_are_one_line(tmp_path):
    """The fixture's prompts or ``--prompt`` need the pipeline's text encoder: a pipeline folder
    without one is refused before any work; ``--prompt-embeds`` runs without it."""
    import shutil

    import torch
    from safetensors.torch import save_file

    bare = tmp_path / "bare"
    shutil.copytree(locate("tiny-edit"), bare, ignore=shutil.ignore_patterns("text_encoder", "tokenizer", "*.py"))
    args = ["run", "--image", str(bare / "condition.png"), "--checkpoint", str(bare), "--fixture", "tiny-edit",
            "--mode", "auto", "--steps", "2"]
    for extra in ([], ["--prompt", "make it red"]):  # the fixture's prompts, or --prompt
        res = runner.invoke(app, [*args, "-o", str(tmp_path / "r"), *extra])
        assert res.exit_code == ExitCode.USAGE, res.output
        assert "lacks tokenizer/, text_encoder/" in res.output and "Traceback" not in res.output, res.output
        assert not (tmp_path / "r").exists()
    save_file({"prompt_embeds": torch.randn(1, 7, 32)}, str(tmp_path / "pe.safetensors"))
    res = runner.invoke(app, [*args, "--prompt-embeds", str(tmp_path / "pe.safetensors"), "-o", str(tmp_path / "e")])
    assert res.exit_code == ExitCode.OK and "vae (encode) → mmdit" in res.output, res.output
    assert "text_encoder →" not in res.output


def test_bad_images_are_one_line(tmp_path):
    from PIL import Image

    fx = locate("tiny-edit")
    odd = tmp_path / "odd.png"
    Image.new("RGB", (2000, 3)).save(odd)  # resized to about 96x64 pixels, 0 px high: the pipeline cannot
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    for image in (odd, junk, tmp_path / "missing.png"):
        args = _args(fx, tmp_path / f"r-{image.stem}")
        args[args.index("--image") + 1] = str(image)
        res = runner.invoke(app, args)
        assert res.exit_code == ExitCode.USAGE, (image, res.output)
        assert "Traceback" not in res.output and str(image.name) in res.output, res.output
