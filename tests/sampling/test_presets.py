"""Production presets against the real things, raw bytes (issue 10 item 4).

* ``diffusers``: drifttool's rollout under the preset, driven by the diffusers transformer
  (capture adapter) and by drifttool's own production MMDiT, equals an unmodified
  ``QwenImagePipeline`` (tiny components, tests/diffusers_pipeline.py) at every step and at the
  end: CFG on and off, batch 1 and 3, odd padded prompts, non-square grids.
* ``flow-grpo``: equals ``references/flowgrpo_qwenimage.py`` (Flow-GRPO's rollout and
  ``compute_log_prob`` as Flow-GRPO writes them, on the same diffusers transformer and a real
  scheduler): stored latents, logp_t of the window steps (on the fp32 x'), the training
  recompute under ``t_div_1000_fp32`` re-scoring the stored bf16 latents, and the noise stream.
* The sigma table equals the real scheduler's bytes; settings, manifest, CLI, fail-closed.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift  # noqa: E402
from drifttool.artifact import manifest_schema  # noqa: E402
from drifttool.errors import DriftToolError, UnsupportedConfigError  # noqa: E402
from drifttool.ops import registry  # noqa: E402
from drifttool.references import flowgrpo_qwenimage as fg  # noqa: E402
from drifttool.runner import execute  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.sampling.config import SamplerConfig  # noqa: E402
from drifttool.sampling.presets import PRESET_NAMES, apply_preset, flowgrpo_noise  # noqa: E402
from drifttool.sampling.rollout import recompute, rollout, sigma_table  # noqa: E402
from drifttool.sampling.step import sampler_model  # noqa: E402
from drifttool.settings import RunSpec, resolve  # noqa: E402
from drifttool.training.stored import load_rollout  # noqa: E402
from tests.conftest import assert_same_bytes, bits  # noqa: E402
from tests.diffusers_pipeline import qwen_image_scheduler, tiny_pipeline  # noqa: E402
from tests.sampling.preset_cases import (  # noqa: E402
    Case, full_mask, make_inputs, models, preset_rollout, run_pipeline)

DIFFUSERS_CASES = [
    Case(batch=1, cfg=True, height=64, width=96, lens=(7,), neg_lens=(5,)),
    Case(batch=3, cfg=True, height=80, width=112, lens=(5, 9, 7), neg_lens=(3, 6, 3)),
    Case(batch=3, cfg=False, height=64, width=96, lens=(5, 9, 7)),
    Case(batch=1, cfg=False, height=48, width=80, lens=(11,)),
]


# -- the diffusers preset vs QwenImagePipeline ------------------------------------------------------
@pytest.mark.parametrize("case", DIFFUSERS_CASES, ids=str)
def test_diffusers_preset_equals_the_pipeline_at_every_step(case):
    inputs = make_inputs(case, seed=hash(str(case)) % 10_000)
    per_step, final, pipe_sigmas = run_pipeline(case, inputs)
    assert per_step.dtype == torch.bfloat16 and per_step.shape[0] == case.steps
    for name, model in models().items():
        traj, cfg = preset_rollout(model, inputs, case, "diffusers")
        assert traj.latents.dtype == torch.bfloat16 and traj.complete
        assert_same_bytes(traj.sigmas.to(pipe_sigmas.device), pipe_sigmas, f"{name}: sigma table")
        for i in range(case.steps):
            assert_same_bytes(traj.latents[i + 1], per_step[i], f"{name}: latents after step {i}")
        assert_same_bytes(traj.latents[-1], final, f"{name}: final latents")
        assert torch.isnan(traj.logp).all() and not traj.in_window[0]


def test_diffusers_parity_needs_the_preset():
    """Control: without the preset's step rule or timestep, or with drifttool's default sampler
    (fp32 latents, fp32 Euler, fp32 sigma timestep), the latents are not the pipeline's — so
    the parity test above can fail."""
    case = DIFFUSERS_CASES[0]
    inputs = make_inputs(case, seed=5)
    per_step, _, _ = run_pipeline(case, inputs)
    model = models()["drifttool-mmdit"]
    base = SamplerConfig(num_steps=case.steps, cfg_scale=4.0, eta=0.0, cfg_layout="sequential")
    preset = apply_preset(base, "diffusers", torch.bfloat16)
    for change in ({"step_rule": "sde"}, {"timestep_policy": "sigma_fp32"}, {}):
        cfg = dataclasses.replace(preset, **change) if change else base
        traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode="auto"))
        got = traj.latents[1:].to(torch.bfloat16)
        assert not torch.equal(bits(got), bits(per_step)), f"{change or 'default sampler'}: parity kept"


def test_run_with_the_diffusers_preset_reproduces_the_pipelines_own_draw(tmp_path):
    """End to end: ``execute(RunSpec(preset="diffusers"))`` (its noise source: one CPU generator
    per sample seeded seed + id) equals the pipeline called with that generator list and no
    latents — the pipeline draws its own bf16 noise — at every step."""
    spec = RunSpec(preset="diffusers", mode="auto", capture="L0", batch=3, seed=77)
    fx, s = resolve(spec)
    model = models()["diffusers-adapter"]
    inputs, _ = s.inputs(fx, model.config)
    seen = []
    summary = execute(spec, tmp_path / "run", model=model, on_step=lambda o: seen.append(o.x_next))
    assert summary["complete"]
    pipe = tiny_pipeline(model.transformer)
    got = []
    h, w = s.img_grid
    pipe(prompt_embeds=inputs.txt.to(torch.bfloat16),
         prompt_embeds_mask=full_mask(inputs.txt, inputs.txt_mask).long(),
         negative_prompt_embeds=inputs.neg_txt.to(torch.bfloat16),
         negative_prompt_embeds_mask=full_mask(inputs.neg_txt, inputs.neg_mask).long(),
         true_cfg_scale=s.cfg_scale, height=16 * h, width=16 * w, num_inference_steps=s.steps,
         generator=[torch.Generator().manual_seed(77 + i) for i in range(3)], output_type="latent",
         callback_on_step_end=lambda p, i, t, kw: (got.append(kw["latents"].clone()), kw)[1])
    assert len(got) == len(seen) == s.steps
    for i, (a, b) in enumerate(zip(seen, got)):
        assert_same_bytes(a, b, f"step {i}")


# -- the sigma table ------------------------------------------------------------------------------
@pytest.mark.parametrize("steps,grid", [(2, (1, 1)), (5, (4, 6)), (10, (32, 32)), (13, (37, 41)),
                                        (50, (64, 64)), (50, (83, 83)), (28, (58, 104))])
def test_sigma_table_equals_the_real_scheduler(steps, grid):
    """The pipeline's schedule (``set_timesteps(sigmas=linspace, mu=calculate_shift(...))``)
    byte for byte, and the timesteps 1000·σ the pipeline feeds its timestep cast."""
    sched = qwen_image_scheduler()
    n = grid[0] * grid[1]
    c = sched.config
    mu = calculate_shift(n, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    cfg = apply_preset(SamplerConfig(num_steps=steps), "diffusers", torch.bfloat16)
    ours = sigma_table(Runtime(mode="auto"), cfg, grid)
    assert_same_bytes(ours, sched.sigmas, "sigmas")
    assert_same_bytes(ours[:-1] * 1000, sched.timesteps, "timesteps")


# -- the flow-grpo preset vs Flow-GRPO ------------------------------------------------------------
FLOWGRPO_CASES = [
    (Case(batch=1, cfg=True, height=64, width=96, lens=(7,), neg_lens=(3,), steps=6), 0),
    (Case(batch=3, cfg=True, height=80, width=112, lens=(5, 9, 7), neg_lens=(3, 3, 3), steps=6), 2),
]


@pytest.mark.parametrize("case,window_size", FLOWGRPO_CASES, ids=lambda v: str(v))
def test_flow_grpo_preset_equals_flow_grpo(case, window_size):
    seed = 1000 + case.batch
    inputs = make_inputs(case, seed=seed, common_length=True)
    h, w = case.grid
    x0, noise = flowgrpo_noise(seed, case.batch, img_grid=(h, w), num_steps=case.steps)
    inputs.x0, inputs.noise = x0, noise
    window = fg.sde_window(case.steps, window_size, (0, 5))
    cond = (inputs.txt, full_mask(inputs.txt, inputs.txt_mask))
    uncond = (inputs.neg_txt, full_mask(inputs.neg_txt, inputs.neg_mask))
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # Flow-GRPO seeds the global RNG and passes no generator
        ref = fg.pipeline_with_logprob(
            models()["diffusers-adapter"].transformer, qwen_image_scheduler(), cond, uncond,
            height=case.height, width=case.width, num_inference_steps=case.steps,
            true_cfg_scale=4.0, noise_level=1.2, window=window)
    sched = qwen_image_scheduler()
    fg.set_timesteps(sched, case.steps, h * w)
    inside = list(range(*window))
    for name, model in models().items():
        traj, cfg = preset_rollout(model, inputs, case, "flow-grpo", window=window)
        assert traj.latents.dtype == torch.bfloat16
        for i in range(case.steps + 1):
            assert_same_bytes(traj.latents[i], ref["trajectory"][i], f"{name}: latents {i}")
        for i in inside:
            assert_same_bytes(traj.logp[i], ref["log_probs"][i], f"{name}: rollout logp step {i}")
        # Flow-GRPO's own stored lists: the latent at the window start, then each window step's
        assert_same_bytes(torch.stack(ref["all_latents"]), traj.latents[window[0]:window[1] + 1])
        assert_same_bytes(torch.stack(ref["all_log_probs"]), traj.logp[window[0]:window[1]])
        # training recompute: timestep fp32 t/1000, prev_sample = the stored bf16 next latent
        re = recompute(sampler_model(model), inputs, traj.latents, cfg, Runtime(mode="auto"),
                       steps=inside)
        differs = False
        for k, j in enumerate(inside):
            t = sched.timesteps[j].expand(case.batch)
            with torch.no_grad():
                _, lp, _, _ = fg.compute_log_prob(
                    models()["diffusers-adapter"].transformer, sched, ref["trajectory"][j],
                    ref["trajectory"][j + 1], t, cond, uncond, img_shape=(h, w),
                    guidance_scale=4.0, noise_level=1.2)
            assert_same_bytes(re.logp[k].detach(), lp, f"{name}: train logp step {j}")
            differs |= not torch.equal(bits(re.logp[k].detach()), bits(traj.logp[j]))
        # the train/rollout mismatch Flow-GRPO has (bf16 stored x', t/1000 vs bf16 timestep)
        assert differs, "recompute logp equal to the rollout's: the preset lost Flow-GRPO's mismatch"


def test_flow_grpo_noise_is_its_global_rng_stream():
    """x0 and every step's noise are the draws of Flow-GRPO's order from one seeded stream:
    randn (B,1,16,H',W') in bf16 packed, then randn (B,N,64) fp32 at every step."""
    B, h, w, steps = 3, 3, 5, 4
    x0, noise = flowgrpo_noise(9, B, img_grid=(h, w), num_steps=steps)
    with torch.random.fork_rng():
        torch.manual_seed(9)
        z = torch.randn((B, 1, 16, 2 * h, 2 * w), dtype=torch.bfloat16)
        steps_ref = [torch.randn((B, h * w, 64)) for _ in range(steps)]
    packed = z.view(B, 16, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, 64)
    assert_same_bytes(x0, packed.float(), "x0")
    assert_same_bytes(noise, torch.stack(steps_ref), "noise")


# -- the step rules (production operators) ---------------------------------------------------------
def test_diffusers_euler_rule_is_scheduler_step():
    """``rule="diffusers_euler"`` equals diffusers' ``scheduler.step`` on bf16 inputs, bytes."""
    sched = qwen_image_scheduler()
    sched.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.6)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 35, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 35, 64, generator=g).to(torch.bfloat16)
    fn = registry.implementation("flow_sde_step_logp", "production")
    for i in range(3):
        sched._step_index = i
        want = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
        got, logp, mu, std = registry._IMPLS[("flow_sde_step_logp", "production", "cpu")][1].fn(
            v, x, sched.sigmas[i], sched.sigmas[i + 1], eta=0.0, sigma_max=sched.sigmas[1],
            rule="diffusers_euler")
        assert_same_bytes(got, want, f"step {i}")
        assert torch.isnan(logp).all() and not std.any() and mu.dtype == torch.float32
    with pytest.raises(UnsupportedConfigError, match="step rule"):
        fn(v, x, 1.0, 0.5, eta=0.0, sigma_max=0.75, rule="diffusers_euler")  # first impl refuses


def test_step_rules_dispatch_and_fail_closed():
    g = torch.Generator().manual_seed(4)
    v, x = torch.randn(2, 9, 64, generator=g), torch.randn(2, 9, 64, generator=g)
    eps = torch.randn(2, 9, 64, generator=g)
    rt = Runtime(mode="auto")
    with rt.scope(phase="rollout", step=0, branch="cfg", block=-2, samples=[0, 1]):
        a = registry.call(rt, "flow_sde_step_logp", v.bfloat16(), x.bfloat16(), 0.9, 0.8, eta=0.0,
                          sigma_max=0.95, rule="diffusers_euler")
        b = registry.call(rt, "flow_sde_step_logp", v, x, 0.9, 0.8, eta=0.0, sigma_max=0.95,
                          noise=eps, rule="flow_grpo")
    kernels = [(r["op"], r["actual"], r["kernel"]) for r in rt.trace.rows()]
    assert kernels == [("flow_sde_step_logp", "production", "torch.native.diffusers_scheduler_step"),
                       ("flow_sde_step_logp", "production", "torch.native.flowgrpo_sde.mean")]
    assert a[0].dtype == torch.bfloat16
    # flow_grpo at η = 0: Flow-GRPO's expression, std 0 — x + Δσ·v plus 0·noise, logp NaN
    assert_same_bytes(b[0], (x + (torch.tensor(0.8) - torch.tensor(0.9)) * v) + 0 * eps)
    assert torch.isnan(b[1]).all()
    with pytest.raises(ValueError, match="every step"):
        registry.implementation("flow_sde_step_logp", "production")(
            v, x, 0.9, 0.8, eta=0.0, sigma_max=0.95, rule="flow_grpo")
    with pytest.raises(UnsupportedConfigError, match="step rule"):
        registry.implementation("flow_sde_step_logp", "strict")(
            v, x, 0.9, 0.8, eta=0.0, sigma_max=0.95, rule="flow_grpo")
    with pytest.raises(UnsupportedConfigError, match="eta must be 0"):
        registry._IMPLS[("flow_sde_step_logp", "production", "cpu")][1].fn(
            v, x, 0.9, 0.8, eta=1.0, sigma_max=0.95, rule="diffusers_euler")


# -- settings, manifest, CLI, fail-closed ---------------------------------------------------------
def test_preset_names_agree_with_the_schema():
    assert PRESET_NAMES == manifest_schema.PRESETS == ("diffusers", "diffusers-edit",
                                                       "diffusers-edit-plus", "flow-grpo")


@pytest.mark.parametrize("mode", ["strict", "audit"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_a_preset_under_strict_fails_closed(preset, mode):
    with pytest.raises(UnsupportedConfigError, match=f"preset '{preset}'.*mode '{mode}'") as e:
        resolve(RunSpec(preset=preset, mode=mode))
    assert "\n" not in str(e.value)
    cfg = apply_preset(SamplerConfig(num_steps=3), preset, torch.bfloat16)
    case = Case(batch=1, cfg=False, height=32, width=48, lens=(3,), steps=3)
    inputs = make_inputs(case, seed=1)
    if preset == "flow-grpo":
        inputs.noise = torch.zeros(3, *inputs.x0.shape)
    with pytest.raises(UnsupportedConfigError, match=f"preset '{preset}'"):
        rollout(sampler_model(models()["drifttool-mmdit"]), inputs, cfg, Runtime(mode=mode))


def test_preset_settings_and_contradictions():
    _, s = resolve(RunSpec(preset="diffusers", mode="auto"))
    assert (s.cfg_layout, s.timestep_policy, s.eta, s.preset) == ("sequential", "pipeline_bf16", 0.0, "diffusers")
    cfg = s.sampler()
    assert (cfg.latents_dtype, cfg.step_rule, cfg.preset) == ("bfloat16", "diffusers_euler", "diffusers")
    _, s = resolve(RunSpec(preset="flow-grpo", mode="off", dtype="float32"))
    assert (s.cfg_layout, s.timestep_policy) == ("batched", "t_div_1000_fp32")
    assert s.sampler().train_timestep_policy == "t_div_1000_fp32" and s.sampler().latents_dtype == "float32"
    with pytest.raises(DriftToolError, match="cfg_layout 'sequential'"):
        resolve(RunSpec(preset="diffusers", mode="auto", cfg_layout="batched"))
    with pytest.raises(DriftToolError, match="eta must be 0"):
        resolve(RunSpec(preset="diffusers", mode="auto", eta=1.2))
    with pytest.raises(DriftToolError, match="unknown preset 'sd3'"):
        resolve(RunSpec(preset="sd3", mode="auto"))
    assert "preset" not in resolve(RunSpec())[1].record()


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_cli_records_the_preset_and_replay_is_identical(cli, tmp_path, preset):
    extra = []
    if preset.startswith("diffusers-edit"):  # the edit pipelines take a condition image
        from safetensors.torch import save_file

        save_file({"image_latents": torch.randn(1, 12, 64), "condition_grids": torch.tensor([[3, 4]])},
                  str(tmp_path / "cond.safetensors"))
        extra = ["--condition", tmp_path / "cond.safetensors"]
    code, out = cli("run", "-o", tmp_path / "a", "--preset", preset, "--mode", "auto", "--capture", "L1",
                    *extra)
    assert code == 0, out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["settings"]["preset"] == preset
    assert m["fingerprint"]["dtype_policy"]["latents_between_steps"] == "bfloat16"
    assert m["settings"]["cfg_layout"] == ("batched" if preset == "flow-grpo" else "sequential")
    code, out = cli("replay", tmp_path / "a", "-o", tmp_path / "b")
    assert code == 0, out
    code, out = cli("diff", tmp_path / "a", tmp_path / "b")
    assert code == 0 and "IDENTICAL" in out, out
    code, out = cli("run", "-o", tmp_path / "c", "--preset", preset, *extra)
    assert code != 0 and f"preset '{preset}'" in out and "mode 'strict'" in out
    assert not (tmp_path / "c").exists()


def test_flow_grpo_recompute_of_a_run_uses_the_trainers_timestep(tmp_path):
    """``drifttool recompute`` of a flow-grpo run re-scores the stored bf16 latents with the
    trainer's fp32 t/1000 timestep: its logp_t equal ``recompute`` under the preset's config."""
    execute(RunSpec(preset="flow-grpo", mode="auto", capture="L0"), tmp_path / "a")
    stored = load_rollout(tmp_path / "a")
    assert stored.latent_dtype == "bfloat16"
    assert stored.sampler.preset == "flow-grpo" and stored.sampler.policy("train") == "t_div_1000_fp32"
    assert not math.isnan(float(stored.logp[0, 0]))


def test_preset_noise_is_drawn_for_the_samples_not_their_labels():
    """``sample_labels`` relabel rows; the diffusers preset's x0 stays that of the samples'
    generators (seed + sample id), rounded to bf16."""
    fx, s = resolve(RunSpec(preset="diffusers", mode="auto", samples=[2, 5], sample_labels=[7, 8]))
    inputs, rec = s.inputs(fx, models()["drifttool-mmdit"].config)
    assert inputs.sample_ids == [7, 8] and inputs.noise is None and rec["seed_derivation"] == "offset-v1"
    h, w = s.img_grid
    for row, sid in enumerate((2, 5)):
        z = torch.randn(1, 16, 2 * h, 2 * w, generator=torch.Generator().manual_seed(s.seed + sid))
        packed = z.view(16, h, 2, w, 2).permute(1, 3, 0, 2, 4).reshape(h * w, 64)
        assert_same_bytes(inputs.x0[row], packed.to(torch.bfloat16).float(), f"sample {sid}")


def test_a_fixture_that_names_a_preset_runs_under_it():
    # tiny-edit's settings name the diffusers-edit preset (mode auto): the Python API takes it as
    # the CLI does, and strict is refused in one line (not an unset eta)
    from drifttool.errors import UnsupportedConfigError
    from drifttool.settings import RunSpec, resolve

    _, s = resolve(RunSpec(fixture="tiny-edit", mode="auto"))
    assert s.preset == "diffusers-edit" and s.eta == 0.0 and s.cfg_layout == "sequential"
    with pytest.raises(UnsupportedConfigError, match="preset 'diffusers-edit'"):
        resolve(RunSpec(fixture="tiny-edit"))
    assert resolve(RunSpec(fixture="tiny-t2i"))[1].preset is None
