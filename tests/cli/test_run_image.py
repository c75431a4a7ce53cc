"""``drifttool run --image``: an edit run from condition images on the command line (VAE encode →
trajectory on the noisy and condition tokens → VAE decode → PNG), on the shipped ``tiny-edit``
pipeline folder; the same artifact and image as ``chain_edit.run_edit``; bad inputs in one line."""

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


def test_the_shipped_edit_fixture_is_its_own_pipeline_and_preset(tmp_path):
    """``--image --fixture tiny-edit``: the fixture's folder is the pipeline and its preset the
    run's (the README's edit line); the same run as with both given."""
    fx = locate("tiny-edit")
    short = ["run", "--image", str(fx / "condition.png"), "--fixture", "tiny-edit", "--mode", "auto",
             "--steps", "2", "-o", str(tmp_path / "short")]
    res = runner.invoke(app, short)
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, _args(fx, tmp_path / "full"))
    assert res.exit_code == ExitCode.OK, res.output
    assert (tmp_path / "short.png").read_bytes() == (tmp_path / "full.png").read_bytes()
    res = runner.invoke(app, short[:-2] + ["--mode", "strict", "-o", str(tmp_path / "strict")])
    assert res.exit_code == ExitCode.USAGE and "use --mode auto" in res.output, res.output


@pytest.mark.parametrize("extra,expect", [
    (["--prompt", "make it red"], "lacks tokenizer/, text_encoder/"),  # tiny-edit has no text encoder
    (["--negative-prompt", "blurry"], "--negative-prompt goes with --prompt"),
    (["--tp", "2"], "one process"),
])
def test_image_run_refusals_are_one_line(tmp_path, extra, expect):
    res = runner.invoke(app, _args(locate("tiny-edit"), tmp_path / "r", *extra))
    assert res.exit_code == ExitCode.USAGE, res.output
    assert expect in res.output and "Traceback" not in res.output


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
