"""A captured ``QwenImagePipeline`` call against drifttool's sampler driving the same diffusers
transformer (``run_diffusers``) on the same inputs, record for record.

drifttool's sampler reproduces the pipeline's loop exactly when latents stay fp32 (fp32 model,
timestep policy ``t_div_1000_fp32``, sequential CFG, η = 0: the SDE step is then the Euler step):
every common record of every step is identical. In bf16 the pipeline keeps bf16 latents between
steps and drifttool's default sampler fp32, so there only step 0 (same x_t, same timestep under
``pipeline_bf16``) is comparable; under ``--preset diffusers`` the whole bf16 trajectory diffs
IDENTICAL.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from drifttool.adapters.diffusers_pipeline import capture_pipeline
from drifttool.adapters.diffusers_qwenimage import load_transformer, run_diffusers
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import Verdict
from drifttool.sampling.inputs import inputs_from_tensors
from drifttool.settings import RunSpec
from tests.diffusers_pipeline import tiny_pipeline

FIXTURE_MODEL = "fixtures/tiny-t2i/transformer"
KEY = ("step", "block", "stream", "op", "call", "index", "sample", "branch", "role")


def _pair(tmp, dtype: str, policy: str, level: str):
    """(run_diffusers artifact, pipeline capture on the run's own inputs)."""
    tr = load_transformer(FIXTURE_MODEL, getattr(torch, dtype))
    spec = RunSpec(mode="auto", cfg_layout="sequential", timestep_policy=policy, eta=0.0,
                   dtype=dtype, capture=level, batch=3)
    run_diffusers(spec, tmp / "sampler", transformer=tr)
    inp = inputs_from_tensors(load_file(tmp / "sampler" / "inputs.safetensors"))
    _capture(tr, inp, tmp / "pipeline", level, spec_steps(tmp / "sampler"))
    return open_run(tmp / "sampler"), open_run(tmp / "pipeline")


def _capture(tr, inp, out, level: str, steps: int) -> None:
    """``capture_pipeline`` of the real pipeline on the replay inputs ``inp``, cast to the model
    dtype (the sampler casts latents and prompts to it at the model input)."""
    w = tr.dtype
    capture_pipeline(tiny_pipeline(tr), out, level=level,
                     prompt_embeds=inp.txt.to(w), prompt_embeds_mask=inp.txt_mask,
                     negative_prompt_embeds=inp.neg_txt.to(w),
                     negative_prompt_embeds_mask=inp.neg_mask, latents=inp.x0.to(w),
                     height=16 * inp.img_grid[0], width=16 * inp.img_grid[1],
                     num_inference_steps=steps, true_cfg_scale=4.0)


def spec_steps(path) -> int:
    return open_run(path).manifest["settings"]["steps"]


def _records(run, steps):
    return {tuple(r[k] for k in KEY): (r["digest"], r["row_digests"])
            for r in run.ops_table().to_pylist() if r["step"] in steps}


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_bf16_first_step_records_equal_the_sampler_driven_run(level, tmp_path):
    a, b = _pair(tmp_path, "bfloat16", "pipeline_bf16", level)
    ra, rb = _records(a, (-1, 0)), _records(b, (-1, 0))
    declared = {("flow_sde_step_logp", i) for i in (1, 2, 3)}  # the pipeline has no mu/std/logp
    assert {k for k in ra if (k[3], k[5]) not in declared} == set(rb)
    differ = sorted({(k[3], k[5]) for k in rb if ra[k] != rb[k]})
    # the one difference: x_next stays bf16 in the pipeline, fp32 in drifttool's sampler
    assert differ == [("flow_sde_step_logp", 0)]
    assert len(rb) > 400 and {k[3] for k in rb} >= {"flow_sigma_table", "cfg_combine_renorm",
                                                      "joint_attention_fused", "txt_in_rmsnorm_linear"}
    rep = diff_runs(a, b)
    assert rep.counts["ops"].only_a == rep.counts["ops"].only_b == 0
    assert rep.counts["steps"].only_a == rep.counts["steps"].only_b == 0
    assert rep.verdict is Verdict.DRIFT and rep.first_drift.step == 0


def test_fp32_pipeline_capture_equals_the_sampler_driven_run_at_every_step(tmp_path):
    a, b = _pair(tmp_path, "float32", "t_div_1000_fp32", "L2")
    rep = diff_runs(a, b)
    assert rep.first_drift is None
    steps = a.manifest["settings"]["steps"]
    assert rep.identical_through == ("rollout", steps - 1)
    assert rep.counts["ops"].matched > 1500 and rep.counts["steps"].matched == steps * 3 * 5
    assert rep.counts["ops"].only_a == rep.counts["ops"].only_b == 0
    # the pipeline holds no SDE noise (drifttool pins it although η = 0 never draws it): the
    # one thing that keeps the verdict from "identical"
    assert rep.input_differences == ["inputs.noise: only in run A"]
    assert rep.verdict is Verdict.INCONCLUSIVE


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_pipeline_capture_diffs_identical_against_the_diffusers_preset(level, tmp_path):
    """The whole bf16 trajectory: drifttool's sampler under ``--preset diffusers`` (bf16 latents
    between steps, the scheduler's step) driving the same transformer on bf16 prompt embeddings
    from files (``--prompt-embeds``), against the captured pipeline call on the same inputs:
    IDENTICAL, every record of every step compared (the pipeline's declared-uncaptured
    mu/std/logp aside), replay inputs included."""
    from safetensors.torch import save_file

    tr = load_transformer(FIXTURE_MODEL, torch.bfloat16)
    w = torch.bfloat16
    run_diffusers(RunSpec(mode="auto", preset="diffusers", capture="L0", batch=3),
                  tmp_path / "draw", transformer=tr)
    drawn = inputs_from_tensors(load_file(tmp_path / "draw" / "inputs.safetensors"))
    files = {}
    for role, txt, mask in (("pe", drawn.txt, drawn.txt_mask), ("ne", drawn.neg_txt, drawn.neg_mask)):
        files[role] = tmp_path / f"{role}.safetensors"
        t = {"prompt_embeds": txt.to(w).contiguous()}
        if mask is not None:  # None: every token valid (diffusers drops an all-ones mask)
            t["prompt_embeds_mask"] = mask.to(torch.int64).contiguous()
        save_file(t, str(files[role]))
    run_diffusers(RunSpec(mode="auto", preset="diffusers", capture=level, batch=3,
                          prompt_embeds=files["pe"], negative_prompt_embeds=files["ne"]),
                  tmp_path / "preset", transformer=tr)
    inp = inputs_from_tensors(load_file(tmp_path / "preset" / "inputs.safetensors"))
    _capture(tr, inp, tmp_path / "pipeline", level, spec_steps(tmp_path / "preset"))
    rep = diff_runs(open_run(tmp_path / "preset"), open_run(tmp_path / "pipeline"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    # the semantic pre-check works across engines: the same program; the pipeline's generator
    # is not drifttool's, so its seed is listed as unrecorded, never guessed
    assert rep.semantic.verdict == "match", [str(d) for d in rep.semantic.differences]
    assert rep.semantic.unrecorded == ["seed: not recorded in run B"]
    assert rep.exit_code == 0
    assert rep.counts["ops"].differ == 0 and rep.counts["ops"].matched > 500
