"""A ``QwenImagePipeline`` that loaded a LoRA adapter the diffusers way, captured, against
``drifttool run --lora ADAPTER --lora-mode <mode> --preset diffusers`` (drifttool's own MMDiT).

For each way a pipeline runs an adapter — ``load_lora_weights`` (unfused, factors in bf16),
``load_lora_weights`` + ``fuse_lora`` (fused), a peft wrapper (``PeftModel.from_pretrained``:
unfused, FP32 factors) — the capture records the adapter (config, scale, digest, mode) as the
run does, and the two artifacts diff IDENTICAL, every record of every step compared; the run in
another mode drifts (the control that makes the first claim able to fail).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from drifttool.adapters.diffusers_pipeline import capture_pipeline
from drifttool.adapters.diffusers_qwenimage import load_transformer
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import Verdict
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_io import save_lora
from drifttool.runner import execute
from drifttool.sampling.inputs import inputs_from_tensors
from drifttool.settings import RunSpec
from tests.diffusers_pipeline import tiny_pipeline

pytest.importorskip("peft")
pytest.importorskip("diffusers")

FIXTURE_MODEL = "fixtures/tiny-t2i/transformer"
OTHER = {"unfused": "fused", "fused": "unfused", "unfused-fp32": "unfused"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """An adapter with α/r = 1.5 and random non-zero B (FP32, not bf16-exact)."""
    model = load_checkpoint(FIXTURE_MODEL, dtype=torch.float32)
    add_lora(model, rank=4, alpha=6.0, seed=2, init_b_std=0.05)
    return save_lora(model, tmp_path_factory.mktemp("lora") / "adapter")


def lora_pipeline(adapter, mode: str, dtype=torch.bfloat16):
    """The tiny pipeline with ``adapter`` loaded the way ``mode`` names."""
    tr = load_transformer(FIXTURE_MODEL, dtype)
    if mode == "unfused-fp32":
        from peft import PeftModel

        PeftModel.from_pretrained(tr, adapter).eval()  # injects into tr; factors autocast to FP32
        return tiny_pipeline(tr)
    pipe = tiny_pipeline(tr)
    pipe.load_lora_weights(adapter)
    if mode == "fused":
        pipe.fuse_lora()
    return pipe


def capture(pipe, run_dir, out, level: str, device: str = "cpu"):
    """``capture_pipeline`` on the run's own replay inputs (moved to ``device``)."""
    inp = inputs_from_tensors(load_file(run_dir / "inputs.safetensors"))
    w = pipe.transformer.dtype

    def on(t):
        return None if t is None else t.to(device)

    return capture_pipeline(pipe, out, level=level, prompt_embeds=on(inp.txt.to(w)),
                            prompt_embeds_mask=on(inp.txt_mask), negative_prompt_embeds=on(inp.neg_txt.to(w)),
                            negative_prompt_embeds_mask=on(inp.neg_mask), latents=on(inp.x0.to(w)),
                            height=16 * inp.img_grid[0], width=16 * inp.img_grid[1],
                            num_inference_steps=open_run(run_dir).manifest["settings"]["steps"],
                            true_cfg_scale=open_run(run_dir).manifest["settings"]["cfg_scale"])


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """The fixture's prompts for batch 2 as bf16 ``--prompt-embeds`` / ``--negative-prompt-embeds``
    files (what a pipeline's text encoder hands over), so the replay inputs match too."""
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("prompts")
    execute(RunSpec(mode="auto", preset="diffusers", capture="L0", batch=2), tmp / "draw")
    drawn = inputs_from_tensors(load_file(tmp / "draw" / "inputs.safetensors"))
    files = {}
    for role, txt, mask in (("pe", drawn.txt, drawn.txt_mask), ("ne", drawn.neg_txt, drawn.neg_mask)):
        files[role] = tmp / f"{role}.safetensors"
        t = {"prompt_embeds": txt.to(torch.bfloat16).contiguous()}
        if mask is not None:
            t["prompt_embeds_mask"] = mask.to(torch.int64).contiguous()
        save_file(t, str(files[role]))
    return files


@pytest.mark.parametrize("mode", ["unfused", "fused", "unfused-fp32"])
def test_captured_lora_pipeline_diffs_identical_against_run_in_its_mode(adapter, prompt_files, mode,
                                                                        tmp_path):
    spec = RunSpec(mode="auto", preset="diffusers", capture="L1", batch=2, dtype="bfloat16",
                   lora=adapter, lora_mode=mode, prompt_embeds=prompt_files["pe"],
                   negative_prompt_embeds=prompt_files["ne"])
    execute(spec, tmp_path / "run")
    pipe = lora_pipeline(adapter, mode)
    capture(pipe, tmp_path / "run", tmp_path / "pipe", "L1")
    run, cap = open_run(tmp_path / "run"), open_run(tmp_path / "pipe")
    assert cap.manifest["lora"] == run.manifest["lora"]
    assert cap.manifest["lora"]["mode"] == mode and cap.manifest["settings"]["lora_mode"] == mode
    assert cap.manifest["fingerprint"]["weights"] == run.manifest["fingerprint"]["weights"]
    rep = diff_runs(run, cap)
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].differ == 0 and rep.counts["ops"].matched > 200

    execute(RunSpec(**{**spec.__dict__, "lora_mode": OTHER[mode]}), tmp_path / "other")
    assert diff_runs(open_run(tmp_path / "other"), cap).verdict is Verdict.DRIFT
