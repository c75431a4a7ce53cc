"""``drifttool run --prompt``: the full chain (text encoder → trajectory → VAE decode → PNG) in one
artifact, every stage captured under its own component, on a tiny random pipeline folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
PIL = pytest.importorskip("PIL.Image")

from drifttool.cli.app import app  # noqa: E402
from drifttool.exit_codes import ExitCode  # noqa: E402
from tests.chain.tiny_pipeline import build_pipeline  # noqa: E402

PROMPT, NEGATIVE = "a red cube on a table", "cat"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return build_pipeline(tmp_path_factory.mktemp("pipe"))


@pytest.fixture(scope="module")
def runner():
    from typer.testing import CliRunner

    return CliRunner()


def _run(runner, pipeline, out, *extra):
    args = ["run", "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--checkpoint", str(pipeline),
            "-o", str(out), "--steps", "2", *extra]
    return runner.invoke(app, args)


@pytest.fixture(scope="module")
def strict_pair(tmp_path_factory, runner, pipeline):
    d = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        res = _run(runner, pipeline, d / name)
        assert res.exit_code == ExitCode.OK, res.output
    return d


def test_twice_is_identical_and_every_stage_is_captured(strict_pair, runner):
    import pyarrow.compute as pc

    from drifttool.artifact.reader import Run

    res = runner.invoke(app, ["diff", str(strict_pair / "a"), str(strict_pair / "b")])
    assert res.exit_code == ExitCode.OK, res.output
    ops = Run(strict_pair / "a").ops_table()
    components = set(ops["component"].to_pylist())
    assert components == {"text_encoder", "mmdit", "vae"}
    te_ops = set(ops.filter(pc.equal(ops["component"], "text_encoder"))["op"].to_pylist())
    assert {"te_embed_tokens", "te_prompt_extract"} <= te_ops
    vae_ops = set(ops.filter(pc.equal(ops["component"], "vae"))["op"].to_pylist())
    assert {"latent_pack_unpack", "vae_latent_normalize", "vae_causal_conv3d"} <= vae_ops
    manifest = json.loads((strict_pair / "a" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["chain"]["prompts"] == [PROMPT]
    assert manifest["settings"]["cfg_scale"] > 1  # CFG ran: the negative prompt was encoded too
    assert "input_files" not in manifest["settings"]  # the embeddings came in memory, not from files


def test_png_decodes_to_the_run_size(strict_pair):
    import hashlib

    png = strict_pair / "a.png"
    img = PIL.open(png)
    img.load()
    assert img.mode == "RGB" and img.size == (96, 64)  # the fixture's 4x6 patch grid, W x H
    assert (strict_pair / "b.png").read_bytes() == png.read_bytes()
    manifest = json.loads((strict_pair / "a" / "manifest.json").read_text())
    (rec,) = manifest["chain"]["images"]
    assert rec["sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()


def test_strict_vs_auto_first_drift_is_in_the_text_encoder(strict_pair, runner, pipeline, tmp_path):
    res = _run(runner, pipeline, tmp_path / "auto", "--mode", "auto")
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, ["diff", str(strict_pair / "a"), str(tmp_path / "auto"), "--json"])
    assert res.exit_code == ExitCode.DRIFT, res.output
    first = json.loads(res.output)["first_drift"]
    assert first["component"] == "text_encoder" and first["op"].startswith("te_"), first


@pytest.mark.parametrize("part", ["tokenizer", "text_encoder", "vae"])
def test_pipeline_without_a_part_is_one_line(runner, pipeline, tmp_path, part):
    import shutil

    broken = tmp_path / "pipe"
    shutil.copytree(pipeline, broken)
    shutil.rmtree(broken / part)
    res = _run(runner, broken, tmp_path / "out")
    assert res.exit_code == ExitCode.USAGE
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{part}/" in lines[0], res.output
    assert not (tmp_path / "out").exists()


def test_prompt_with_prompt_embeds_is_one_line(runner, pipeline, tmp_path):
    res = _run(runner, pipeline, tmp_path / "out", "--prompt-embeds", str(tmp_path / "pe.safetensors"))
    assert res.exit_code == ExitCode.USAGE
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


def test_prompt_with_a_condition_is_one_line(runner, pipeline, tmp_path):
    (tmp_path / "cond.safetensors").write_bytes(b"")  # refused before the file is read
    res = _run(runner, pipeline, tmp_path / "out", "--condition", str(tmp_path / "cond.safetensors"))
    assert res.exit_code == ExitCode.USAGE and "text-to-image chain" in res.output, res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


def test_negative_prompt_alone_is_one_line(runner, pipeline, tmp_path):
    res = runner.invoke(app, ["run", "--negative-prompt", NEGATIVE, "--checkpoint", str(pipeline),
                              "-o", str(tmp_path / "out")])
    assert res.exit_code == ExitCode.USAGE
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


def _inverse_by_product(z, mean, std, inverse=False):
    """``vae_latent_normalize`` with the inverse as ``z·std + mean`` (the pipelines divide by
    1/std): another rounding, the one change of a probe."""
    from drifttool.ops.vae.production import vae_latent_normalize

    if not inverse:
        return vae_latent_normalize(z, mean, std)
    view = (1, z.shape[1]) + (1,) * (z.dim() - 2)
    return z * std.view(view).to(z.dtype) + mean.view(view).to(z.dtype)


def test_a_vae_change_is_the_first_drift_at_the_decode_step(runner, pipeline, tmp_path):
    """Same prompts, same trajectory; only the decode's de-normalisation differs: the diff names
    the VAE, its operator and the step after the last (the decode's)."""
    from drifttool.chain import run_chain
    from drifttool.settings import RunSpec

    base = dict(checkpoint=pipeline, mode="auto", capture="L1", steps=2)
    a = run_chain(RunSpec(**base), tmp_path / "a", prompts=[PROMPT])
    b = run_chain(RunSpec(**base, variants={"vae_latent_normalize": ("product", _inverse_by_product)}),
                  tmp_path / "b", prompts=[PROMPT])
    assert a["complete"] and b["complete"] and not a["cfg"]
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert res.exit_code == ExitCode.DRIFT, res.output
    first = json.loads(res.output)["first_drift"]
    assert (first["component"], first["op"], first["step"]) == ("vae", "vae_latent_normalize", 2), first


def test_other_device_is_one_line(runner, pipeline, tmp_path):
    res = _run(runner, pipeline, tmp_path / "out", "--device", "cuda", "--mode", "auto")
    assert res.exit_code == ExitCode.USAGE
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


def test_replay_reruns_every_stage_and_diffs_identical(strict_pair, runner, tmp_path):
    """A replay of a prompt run re-runs the text encoder, the trajectory and the decode: the diff
    against the source is identical for every component, and the replay decodes the same PNG."""
    import pyarrow.compute as pc

    from drifttool.artifact.reader import Run

    res = runner.invoke(app, ["replay", str(strict_pair / "a"), "-o", str(tmp_path / "r")])
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, ["diff", str(strict_pair / "a"), str(tmp_path / "r"), "--json"])
    assert res.exit_code == ExitCode.OK, res.output
    ops = Run(tmp_path / "r").ops_table()
    assert set(ops["component"].to_pylist()) == {"text_encoder", "mmdit", "vae"}
    assert ops.filter(pc.equal(ops["component"], "text_encoder")).num_rows > 0
    assert (tmp_path / "r.png").read_bytes() == (strict_pair / "a.png").read_bytes()
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["replay_of"]["path"] == str(strict_pair / "a") and manifest["chain"]["prompts"] == [PROMPT]


def test_replay_in_auto_mode_drifts_first_in_the_text_encoder(strict_pair, runner, tmp_path):
    """The replay's mode reaches every stage: the text encoder is the first that drifts."""
    res = runner.invoke(app, ["replay", str(strict_pair / "a"), "-o", str(tmp_path / "r"), "--mode", "auto"])
    assert res.exit_code == ExitCode.OK, res.output
    res = runner.invoke(app, ["diff", str(strict_pair / "a"), str(tmp_path / "r"), "--json"])
    assert res.exit_code == ExitCode.DRIFT, res.output
    assert json.loads(res.output)["first_drift"]["component"] == "text_encoder", res.output


def test_replay_without_the_pipeline_folder_is_one_line(runner, pipeline, tmp_path):
    import shutil

    moved = tmp_path / "pipe"
    shutil.copytree(pipeline, moved)
    res = _run(runner, moved, tmp_path / "a", "--mode", "auto", "--capture", "L0")
    assert res.exit_code == ExitCode.OK, res.output
    shutil.move(moved, tmp_path / "elsewhere")
    res = runner.invoke(app, ["replay", str(tmp_path / "a"), "-o", str(tmp_path / "r")])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == ExitCode.USAGE and len(lines) == 1 and "--checkpoint" in lines[0], res.output
    assert not (tmp_path / "r").exists()
    res = runner.invoke(app, ["replay", str(tmp_path / "a"), "-o", str(tmp_path / "r"),
                              "--checkpoint", str(tmp_path / "elsewhere")])
    assert res.exit_code == ExitCode.OK, res.output


def test_without_a_checkpoint_the_shipped_tiny_pipeline_runs(runner, tmp_path):
    """The embedded default: ``run --prompt`` alone runs the shipped tiny pipeline folder, and
    its artifact diffs identical to the same run naming that folder with ``--checkpoint``."""
    from drifttool.chain import default_pipeline

    plain = runner.invoke(app, ["run", "--prompt", PROMPT, "-o", str(tmp_path / "plain"), "--steps", "2"])
    assert plain.exit_code == ExitCode.OK, plain.output
    named = runner.invoke(app, ["run", "--prompt", PROMPT, "--checkpoint", str(default_pipeline()),
                                "-o", str(tmp_path / "named"), "--steps", "2"])
    assert named.exit_code == ExitCode.OK, named.output
    assert (tmp_path / "plain.png").read_bytes() == (tmp_path / "named.png").read_bytes()
    res = runner.invoke(app, ["diff", str(tmp_path / "plain"), str(tmp_path / "named")])
    assert res.exit_code == ExitCode.OK, res.output
    chain = json.loads((tmp_path / "plain" / "manifest.json").read_text())["chain"]
    assert chain["pipeline"].endswith("tiny-t2i-chain")
