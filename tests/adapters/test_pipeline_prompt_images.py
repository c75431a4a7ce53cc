"""``capture_pipeline`` of ``QwenImageEditPipeline`` (and ``QwenImageEditPlusPipeline``, two
images) called with prompt strings: the text encoder's vision tower (transformers'
``Qwen2_5_VisionTransformerPretrainedModel``), the image processor's results and the scatter are
captured with the prompt encode, and the whole call diffs IDENTICAL against drifttool's edit run
from the same images and prompts (``run_edit(prompts=...)`` / ``drifttool run --image --prompt
--mode auto --preset diffusers-edit[-plus] --prompt-positions sequential``: the rule diffusers'
edit pipelines get from transformers 5.x). Pipeline folder: the
tiny-edit fixture's transformer and VAE with a tiny text encoder that has a vision tower; the
condition image is already at the size the pipeline resizes it to (its area shrunk, as
``test_pipeline_stages`` does). Nothing of the capture is left after the call or after an error;
the output bytes do not change."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from drifttool.adapters.diffusers_pipeline import capture_pipeline  # noqa: E402
from drifttool.adapters.transformers_qwen25vl import CAPTURE_IMPLEMENTATION  # noqa: E402
from drifttool.adapters.transformers_qwen25vl_vision import VISION_CAPTURE_IMPLEMENTATION  # noqa: E402
from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.chain_edit import run_edit  # noqa: E402
from drifttool.diff.compare import diff_runs  # noqa: E402
from drifttool.diff.report import Verdict  # noqa: E402
from drifttool.fixture import locate  # noqa: E402
from drifttool.ops.specs import VISION_OPERATORS  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402
from tests.text_encoder.tiny_vision import processor, save_tiny_vision_pipeline, transformers  # noqa: E402

PROMPT, NEGATIVE, SEED, STEPS = "make it blue", "a cat", 5, 2
PROMPT_AREA = 64 * 64
"""``edit_cases.small_areas``' edit-plus prompt-image area (the pipeline's 384², shrunk)."""
CALL = dict(true_cfg_scale=4.0, height=64, width=96, num_inference_steps=STEPS, output_type="np")
WRAPPED = ("_get_qwen_prompt_embeds", "_encode_vae_image", "_pack_latents", "_unpack_latents")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny-edit folder with a tiny text encoder (vision tower included) and a tokenizer, and
    a 128 × 96 condition image: its own size under the shrunk area."""
    fx = tmp_path_factory.mktemp("edit") / "fx"
    shutil.copytree(locate("tiny-edit"), fx, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    save_tiny_vision_pipeline(fx, seed=5)
    g = torch.Generator().manual_seed(9)
    PIL.fromarray(torch.randint(0, 256, (96, 128, 3), generator=g, dtype=torch.uint8).numpy()).save(fx / "cond.png")
    return fx


def _pipeline(fx, dtype):
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel

    from tests.diffusers_pipeline import qwen_image_scheduler

    tok = transformers.AutoTokenizer.from_pretrained(fx / "tokenizer", local_files_only=True)
    pipe = QwenImageEditPipeline(
        scheduler=qwen_image_scheduler(), tokenizer=tok, processor=processor(tok),
        text_encoder=transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            fx / "text_encoder", dtype=dtype, local_files_only=True).eval(),
        vae=AutoencoderKLQwenImage.from_pretrained(fx / "vae", torch_dtype=dtype).eval(),
        transformer=QwenImageTransformer2DModel.from_pretrained(fx / "transformer", torch_dtype=dtype).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generators():
    return [torch.Generator().manual_seed(SEED)]


def _state(pipe) -> dict:
    """What a capture could leave behind: hooks, instance wrappers, attention implementations,
    transformers' registrations."""
    from transformers import AttentionInterface

    te = pipe.text_encoder
    hooks = {f"{part}.{n}": (tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
             for part in ("text_encoder", "transformer", "vae") for n, m in getattr(pipe, part).named_modules()}
    return {"hooks": hooks, "wrapped": [n for n in WRAPPED if n in vars(pipe)],
            "processor": [n for n in ("_preprocess", "resize", "patchify") if n in vars(pipe.processor.image_processor)],
            "attention": (te.model.language_model.config._attn_implementation, te.model.visual.config._attn_implementation),
            "registered": [n for n in (CAPTURE_IMPLEMENTATION, VISION_CAPTURE_IMPLEMENTATION)
                           if n in AttentionInterface._global_mapping]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_edit_prompt_capture_diffs_identical_against_the_edit_run(folder, tmp_path, monkeypatch, dtype):
    from tests.sampling.edit_cases import VAE_AREA, small_areas

    small_areas(monkeypatch)
    w = getattr(torch, dtype)
    run_edit(RunSpec(fixture=folder, checkpoint=folder, mode="auto", preset="diffusers-edit", steps=STEPS,
                     seed=SEED, capture="L2", dtype=dtype, height=64, width=96), tmp_path / "edit", condition_images=[folder / "cond.png"],
             prompts=[PROMPT], negative_prompts=[NEGATIVE], positions="sequential", vae_area=VAE_AREA)
    pipe = _pipeline(folder, w)
    kw = dict(image=PIL.open(folder / "cond.png").convert("RGB"), prompt=PROMPT, negative_prompt=NEGATIVE, **CALL)
    edit, run, te = _capture_diffs_identical(pipe, pipe, kw, tmp_path, matched=400)
    # every vision operator but the rope index (sequential positions: none on either side), per prompt
    assert {r["op"] for r in te if r["op"].startswith("te_vision_")} == set(VISION_OPERATORS) - {"te_vision_rope_index"}
    tower = [r for r in te if r["op"].startswith("te_vision_") and r["op"] not in (
        "te_vision_resize", "te_vision_patchify", "te_vision_scatter")]
    assert {r["sample"] for r in tower} == {-1} and {r["stream"] for r in tower} == {"img"}
    assert {(r["op"], r["sample"], r["call"]) for r in te if r["op"] == "te_vision_resize"} == {
        ("te_vision_resize", 0, 0), ("te_vision_resize", 0, 1)}  # the prompt's, then the negative prompt's
    stage = run.manifest["stages"][0]
    assert (stage["stage"], stage["calls"], stage["prompts"], stage["prompt_positions"]) == (
        "text_encoder", 2, [[PROMPT], [NEGATIVE]], "sequential")
    assert stage["weights"] == edit.manifest["edit"]["text_encoder_weights"]


def test_a_perturbed_vision_weight_is_the_first_drift_and_errors_leave_nothing(folder, tmp_path, monkeypatch):
    """A weight of the tower's block 1 changed: the tower's records drift from that block's MLP on;
    an error inside the tower leaves the pipeline as it was."""
    from tests.sampling.edit_cases import small_areas

    small_areas(monkeypatch)
    pipe = _pipeline(folder, torch.float32)
    kw = dict(image=PIL.open(folder / "cond.png").convert("RGB"), prompt=PROMPT, negative_prompt=NEGATIVE, **CALL)
    ref = capture_pipeline(pipe, tmp_path / "a", level="L2", generator=_generators(), **kw)
    assert ref.complete
    before = _state(pipe)
    w = pipe.text_encoder.model.visual.blocks[1].mlp.up_proj.weight
    keep = w.detach().clone()
    with torch.no_grad():
        w.view(-1)[5] += 0.25
    try:
        capture_pipeline(pipe, tmp_path / "b", level="L2", generator=_generators(), **kw)
    finally:
        with torch.no_grad():
            w.copy_(keep)
    fd = diff_runs(open_run(tmp_path / "a"), open_run(tmp_path / "b")).first_drift
    # program order puts the tower (stream img) before the language model: the first drift is the
    # changed block's MLP, not the scatter of its embeddings into the prompt rows (block −1)
    assert (fd.component, fd.step, fd.block, fd.op) == ("text_encoder", -1, 1, "te_vision_mlp_gate_up_silu"), fd

    def tower(path):  # (block, op, call, index) -> digest of the prompt encode's tower records
        return {(r["block"], r["op"], r["call"], r["index"]): r["digest"] for r in open_run(path).ops_table().to_pylist()
                if r["component"] == "text_encoder" and r["stream"] == "img" and r["op"] != "te_vision_resize"
                and r["op"] != "te_vision_patchify"}

    a, b = tower(tmp_path / "a"), tower(tmp_path / "b")
    assert a.keys() == b.keys()
    differ = sorted(k for k in a if a[k] != b[k])
    assert min(k[0] for k in differ) == 1, differ  # blocks −1 and 0 unchanged
    assert {k[1] for k in differ if k[0] == 1} == {"te_vision_mlp_gate_up_silu", "te_vision_mlp_down_residual"}

    def fail(module, args, out):
        raise RuntimeError("stopped in the vision tower")

    handle = pipe.text_encoder.model.visual.blocks[2].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="stopped in the vision tower"):
            capture_pipeline(pipe, tmp_path / "c", generator=_generators(), **kw)
    finally:
        handle.remove()
    assert _state(pipe) == before and not (tmp_path / "c").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_edit_plus_prompt_capture_diffs_identical_against_the_edit_run(folder, tmp_path, monkeypatch, dtype, cli):
    """``QwenImageEditPlusPipeline`` from a prompt string and two condition images of other
    shapes (the pipeline resizes each to the VAE's area and, apart, to its prompt-image area):
    the text encoder's stage (the "Picture k:" template, both prompt images through the processor
    and the vision tower) and the loop are captured, and the call diffs IDENTICAL against
    ``run_edit(..., preset diffusers-edit-plus, positions="sequential")``; ``drifttool diff``
    says what it says of the edit pipeline's pair: every record identical, exit 1 for the
    semantic check's attention backend alone (drifttool's SDPA vs diffusers' dispatcher)."""
    import json

    from diffusers import QwenImageEditPlusPipeline

    from drifttool.exit_codes import ExitCode
    from tests.sampling.edit_cases import VAE_AREA, small_areas

    small_areas(monkeypatch)  # the VAE's area VAE_AREA, the prompt images' PROMPT_AREA
    g = torch.Generator().manual_seed(11)
    conds = [folder / "cond.png", tmp_path / "tall.png"]  # 128x96, and 60x90: resized to 96x128
    PIL.fromarray(torch.randint(0, 256, (90, 60, 3), generator=g, dtype=torch.uint8).numpy()).save(conds[1])
    run_edit(RunSpec(fixture=folder, checkpoint=folder, mode="auto", preset="diffusers-edit-plus", steps=STEPS,
                     seed=SEED, capture="L2", dtype=dtype, height=64, width=96), tmp_path / "edit",
             condition_images=conds, prompts=[PROMPT], negative_prompts=[NEGATIVE], positions="sequential",
             vae_area=VAE_AREA, prompt_area=PROMPT_AREA)
    edit = _pipeline(folder, getattr(torch, dtype))
    plus = QwenImageEditPlusPipeline(scheduler=edit.scheduler, vae=edit.vae, text_encoder=edit.text_encoder,
                                     tokenizer=edit.tokenizer, processor=edit.processor, transformer=edit.transformer)
    plus.set_progress_bar_config(disable=True)
    kw = dict(image=[PIL.open(c).convert("RGB") for c in conds], prompt=PROMPT, negative_prompt=NEGATIVE, **CALL)
    edit_run, run, te = _capture_diffs_identical(plus, edit, kw, tmp_path, matched=500)
    assert not [n for n in WRAPPED if n in vars(plus)]
    assert {r["op"] for r in te if r["op"].startswith("te_vision_")} == set(VISION_OPERATORS) - {"te_vision_rope_index"}
    # both prompt images of the prompt, then both of the negative prompt: one part per prompt
    resized = [(r["sample"], r["call"]) for r in te if r["op"] == "te_vision_resize"]
    assert resized == [(0, 0), (0, 1), (0, 2), (0, 3)], resized
    assert {r["op"] for r in run.ops_table().to_pylist() if r["component"] == "mmdit"} >= {"joint_attention_fused"}
    stages = [(s["stage"], s["calls"]) for s in run.manifest["stages"]]
    assert stages == [("text_encoder", 2), ("vae_encode", 2), ("transformer", STEPS), ("vae_decode", 1)], stages
    stage = run.manifest["stages"][0]
    assert (stage["prompts"], stage["prompt_positions"]) == ([[PROMPT], [NEGATIVE]], "sequential")
    assert stage["weights"] == edit_run.manifest["edit"]["text_encoder_weights"]
    assert run.inputs()["cond_grids"].tolist() == [[6, 8], [8, 6]]  # each image's own VAE grid
    code, out = cli("diff", tmp_path / "edit", tmp_path / "cap", "--json")
    doc = json.loads(out)
    assert code == ExitCode.DRIFT and doc["verdict"] == "identical", out
    assert [d["field"] for d in doc["semantic"]["differences"]] == ["attention backend"], out
    assert doc["semantic"]["unrecorded"] == ["seed: not recorded in run B"], out  # as the README says


def test_rope_index_positions_are_captured_when_the_text_encoder_gets_token_types(folder, tmp_path, monkeypatch):
    """The text encoder handed ``mm_token_type_ids`` (a forward pre-hook of the test's adds them,
    as transformers' own processor output holds them): it computes the multimodal RoPE index,
    recorded as ``te_vision_rope_index``; the capture diffs IDENTICAL against the edit run with
    ``--prompt-positions rope_index``."""
    from tests.sampling.edit_cases import VAE_AREA, small_areas

    small_areas(monkeypatch)
    run_edit(RunSpec(fixture=folder, checkpoint=folder, mode="auto", preset="diffusers-edit", steps=STEPS,
                     seed=SEED, capture="L2", dtype="float32", height=64, width=96), tmp_path / "edit",
             condition_images=[folder / "cond.png"], prompts=[PROMPT], negative_prompts=[NEGATIVE],
             positions="rope_index", vae_area=VAE_AREA)
    pipe = _pipeline(folder, torch.float32)
    image_id = pipe.text_encoder.config.image_token_id

    def token_types(module, args, kwargs):
        return args, {**kwargs, "mm_token_type_ids": (kwargs["input_ids"] == image_id).to(torch.int32)}

    handle = pipe.text_encoder.register_forward_pre_hook(token_types, with_kwargs=True)
    try:
        capture_pipeline(pipe, tmp_path / "cap", level="L2", generator=_generators(),
                         image=PIL.open(folder / "cond.png").convert("RGB"), prompt=PROMPT,
                         negative_prompt=NEGATIVE, **CALL)
    finally:
        handle.remove()
    ours, run = open_run(tmp_path / "edit"), open_run(tmp_path / "cap")
    rep = diff_runs(ours, run)
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert run.manifest["stages"][0]["prompt_positions"] == "rope_index"
    assert sorted(r["call"] for r in run.ops_table().to_pylist() if r["op"] == "te_vision_rope_index") == [0, 1]


def _capture_diffs_identical(pipe, state_of, kw, tmp_path, matched):
    """Capture ``pipe(**kw)`` at L2 into ``tmp_path/cap``: its state (``state_of``'s) and output
    bytes unchanged, the capture IDENTICAL to drifttool's run in ``tmp_path/edit`` over more than
    ``matched`` records. Returns (drifttool's run, the capture, the capture's text-encoder
    records)."""
    plain = pipe(generator=_generators(), **kw).images
    before = _state(state_of)
    got = capture_pipeline(pipe, tmp_path / "cap", level="L2", generator=_generators(), **kw)
    assert _state(state_of) == before
    assert np.array_equal(got.output.images, plain)  # output bytes unchanged
    ours, run = open_run(tmp_path / "edit"), open_run(tmp_path / "cap")
    rep = diff_runs(ours, run)
    ops = rep.counts["ops"]
    assert rep.first_drift is None and ops.only_a == ops.only_b == ops.differ == 0 and ops.matched > matched, rep.reason
    assert rep.verdict is Verdict.IDENTICAL, rep.reason  # the replay inputs too, in bf16 as well
    return ours, run, [r for r in run.ops_table().to_pylist() if r["component"] == "text_encoder"]
