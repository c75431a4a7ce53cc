"""An edit run from condition images of awkward sizes against the unmodified diffusers 0.42.1
pipelines (tiny components: the tiny-edit folder's VAE and transformer, a tiny text encoder with
a vision tower), FP32: the condition latents (and, with ``--prompt``, the prompt embeddings) are
the bytes ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` compute after resizing the
images themselves, and the default output size is the one they derive. The pipelines' areas are
shrunk (``edit_cases.small_areas``) and the edit run is given the same areas; each pipeline call
stops at its transformer's first forward."""

from __future__ import annotations

import json
import shutil

import pytest

PIL = pytest.importorskip("PIL.Image")

from typer.testing import CliRunner  # noqa: E402

from drifttool.chain_edit import prepare_edit  # noqa: E402
from drifttool.cli.app import app  # noqa: E402
from drifttool.exit_codes import ExitCode  # noqa: E402
from drifttool.fixture import locate  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402
from tests.sampling.edit_cases import VAE_AREA, small_areas  # noqa: E402
from tests.text_encoder.tiny_vision import processor, random_image, save_tiny_vision_pipeline, torch, transformers  # noqa: E402

PROMPT_AREA = 64 * 64
"""``small_areas``' edit-plus prompt-image area."""


class _Stop(Exception):
    pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    fx = tmp_path_factory.mktemp("resize") / "fx"
    shutil.copytree(locate("tiny-edit"), fx, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return save_tiny_vision_pipeline(fx, seed=3)


def _pipeline(folder, plus: bool, *, text: bool):
    """The unmodified pipeline in FP32 on ``folder``'s components (text parts with ``text``)."""
    import diffusers

    from tests.diffusers_pipeline import qwen_image_scheduler

    parts = dict(text_encoder=None, tokenizer=None, processor=None)
    if text:
        tok = transformers.AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
        parts = dict(text_encoder=transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            folder / "text_encoder", dtype=torch.float32, local_files_only=True).eval(),
            tokenizer=tok, processor=processor(tok))
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    pipe = cls(scheduler=qwen_image_scheduler(), **parts,
               vae=diffusers.AutoencoderKLQwenImage.from_pretrained(folder / "vae", torch_dtype=torch.float32).eval(),
               transformer=diffusers.QwenImageTransformer2DModel.from_pretrained(
                   folder / "transformer", torch_dtype=torch.float32).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_inputs(pipe, **kw) -> dict:
    """What the pipeline computed before its loop: the prompt embeddings, the condition latents
    and the noisy latents' shape (its output size)."""
    seen: dict = {}
    encode, prepare = pipe.encode_prompt, pipe.prepare_latents

    def on_encode(*a, **k):
        seen.setdefault("txt", encode(*a, **k))
        return seen["txt"]

    def on_prepare(*a, **k):
        latents, cond = prepare(*a, **k)
        seen.update(latents=latents, cond=cond)
        return latents, cond

    def stop(*_):
        raise _Stop

    pipe.encode_prompt, pipe.prepare_latents = on_encode, on_prepare
    handle = pipe.transformer.register_forward_pre_hook(stop)
    try:
        with torch.no_grad(), pytest.raises(_Stop):
            pipe(num_inference_steps=2, true_cfg_scale=1.0, output_type="latent", **kw)
    finally:
        handle.remove()
    return seen


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _images(tmp_path, sizes):
    paths = []
    for i, (w, h) in enumerate(sizes):
        paths.append(tmp_path / f"c{i}.png")
        random_image(h, w, seed=10 + i).save(paths[-1])
    return paths


def test_an_awkward_image_gives_the_edit_pipelines_condition_latents_and_output_size(folder, tmp_path, monkeypatch):
    """``run --image`` of a 97x61 image (CLI, FP32): the stored condition latents are
    ``QwenImageEditPipeline``'s; its output size is the one the pipeline derives."""
    from safetensors.torch import load_file

    small_areas(monkeypatch)
    (cond,) = _images(tmp_path, [(97, 61)])
    res = CliRunner().invoke(app, ["run", "--image", str(cond), "--checkpoint", str(folder), "--fixture", str(folder),
                                   "--preset", "diffusers-edit", "--mode", "auto", "--dtype", "float32",
                                   "--steps", "2", "--image-area", str(VAE_AREA), "-o", str(tmp_path / "a")])
    assert res.exit_code == ExitCode.OK, res.output
    want = _pipeline_inputs(_pipeline(folder, False, text=False), image=PIL.open(cond).convert("RGB"),
                            prompt_embeds=torch.randn(1, 5, 32))
    stored = load_file(str(tmp_path / "a" / "inputs.safetensors"))
    assert _same_bytes(stored["cond"], want["cond"])
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    image = manifest["edit"]["condition_images"][0]
    assert (image["size"], image["vae_size"], manifest["edit"]["vae_image_area"]) == ([97, 61], [128, 96], VAE_AREA)
    h, w = manifest["settings"]["img_grid"]
    assert stored["x0"].shape[1] == want["latents"].shape[1] == h * w == (96 // 16) * (128 // 16)


def test_edit_prompt_embeddings_of_an_awkward_image_are_the_pipelines(folder, tmp_path, monkeypatch):
    small_areas(monkeypatch)
    (cond,) = _images(tmp_path, [(1000, 333)])
    spec = RunSpec(fixture=folder, checkpoint=folder, mode="auto", preset="diffusers-edit", dtype="float32")
    _, stages = prepare_edit(spec, tmp_path / "a", condition_images=[cond], prompts=["make it blue"],
                             positions="sequential", vae_area=VAE_AREA)
    want = _pipeline_inputs(_pipeline(folder, False, text=True), image=PIL.open(cond).convert("RGB"),
                            prompt="make it blue")
    assert want["txt"][1] is None and stages.external.txt_mask is None
    assert _same_bytes(stages.external.txt, want["txt"][0]) and _same_bytes(stages.external.cond, want["cond"])


def test_edit_plus_prompt_embeddings_take_each_images_own_resize(folder, tmp_path, monkeypatch):
    """Edit-plus with ``--prompt``: each image resized to the prompt area for the text encoder and
    to the VAE area for the VAE, apart; two awkward images of different aspect ratios."""
    small_areas(monkeypatch)
    conds = _images(tmp_path, [(97, 61), (640, 480)])
    spec = RunSpec(fixture=folder, checkpoint=folder, mode="auto", preset="diffusers-edit-plus", dtype="float32")
    spec, stages = prepare_edit(spec, tmp_path / "a", condition_images=conds, prompts=["swap them"],
                                positions="sequential", vae_area=VAE_AREA, prompt_area=PROMPT_AREA)
    want = _pipeline_inputs(_pipeline(folder, True, text=True), image=[PIL.open(c).convert("RGB") for c in conds],
                            prompt="swap them", height=spec.height, width=spec.width)
    assert _same_bytes(stages.external.txt, want["txt"][0]) and _same_bytes(stages.external.cond, want["cond"])
    assert [r["prompt_size"] for r in stages.record["condition_images"]] == [[96, 64], [64, 64]]
    assert stages.external.cond_grids == ((6, 8), (6, 8))
