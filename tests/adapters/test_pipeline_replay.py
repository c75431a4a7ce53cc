"""``drifttool replay`` of a ``capture_pipeline`` artifact, given the pipeline folder
(``--checkpoint``): the unmodified pipeline re-runs from the stored inputs and diffs identical to
the capture; ``drifttool diff --localize --checkpoint`` re-executes the first drifting step of two
captures at L2 and names the operator. Refusals are one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from drifttool.adapters.diffusers_pipeline import capture_pipeline
from drifttool.exit_codes import ExitCode
from tests.diffusers_pipeline import tiny_pipeline

GRID = (4, 6)  # 64 × 96 pixels


def _kwargs(seed: int, neg_seed: int, dtype=torch.float32):
    """Fresh random latents and embeddings (masked pads hold garbage), CFG on, batch 2."""
    g = torch.Generator().manual_seed(seed)
    lens, L = (5, 3), 6
    mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
    kw = dict(prompt_embeds=torch.randn(2, L, 32, generator=g).to(dtype), prompt_embeds_mask=mask,
              latents=torch.randn(2, GRID[0] * GRID[1], 64, generator=g).to(dtype),
              true_cfg_scale=3.0, height=GRID[0] * 16, width=GRID[1] * 16, num_inference_steps=3)
    gn = torch.Generator().manual_seed(neg_seed)
    nmask = torch.arange(4)[None, :] < torch.tensor([4, 2])[:, None]
    kw.update(negative_prompt_embeds=torch.randn(2, 4, 32, generator=gn).to(dtype),
              negative_prompt_embeds_mask=nmask)
    return kw


@pytest.fixture(scope="module")
def pipeline(random_transformer, tmp_path_factory):
    """A tiny fp32 ``QwenImagePipeline`` saved as a pipeline folder (``save_pretrained``), and
    the pipeline object."""
    pipe = tiny_pipeline(random_transformer(seed=7, dtype=torch.float32))
    folder = tmp_path_factory.mktemp("pipe") / "tiny-pipeline"
    pipe.save_pretrained(folder)
    assert (folder / "model_index.json").is_file() and (folder / "transformer").is_dir()
    return pipe, folder


@pytest.fixture(scope="module")
def captures(pipeline, tmp_path_factory):
    """Two L0 captures of one pipeline: same latents and prompts, other negative prompts."""
    pipe, _ = pipeline
    base = tmp_path_factory.mktemp("captures")
    a, b = base / "a", base / "b"
    capture_pipeline(pipe, a, level="L0", **_kwargs(3, 4))
    capture_pipeline(pipe, b, level="L0", **_kwargs(3, 5))
    return a, b


def _one_line(code, out, *needles):
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == ExitCode.USAGE, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    for n in needles:
        assert n in lines[0], out


def test_replay_of_a_capture_diffs_identical(cli, pipeline, captures, tmp_path):
    _, folder = pipeline
    a, _ = captures
    for ckpt in (folder, folder / "transformer"):  # the pipeline folder or its transformer
        out = tmp_path / f"replay-{ckpt.name}"
        code, text = cli("replay", a, "--checkpoint", ckpt, "-o", out, "--json")
        assert code == 0, text
        data = json.loads(text)
        assert data["mode"] == "auto" and data["complete"] and data["steps"] == 3
        m = json.loads((out / "manifest.json").read_text())
        assert m["replay_of"]["path"] == str(a)
        assert m["model_source"]["implementation"] == "diffusers.QwenImagePipeline"
        code, text = cli("diff", a, out)
        assert code == ExitCode.OK, text


def test_replay_at_another_level_diffs_identical_on_common_records(cli, pipeline, captures,
                                                                   tmp_path):
    _, folder = pipeline
    a, _ = captures
    out = tmp_path / "l2"
    code, text = cli("replay", a, "--checkpoint", folder, "--capture", "L2", "-o", out)
    assert code == 0, text
    assert json.loads((out / "manifest.json").read_text())["capture_level"] == "L2"
    code, text = cli("diff", a, out)
    assert code == ExitCode.OK, text


def test_replay_refusals_are_one_line(cli, pipeline, captures, random_transformer, tmp_path):
    _, folder = pipeline
    a, _ = captures
    _one_line(*cli("replay", a, "-o", tmp_path / "x"), "captured from diffusers.QwenImagePipeline",
              "pass --checkpoint")
    other = tmp_path / "other"
    tiny_pipeline(random_transformer(seed=8, dtype=torch.float32)).save_pretrained(other)
    _one_line(*cli("replay", a, "--checkpoint", other, "-o", tmp_path / "x"),
              "are not the captured run's")
    _one_line(*cli("replay", a, "--checkpoint", folder, "--mode", "strict", "-o", tmp_path / "x"),
              "mode auto")
    assert not (tmp_path / "x").exists()


def test_localize_names_the_first_drifting_operator_of_two_captures(cli, pipeline, captures,
                                                                     tmp_path):
    """Other negative prompts: step 0's x_t matches, its uncond branch differs; re-executed at
    L2, the first drift is the uncond branch's first text operator, and both re-executed steps
    reproduce the stored step records."""
    _, folder = pipeline
    a, b = captures
    _one_line(*cli("diff", a, b, "--localize"), "pass --checkpoint")
    code, text = cli("diff", a, b, "--localize", "--checkpoint", folder, "--localize-dir",
                     tmp_path / "loc", "--json")
    assert code == ExitCode.DRIFT, text
    loc = json.loads(text)["localize"]
    assert loc["status"] == "localized", loc["reason"]
    assert loc["step"] == 0 and loc["reproduced"] == {"A": True, "B": True}
    first = loc["first_drift"]
    assert first["branch"] == "uncond" and first["stream"] == "txt", first
    for side in ("a", "b"):
        m = json.loads((tmp_path / "loc" / side / "manifest.json").read_text())
        assert m["capture_level"] == "L2"


def test_diff_checkpoint_goes_with_localize(cli, pipeline, captures):
    _, folder = pipeline
    a, b = captures
    code, out = cli("diff", a, b, "--checkpoint", folder)
    assert code == ExitCode.USAGE and "--checkpoint goes with --localize" in out, out
