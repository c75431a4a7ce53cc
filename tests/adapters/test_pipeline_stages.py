"""``capture_pipeline`` with prompt strings and a decode: the text encoder (transformers'
Qwen2.5-VL) and the VAE (diffusers' ``AutoencoderKLQwenImage``) captured around the loop, against
drifttool's own chain (``drifttool run --prompt``) on the same pipeline folder, record for record;
a perturbed stage is named by the diff; nothing of the capture is left on the pipeline, also after
an error; the pipeline's output bytes do not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from drifttool.adapters.diffusers_pipeline import capture_pipeline  # noqa: E402
from drifttool.adapters.pipeline_hooks import HOOK_NAME  # noqa: E402
from drifttool.adapters.transformers_qwen25vl import CAPTURE_IMPLEMENTATION  # noqa: E402
from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.chain import run_chain  # noqa: E402
from drifttool.cli.app import app  # noqa: E402
from drifttool.diff.compare import diff_runs  # noqa: E402
from drifttool.diff.report import Verdict  # noqa: E402
from drifttool.errors import UnsupportedConfigError  # noqa: E402
from drifttool.exit_codes import ExitCode  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402
from tests.diffusers_pipeline import CHAIN_FOLDER, chain_pipeline  # noqa: E402

PROMPT, NEGATIVE, SEED, STEPS = "a red cube on a table", "cat", 5, 3
CALL = dict(true_cfg_scale=4.0, height=64, width=96, num_inference_steps=STEPS)
WRAPPED = {"pipe": ("_get_qwen_prompt_embeds", "_unpack_latents", "_encode_vae_image", "_pack_latents"),
           "vae": ("decode",), "scheduler": ("step",), "transformer": ("forward",)}


@pytest.fixture(scope="module")
def pipe():
    return chain_pipeline()


def _generators(n: int, seed: int = SEED):
    """The ``diffusers`` preset's noise: one CPU generator per sample, seeded seed + id."""
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _hooks(pipe) -> dict:
    """Every forward hook and pre-hook of the pipeline's models, by module path."""
    out = {}
    for part in ("text_encoder", "transformer", "vae"):
        for name, m in getattr(pipe, part).named_modules():
            out[f"{part}.{name}"] = (tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
    return out


def _state(pipe) -> dict:
    """What a capture could leave behind: hooks, instance wrappers, the text model's attention
    implementation, transformers' registrations, the transformer's diffusers hook."""
    from transformers import AttentionInterface, AttentionMaskInterface

    objs = {"pipe": pipe, "vae": pipe.vae, "scheduler": pipe.scheduler, "transformer": pipe.transformer}
    return {"hooks": _hooks(pipe),
            "wrapped": {k: [n for n in names if n in vars(objs[k])] for k, names in WRAPPED.items()},
            "attention": pipe.text_encoder.model.language_model.config._attn_implementation,
            "registered": (CAPTURE_IMPLEMENTATION in AttentionInterface._global_mapping,
                           CAPTURE_IMPLEMENTATION in AttentionMaskInterface._global_mapping),
            "diffusers_hook": HOOK_NAME in getattr(getattr(pipe.transformer, "_diffusers_hook", None),
                                                   "hooks", {})}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``drifttool run --prompt --negative-prompt --checkpoint fixtures/tiny-t2i-chain --mode auto
    --preset diffusers`` (the pipeline's settings), at L2."""
    from typer.testing import CliRunner

    out = tmp_path_factory.mktemp("cli") / "run"
    res = CliRunner().invoke(app, ["run", "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                                   "--checkpoint", str(CHAIN_FOLDER), "--mode", "auto", "--preset",
                                   "diffusers", "--steps", str(STEPS), "--seed", str(SEED),
                                   "--capture", "L2", "--height", "64", "--width", "96", "-o", str(out)])
    assert res.exit_code == ExitCode.OK, res.output
    return out


@pytest.fixture(scope="module")
def captured(pipe, tmp_path_factory):
    """(the plain call's image, the capture's result, its artifact) of one prompt call."""
    plain = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=_generators(1), **CALL).images[0]
    before = _state(pipe)  # transformers installs its hidden-state hooks at the first call
    out = tmp_path_factory.mktemp("cap") / "cap"
    got = capture_pipeline(pipe, out, level="L2", prompt=PROMPT, negative_prompt=NEGATIVE,
                           generator=_generators(1), output_type="pil", **CALL)
    assert _state(pipe) == before
    return plain, got, open_run(out)


def test_a_replay_of_a_capture_with_stages_is_refused_in_one_line(captured, tmp_path):
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["replay", str(captured[2].path), "--checkpoint", str(CHAIN_FOLDER),
                                   "-o", str(tmp_path / "r")])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == ExitCode.USAGE and len(lines) == 1, res.output
    assert "text_encoder, vae_decode stage(s)" in lines[0] and not (tmp_path / "r").exists()


def test_prompt_capture_diffs_identical_against_drifttool_run(captured, cli_run):
    plain, got, run = captured
    assert np.array_equal(np.asarray(got.output.images[0]), np.asarray(plain))  # output unchanged
    ours = open_run(cli_run)
    rep = diff_runs(ours, run)
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    ops = rep.counts["ops"]
    assert ops.only_a == ops.only_b == ops.differ == 0 and ops.matched > 400
    assert np.array_equal(np.asarray(PIL.open(f"{cli_run}.png")), np.asarray(plain))
    # every stage is in both runs, under its component
    table = run.ops_table().to_pylist()
    comps = {(r["component"], r["step"]) for r in table}
    assert {("text_encoder", -1), ("mmdit", 0), ("vae", STEPS)} <= comps
    te_ops = {r["op"] for r in table if r["component"] == "text_encoder"}
    assert te_ops == {"te_embed_tokens", "te_rmsnorm", "te_qkv_bias_gemm", "te_mrope",
                      "te_causal_attention", "te_attn_out_residual", "te_mlp_gate_up_silu",
                      "te_mlp_down_residual", "te_prompt_extract"}
    assert {r["op"] for r in table if r["component"] == "vae"} == {
        "latent_pack_unpack", "vae_latent_normalize", "vae_causal_conv3d", "vae_rms_norm",
        "vae_resample", "vae_mid_attention"}
    assert {r["branch"] for r in table if r["op"] == "te_prompt_extract"} == {"none"}
    assert sorted(r["call"] for r in table if r["op"] == "te_prompt_extract" and r["index"] == 0) == [0, 1]
    # the manifest names the stages, and the weights the chain run names
    stages = run.manifest["stages"]
    assert [(s["stage"], s["component"], s["step"], s["calls"]) for s in stages] == [
        ("text_encoder", "text_encoder", -1, 2), ("transformer", "mmdit", 0, STEPS),
        ("vae_decode", "vae", STEPS, 1)]
    assert stages[0]["prompts"] == [[PROMPT], [NEGATIVE]]
    chain = ours.manifest["chain"]
    assert (stages[0]["weights"], stages[2]["weights"]) == (chain["text_encoder_weights"], chain["vae_weights"])


def test_drifttool_diff_of_the_pair_exits_1_for_the_attention_backend_alone(captured, cli_run, cli):
    """What the README says of this pair: every record IDENTICAL, exit 1 for the semantic check's
    attention backend (drifttool's production SDPA vs diffusers' dispatcher); the pipeline's seed
    is not recorded, listed too, and counted in the mismatch line."""
    code, out = cli("diff", cli_run, captured[2].path)
    lines = out.splitlines()
    assert code == ExitCode.DRIFT, out
    assert lines[0] == ("SEMANTIC MISMATCH  1 program difference, 1 unrecorded field: the runs are "
                        "different programs"), out
    assert lines[1].startswith("  - attention backend: ") and lines[2] == "  - unrecorded: seed: not recorded in run B"
    assert lines[3].startswith("IDENTICAL"), out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_padded_prompts_diff_identical_against_the_chain(pipe, tmp_path, dtype):
    """Two samples whose prompts (and negative prompts) have different lengths: padded text
    encoder batches, per-sample valid rows; in the folder's bf16 and loaded in fp32."""
    prompts, negatives = ["a photo of a dog wearing sunglasses, oil painting", "cat"], ["cat", "a red cube"]
    run_chain(RunSpec(checkpoint=CHAIN_FOLDER, mode="auto", preset="diffusers", steps=2, seed=SEED,
                      capture="L2", height=48, width=80, dtype=dtype), tmp_path / "chain", prompts=prompts,
              negative_prompts=negatives)
    if dtype == "float32":
        pipe = chain_pipeline(dtype=torch.float32)
    got = capture_pipeline(pipe, tmp_path / "cap", level="L2", prompt=prompts, negative_prompt=negatives,
                           generator=_generators(2), output_type="np", true_cfg_scale=4.0, height=48,
                           width=80, num_inference_steps=2)
    assert got.samples == [0, 1] and got.output.images.shape == (2, 48, 80, 3)
    rep = diff_runs(open_run(tmp_path / "chain"), open_run(tmp_path / "cap"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    lens = {(r["call"], r["sample"]): r["txt_len"] for r in open_run(tmp_path / "cap").ops_table().to_pylist()
            if r["op"] == "te_embed_tokens"}
    assert lens[(0, 0)] > lens[(0, 1)] and lens[(1, 0)] < lens[(1, 1)]  # padded rows left out


@pytest.mark.parametrize("part, name, op, block", [
    ("text_encoder", "model.language_model.layers.1.self_attn.o_proj.weight", "te_attn_out_residual", 1),
    ("vae", "decoder.up_blocks.1.resnets.0.conv1.weight", "vae_causal_conv3d", 2)])
def test_a_perturbed_stage_is_the_first_drift(pipe, captured, tmp_path, part, name, op, block):
    _, _, ref = captured
    w = dict(getattr(pipe, part).named_parameters())[name]
    keep = w.detach().clone()
    with torch.no_grad():  # element 22: for a 3×3×3 convolution, a tap on the one real frame
        w.view(-1)[22] += 0.25
    try:
        capture_pipeline(pipe, tmp_path / "b", level="L2", prompt=PROMPT, negative_prompt=NEGATIVE,
                         generator=_generators(1), output_type="pil", **CALL)
    finally:
        with torch.no_grad():
            w.copy_(keep)
    rep = diff_runs(ref, open_run(tmp_path / "b"))
    fd = rep.first_drift
    assert rep.verdict is Verdict.DRIFT
    step = -1 if part == "text_encoder" else STEPS
    assert (fd.component, fd.step, fd.op, fd.block) == (part, step, op, block), fd
    if part == "vae":  # the text encoder and the trajectory before the decode are untouched
        assert rep.identical_through == ("rollout", STEPS - 1)


def test_the_attention_runs_the_configured_implementation(pipe, captured, tmp_path):
    """The capture function hands each call to the text model's own implementation: eager
    attention instead of sdpa is the first drift, at block 0's attention, and the trace names it."""
    pipe.text_encoder.set_attn_implementation("eager")
    try:
        capture_pipeline(pipe, tmp_path / "eager", level="L2", prompt=PROMPT, negative_prompt=NEGATIVE,
                         generator=_generators(1), output_type="pil", **CALL)
        assert pipe.text_encoder.model.language_model.config._attn_implementation == "eager"
    finally:
        pipe.text_encoder.set_attn_implementation("sdpa")
    eager = open_run(tmp_path / "eager")
    fd = diff_runs(captured[2], eager).first_drift
    assert (fd.component, fd.step, fd.block, fd.op) == ("text_encoder", -1, 0, "te_causal_attention")
    kernels = {r["kernel"] for r in eager.trace_rows() if r["op"] == "te_causal_attention"}
    assert kernels == {"transformers:ALL_ATTENTION_FUNCTIONS['eager']"}


def test_latent_output_with_prompts_keeps_the_bytes_and_records_no_decode(pipe, tmp_path):
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE, output_type="latent", **CALL)
    plain = pipe(generator=_generators(1), **kw).images
    got = capture_pipeline(pipe, tmp_path / "lat", generator=_generators(1), **kw)
    assert_same_bytes(got.output.images, plain, "latents")
    run = open_run(tmp_path / "lat")
    assert [s["stage"] for s in run.manifest["stages"]] == ["text_encoder", "transformer"]
    assert "vae" not in {r["component"] for r in run.ops_table().to_pylist()}
    # the loop alone, on request: the text encoder and the decode run uncaptured
    got = capture_pipeline(pipe, tmp_path / "loop", generator=_generators(1), stages=("transformer",),
                           **{**kw, "output_type": "pil"})
    run = open_run(tmp_path / "loop")
    assert [s["stage"] for s in run.manifest["stages"]] == ["transformer"]
    assert {r["component"] for r in run.ops_table().to_pylist()} == {"mmdit"}
    assert np.array_equal(np.asarray(got.output.images[0]),
                          np.asarray(pipe(generator=_generators(1), **{**kw, "output_type": "pil"}).images[0]))


def test_nothing_is_left_after_an_error_in_the_text_encoder_or_the_loop(pipe, captured, tmp_path):
    before = _state(pipe)
    layer = pipe.text_encoder.model.language_model.layers[1]

    def fail(module, args, out):
        raise RuntimeError("stopped in the text encoder")

    handle = layer.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="stopped in the text encoder"):
            capture_pipeline(pipe, tmp_path / "te", prompt=PROMPT, output_type="pil", **CALL)
    finally:
        handle.remove()
    assert _state(pipe) == before and not (tmp_path / "te").exists()

    def stop(p, i, t, kw):
        if i == 1:
            raise RuntimeError("stopped by the callback")
        return {}

    with pytest.raises(RuntimeError, match="stopped by the callback"):
        capture_pipeline(pipe, tmp_path / "loop", prompt=PROMPT, negative_prompt=NEGATIVE,
                         output_type="pil", callback_on_step_end=stop, **CALL)
    assert _state(pipe) == before
    run = open_run(tmp_path / "loop")
    assert not run.manifest["complete"]
    assert {r["component"] for r in run.ops_table().to_pylist()} == {"text_encoder", "mmdit"}


def test_calls_the_capture_cannot_take_are_refused(pipe, tmp_path):
    from diffusers import QwenImageEditPipeline, QwenImageImg2ImgPipeline

    with pytest.raises(UnsupportedConfigError, match="num_images_per_prompt"):
        capture_pipeline(pipe, tmp_path / "x", prompt=PROMPT, num_images_per_prompt=2, **CALL)
    for stages in (("vae_decode",), ("transformer", "decoder")):
        with pytest.raises(UnsupportedConfigError, match="the transformer included"):
            capture_pipeline(pipe, tmp_path / "x", prompt=PROMPT, stages=stages, **CALL)
    pipe.vae.enable_tiling()
    try:
        with pytest.raises(UnsupportedConfigError, match="tiling"):
            capture_pipeline(pipe, tmp_path / "x", prompt=PROMPT, output_type="pil", **CALL)
    finally:
        pipe.vae.disable_tiling()
    img2img = QwenImageImg2ImgPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                       tokenizer=pipe.tokenizer, transformer=pipe.transformer)
    with pytest.raises(UnsupportedConfigError, match="outside the edit pipelines' condition path"):
        capture_pipeline(img2img, tmp_path / "x", prompt=PROMPT, image=PIL.new("RGB", (96, 64)), **CALL)
    edit = QwenImageEditPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                 tokenizer=pipe.tokenizer, processor=None, transformer=pipe.transformer)
    edit.set_progress_bar_config(disable=True)
    before = _state(pipe)  # an edit pipeline's prompt images need the image processor drifttool reproduces
    with pytest.raises(UnsupportedConfigError, match="image processor NoneType is not captured") as err:
        capture_pipeline(edit, tmp_path / "x", prompt=PROMPT, image=PIL.new("RGB", (96, 64)), **CALL)
    assert "\n" not in str(err.value)
    assert _state(pipe) == before and not (tmp_path / "x").exists()
    assert not [n for n in WRAPPED["pipe"] if n in vars(edit)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_edit_condition_encode_diffs_identical_against_an_edit_run(tmp_path, monkeypatch, dtype):
    """``QwenImageEditPipeline`` with prompt embeddings and a condition image: the VAE encode
    (step −1), the trajectory on noisy + condition tokens and the decode, against drifttool's edit
    run (``drifttool run --image --prompt-embeds``: ``chain_edit.run_edit``, preset diffusers-edit)
    on the tiny-edit folder, the prompt embeddings from files. The pipelines resize a condition
    image to a fixed area; the test shrinks that area (module globals, ``edit_cases.small_areas``;
    the edit run likewise) and gives an image already of the size it resizes to. Every record is
    identical; the edit run's ``vae_image_resize`` (the capture adapter does not record the
    pipeline's resize) is declared uncaptured, so the diff leaves it out. In bf16 the replay inputs
    then differ in the prompts only (the edit run stores the files' fp32 prompts, the pipeline
    capture the bf16 ones its transformer received)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel
    from safetensors.torch import save_file

    from drifttool.chain_edit import run_edit
    from drifttool.fixture import locate
    from tests.diffusers_pipeline import qwen_image_scheduler
    from tests.sampling.edit_cases import VAE_AREA, small_areas

    small_areas(monkeypatch)
    fx, w = locate("tiny-edit"), getattr(torch, dtype)
    g = torch.Generator().manual_seed(9)
    cond = tmp_path / "cond.png"  # 128 × 96: its own size under the shrunk area
    PIL.fromarray(torch.randint(0, 256, (96, 128, 3), generator=g, dtype=torch.uint8).numpy()).save(cond)
    embeds = {"txt": torch.randn(1, 9, 32, generator=g), "neg_txt": torch.randn(1, 5, 32, generator=g)}
    for key, t in embeds.items():  # all rows valid: no mask
        save_file({"prompt_embeds": t}, str(tmp_path / f"{key}.safetensors"))
    run_edit(RunSpec(fixture=fx, checkpoint=fx, mode="auto", preset="diffusers-edit", steps=2, seed=SEED,
                     capture="L2", dtype=dtype, height=64, width=96, prompt_embeds=tmp_path / "txt.safetensors",
                     negative_prompt_embeds=tmp_path / "neg_txt.safetensors"), tmp_path / "edit",
             condition_images=[cond], vae_area=VAE_AREA)
    edit = QwenImageEditPipeline(
        scheduler=qwen_image_scheduler(), text_encoder=None, tokenizer=None, processor=None,
        vae=AutoencoderKLQwenImage.from_pretrained(fx / "vae", torch_dtype=w).eval(),
        transformer=QwenImageTransformer2DModel.from_pretrained(fx / "transformer", torch_dtype=w).eval())
    edit.set_progress_bar_config(disable=True)
    kw = dict(image=PIL.open(cond).convert("RGB"), prompt_embeds=embeds["txt"].to(w),
              negative_prompt_embeds=embeds["neg_txt"].to(w), true_cfg_scale=4.0, height=64, width=96,
              num_inference_steps=2, output_type="np")
    plain = edit(generator=_generators(1), **kw).images
    got = capture_pipeline(edit, tmp_path / "cap", level="L2", generator=_generators(1), **kw)
    assert np.array_equal(got.output.images, plain)
    run = open_run(tmp_path / "cap")
    rep = diff_runs(open_run(tmp_path / "edit"), run)
    ops = rep.counts["ops"]
    # only in the edit run: its record of the pipeline's resize (the capture adapter records none)
    # the edit run records the pipeline's resize; the capture declares it uncaptured, so the diff
    # leaves it out on both sides
    resized = [r for r in open_run(tmp_path / "edit").ops_table().to_pylist() if r["op"] == "vae_image_resize"]
    assert len(resized) == 1 and {"op": "vae_image_resize", "index": 0} in run.manifest["uncaptured"]["ops"]
    assert rep.first_drift is None and ops.only_a == ops.only_b == ops.differ == 0 and ops.matched > 300
    if dtype == "float32":
        assert rep.verdict is Verdict.IDENTICAL, rep.reason
    else:
        assert all(d.startswith(("inputs.txt", "inputs.neg_txt")) for d in rep.input_differences), rep.reason
    assert [(s["stage"], s["step"], s["calls"]) for s in run.manifest["stages"]] == [
        ("vae_encode", -1, 1), ("transformer", 0, 2), ("vae_decode", 2, 1)]
    encode = {r["op"] for r in run.ops_table().to_pylist() if r["component"] == "vae" and r["step"] == -1}
    assert encode == {"vae_causal_conv3d", "vae_rms_norm", "vae_resample", "vae_mid_attention",
                      "vae_latent_normalize", "latent_pack_unpack"}
    assert not [n for n in WRAPPED["pipe"] if n in vars(edit)] and "decode" not in vars(edit.vae)
