"""Training recompute (drifttool.training): strict/strict byte equality with the rollout for
v_t and logp_t at every step and sample, the pinned policy, artifacts and the rollout↔train diff,
and refusal of incomplete, tampered or foreign artifacts."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint, save_checkpoint
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.rollout import recompute, rollout
from drifttool.sampling.step import sampler_model
from drifttool.settings import RunSpec, resolve
from drifttool.training.options import RerunOptions, TrainOptions
from drifttool.training.recompute import recompute_run
from drifttool.training.stored import load_rollout
from drifttool.training.trainer import micro_batched
from tests.artifact.table_files import rewrite_table
from tests.conftest import assert_same_bytes


@pytest.fixture(scope="module")
def fixture_model():
    fx, s = resolve(RunSpec())
    return fx, load_checkpoint(fx.model_dir, dtype=s.torch_dtype)


# seeds × batch sizes 1 and 3 × prompt lengths (sample s uses prompt s % 4: lengths 7, 13, 5, 11)
CASES = [
    (386, [0], None),        # B=1, L=7
    (11, [1], 1),            # B=1, L=13, trainer micro-batch 1
    (386, [0, 1, 2], None),  # B=3, lengths 7, 13, 5
    (5, [3, 2, 5], 1),       # B=3, lengths 11, 5, 13; trainer one sample per forward, trimmed
]


@pytest.mark.parametrize("seed,samples,micro", CASES, ids=[f"seed{c[0]}-s{'_'.join(map(str, c[1]))}-mb{c[2]}" for c in CASES])
def test_strict_recompute_is_byte_equal_to_rollout(fixture_model, seed, samples, micro):
    fx, model = fixture_model
    _, s = resolve(RunSpec(seed=seed, samples=samples))
    inputs, _ = s.inputs(fx, model.config)
    cfg = SamplerConfig(num_steps=s.steps, cfg_scale=s.cfg_scale, eta=s.eta)
    traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode="strict"))
    with torch.enable_grad():
        re = recompute(micro_batched(sampler_model(model), micro), inputs, traj.latents, cfg,
                       Runtime(mode="strict"), phase="train")
    for i in range(cfg.num_steps):
        for b in range(inputs.batch):
            what = f"step {i} sample {samples[b]}"
            assert_same_bytes(re.velocities[i, b], traj.velocities[i, b], f"v_t {what}")
            assert_same_bytes(re.v_cond[i, b], traj.v_cond[i, b], f"v_cond {what}")
            assert_same_bytes(re.v_uncond[i, b], traj.v_uncond[i, b], f"v_uncond {what}")
            assert_same_bytes(re.mu[i, b], traj.mu[i, b], f"mu {what}")
            if cfg.in_window(i):
                assert_same_bytes(re.logp[i, b], traj.logp[i, b], f"logp_t {what}")
            else:
                assert torch.isnan(re.logp[i, b]) and torch.isnan(traj.logp[i, b])


def test_timestep_policy_is_pinned(fixture_model):
    """A trainer with another timestep encoding (numerics §5.2) drifts; the pinned one does not."""
    fx, model = fixture_model
    _, s = resolve(RunSpec())
    inputs, _ = s.inputs(fx, model.config)
    cfg = SamplerConfig(num_steps=4, timestep_policy="pipeline_bf16")
    traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode="strict"))
    same = recompute(sampler_model(model), inputs, traj.latents, cfg, Runtime(mode="strict"))
    other = recompute(sampler_model(model), inputs, traj.latents,
                      SamplerConfig(num_steps=4, timestep_policy="t_div_1000_fp32"), Runtime(mode="strict"))
    assert torch.equal(same.logp[:3].view(torch.int32), traj.logp[:3].view(torch.int32))
    assert not torch.equal(other.velocities, traj.velocities)


@pytest.fixture(scope="module")
def strict_rollout(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "rollout"
    execute(RunSpec(timestep_policy="pipeline_bf16", samples=[0, 2]), out)
    return out


def test_recompute_artifact_diffs_identical_and_pins_policy(strict_rollout, tmp_path):
    summary = recompute_run(strict_rollout, tmp_path / "train")
    assert summary["complete"] and summary["mode"] == "strict"
    m = open_run(tmp_path / "train").manifest
    assert m["kind"] == "recompute" and m["source"]["path"] == str(strict_rollout)
    assert m["policy"]["timestep_policy"] == "pipeline_bf16"
    assert m["policy"]["stored_latent_dtype"] == "float32"
    assert m["policy"]["cfg_layout"] == "batched"
    assert m["settings"]["timestep_policy"] == "pipeline_bf16"
    steps = open_run(tmp_path / "train").steps_table()
    assert set(steps.column("phase").to_pylist()) == {"train"}
    report = diff_runs(open_run(strict_rollout), open_run(tmp_path / "train"))
    assert report.verdict.value == "identical", report.reason
    assert any("training recompute" in n for n in report.notes)
    assert report.counts["steps"].matched == steps.num_rows


def test_diff_names_first_drift_of_a_production_trainer(tmp_path):
    """Production rollout, production trainer in its own layout (one sample per forward, prompts
    trimmed): the diff names an origin — operator, block, step, sample and the first differing
    rows — at a production kernel of the trainer. Whether and where the layouts drift depends on
    the machine's production arithmetic (block 0 on one AVX2 host, block 1 on another; identical
    with ATEN_CPU_CAPABILITY=default, whose scalar kernels are layout-invariant here), so neither
    the operator nor the block is pinned."""
    execute(RunSpec(mode="auto", capture="L2"), tmp_path / "roll")
    recompute_run(tmp_path / "roll", tmp_path / "train", train=TrainOptions(micro_batch=1))
    report = diff_runs(open_run(tmp_path / "roll"), open_run(tmp_path / "train"))
    if report.verdict.value == "identical":
        pytest.skip("this CPU's production kernels give the same bytes in both layouts: no drift to name")
    fd = report.first_drift
    assert report.verdict.value == "drift" and fd is not None and fd.origin
    assert fd.phase == "rollout" and fd.sample in (0, 1) and 0 <= fd.step < 4
    assert fd.rows is not None and fd.rows.n_differ > 0 and fd.rows.first
    assert fd.op in report.reason
    sites = [t for t in open_run(tmp_path / "train").trace_rows()
             if (t["op"], t["block"], t["stream"]) == (fd.op, fd.block, fd.stream)]
    assert sites and all(t["actual"] == "production" and not t["fallback"] for t in sites), sites


def _rewrite_steps(run_dir, mutate):
    def edit(table):
        rows = table.to_pylist()
        mutate(rows)
        return pa.Table.from_pylist(rows, schema=table.schema)

    rewrite_table(run_dir / "steps.rank0.parquet", edit)  # the file's digest re-recorded


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_refuses_incomplete_and_tampered(strict_rollout, tmp_path):
    execute(RunSpec(), tmp_path / "cut", max_steps=2)
    with pytest.raises(ArtifactError, match="incomplete"):
        load_rollout(tmp_path / "cut")

    def flip(rows):  # one bit of one stored latent, digest left alone
        r = next(r for r in rows if r["quantity"] == "x_t" and r["step"] == 2)
        data = bytearray(r["data"])
        data[5] ^= 1
        r["data"] = bytes(data)

    bad = _copy(strict_rollout, tmp_path / "flipped")
    _rewrite_steps(bad, flip)
    with pytest.raises(ArtifactError, match="tampered"):
        recompute_run(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()

    def drop(rows):
        rows[:] = [r for r in rows if not (r["quantity"] == "x_t" and r["step"] == 1 and r["branch"] == "cfg")]

    gone = _copy(strict_rollout, tmp_path / "dropped")
    _rewrite_steps(gone, drop)
    with pytest.raises(ArtifactError, match="missing"):
        load_rollout(gone)

    swapped = _copy(strict_rollout, tmp_path / "inputs")
    t = load_file(str(swapped / "inputs.safetensors"))
    t["noise"] = t["noise"] * 1.0001
    save_file(t, str(swapped / "inputs.safetensors"))
    with pytest.raises(ArtifactError, match="noise"):
        load_rollout(swapped, need_latents=False)

    manifest = json.loads((strict_rollout / "manifest.json").read_text())
    manifest["kind"] = "recompute"
    foreign = _copy(strict_rollout, tmp_path / "kind")
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="missing section 'policy': a recompute manifest"):
        load_rollout(foreign)


def test_refuses_a_foreign_trainer_model(strict_rollout, tmp_path):
    other = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=99)
    save_checkpoint(other, tmp_path / "other")
    with pytest.raises(DriftToolError, match="fingerprint differs.*weights"):
        recompute_run(strict_rollout, tmp_path / "t", RerunOptions(checkpoint=tmp_path / "other"))
    fp32 = load_checkpoint(load_fixture("tiny-t2i").model_dir, dtype=torch.float32)
    with pytest.raises(DriftToolError, match="dtype"):
        recompute_run(strict_rollout, tmp_path / "t2", model=fp32)


def _left_padded(inputs):
    """The same prompts padded on the left: each row's valid tokens moved to the end."""
    if inputs.txt_mask is None:
        return inputs
    txt, mask = inputs.txt.clone(), inputs.txt_mask.clone()
    for b in range(txt.shape[0]):
        n = int(mask[b].sum())
        txt[b] = torch.roll(txt[b], txt.shape[1] - n, dims=0)
        mask[b] = torch.roll(mask[b], txt.shape[1] - n, dims=0)
    inputs.txt, inputs.txt_mask = txt, mask
    return inputs


def test_left_padded_prompts_recompute_per_micro_batch(fixture_model, tmp_path):
    """A trainer that runs left-padded prompts one sample per forward (padding after the last
    valid row trimmed, leading padding kept) reproduces the rollout's bytes, and its L2 capture
    takes each row's valid text rows from the sliced ``txt_starts``."""
    from drifttool.artifact.writer import ArtifactWriter
    from drifttool.capture.recorder import Recorder

    fx, model = fixture_model
    _, s = resolve(RunSpec(seed=5, samples=[3, 2, 5]))  # prompt lengths 11, 5, 13
    inputs = _left_padded(s.inputs(fx, model.config)[0])
    assert inputs.txt_mask is not None and not bool(inputs.txt_mask[:, 0].all())
    cfg = SamplerConfig(num_steps=s.steps, cfg_scale=s.cfg_scale, eta=s.eta)

    def runtime(name):
        return Runtime(mode="strict", recorder=Recorder("L2", ArtifactWriter(tmp_path / name, manifest={})))

    traj = rollout(sampler_model(model), inputs, cfg, runtime("roll"))
    re = recompute(micro_batched(sampler_model(model), 1), inputs, traj.latents, cfg, runtime("train"),
                   phase="train")
    for i in range(cfg.num_steps):
        assert_same_bytes(re.velocities[i], traj.velocities[i], f"v_t step {i}")
