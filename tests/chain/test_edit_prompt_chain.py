"""An edit run that encodes its prompt with the condition image (``run --image --prompt``): the
prompt embeddings the trajectory takes are diffusers' ``QwenImageEditPipeline.encode_prompt(prompt,
image=...)`` bytes (production, ``--prompt-positions sequential``, BF16 as the tiny-edit settings),
the text encoder's records come first in the artifact, the manifest names the prompts, and a strict
run's replay re-encodes them to an identical artifact. Pipeline folder: the tiny-edit fixture's
transformer and VAE with a tiny text encoder that has a vision tower."""

from __future__ import annotations

import json
import shutil

import pytest

PIL = pytest.importorskip("PIL.Image")

from typer.testing import CliRunner  # noqa: E402

from drifttool.artifact.reader import Run  # noqa: E402
from drifttool.cli.app import app  # noqa: E402
from drifttool.exit_codes import ExitCode  # noqa: E402
from drifttool.fixture import locate  # noqa: E402
from tests.text_encoder.tiny_vision import edit_pipeline, save_tiny_vision_pipeline, torch  # noqa: E402

runner = CliRunner()
PROMPT, NEGATIVE = "make it blue", " "


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    fx = tmp_path_factory.mktemp("edit") / "fx"
    shutil.copytree(locate("tiny-edit"), fx, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return save_tiny_vision_pipeline(fx, seed=5)


def _args(fx, out, *extra, fixture=True):
    """The tiny-edit settings (preset diffusers-edit, BF16) with ``fixture``; the run's defaults
    otherwise (a strict run: the preset is production's)."""
    settings = ["--fixture", str(fx), "--preset", "diffusers-edit"] if fixture else []
    return ["run", "--image", str(fx / "condition.png"), "--checkpoint", str(fx), *settings,
            "--steps", "2", "-o", str(out), "--prompt", PROMPT, "--image-area", str(96 * 64), *extra]


def test_the_trajectory_takes_the_edit_pipelines_prompt_embeddings(folder, tmp_path):
    res = runner.invoke(app, _args(folder, tmp_path / "a", "--negative-prompt", NEGATIVE, "--mode", "auto",
                                   "--prompt-positions", "sequential"))
    assert res.exit_code == ExitCode.OK, res.output
    pipe = edit_pipeline(folder, dtype=torch.bfloat16)
    image = PIL.open(folder / "condition.png").convert("RGB").resize((96, 64), PIL.LANCZOS)  # __call__'s resize
    stored = Run(tmp_path / "a").inputs()
    with torch.no_grad():
        for key, text in (("txt", PROMPT), ("neg_txt", NEGATIVE)):
            want, mask = pipe.encode_prompt([text], image=image, device="cpu")
            assert mask is None and torch.equal(stored[key], want.float()), key
    ops = Run(tmp_path / "a").ops_table().to_pylist()
    assert (ops[0]["component"], ops[0]["op"]) == ("vae", "vae_image_resize")  # the pipeline's resize first
    assert ops[1]["component"] == "text_encoder" and ops[1]["op"] == "te_vision_resize"
    assert {r["op"] for r in ops if r["component"] == "text_encoder"} >= {"te_vision_merger", "te_vision_scatter"}
    record = json.loads((tmp_path / "a" / "manifest.json").read_text())["edit"]
    assert (record["prompts"], record["negative_prompts"], record["prompt_positions"]) == (
        [PROMPT], [NEGATIVE], "sequential")


def test_a_strict_run_replays_identically(folder, tmp_path):
    res = runner.invoke(app, _args(folder, tmp_path / "s", "--mode", "strict", "--capture", "L2", fixture=False))
    assert res.exit_code == ExitCode.OK, res.output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["edit"]["prompt_positions"] == "rope_index"
    res = runner.invoke(app, ["replay", str(tmp_path / "s"), "-o", str(tmp_path / "r")])
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, ["diff", str(tmp_path / "s"), str(tmp_path / "r")])
    assert res.exit_code == ExitCode.OK, res.output
    assert (tmp_path / "r.png").read_bytes() == (tmp_path / "s.png").read_bytes()


@pytest.mark.parametrize("extra,expect", [
    (["--image", "SECOND"], "exactly 1 condition image (--image)"),
    (["--prompt-embeds", "x.safetensors"], "exclude each other"),
    (["--prompt-positions", "3d", "--mode", "auto"], "positions"),
])
def test_prompt_edit_refusals_are_one_line(folder, tmp_path, extra, expect):
    extra = [str(folder / "condition.png") if e == "SECOND" else e for e in extra]
    res = runner.invoke(app, _args(folder, tmp_path / "r", *extra))
    assert res.exit_code == ExitCode.USAGE, res.output
    assert expect in res.output and "Traceback" not in res.output, res.output
