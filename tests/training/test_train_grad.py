"""Training with gradients: LoRA gradient records (role grad_weight), the gradient-checkpointing
invariant (v_t, logp_t and LoRA gradients byte-equal with and without it), and recompute of a
LoRA rollout."""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pytest
import torch

from drifttool.artifact.reader import open_run
from drifttool.capture.recorder import Recorder
from drifttool.diff.compare import diff_runs
from drifttool.errors import DriftToolError
from drifttool.model.checkpoint import load_checkpoint
from drifttool import memory
from drifttool.model.lora import add_lora, lora_modules, lora_parameters
from drifttool.model.lora_io import save_lora
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.rollout import recompute, rollout
from drifttool.sampling.step import sampler_model
from drifttool.settings import RunSpec, resolve
from drifttool.training.options import RerunOptions, TrainOptions
from drifttool.training.recompute import recompute_run
from tests.conftest import assert_same_bytes


def _policy(samples=(3,)):
    fx, s = resolve(RunSpec(samples=list(samples)))
    model = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(model, rank=4, alpha=8, seed=2, init_b_std=0.05)
    inputs, _ = s.inputs(fx, model.config)
    return model, inputs, SamplerConfig(num_steps=s.steps, cfg_scale=s.cfg_scale, eta=s.eta)


def _train(model, inputs, cfg, traj, mode, checkpointing, level=None):
    for p in lora_parameters(model).values():
        p.grad = None
    model.gradient_checkpointing = checkpointing
    # at L2 the strict fused attention is expanded into its three operators for capture; the
    # backward's recomputation must dispatch the same way (it saves the same tensors)
    rt = Runtime(mode=mode, recorder=None if level is None else Recorder(level))
    try:
        with torch.enable_grad():
            re = recompute(sampler_model(model), inputs, traj.latents, cfg, rt, phase="train",
                           callback=lambda o: (-o.logp.mean()).backward() if o.in_window else None)
    finally:
        model.gradient_checkpointing = False
    grads = {n: p.grad.clone() for n, p in lora_parameters(model).items() if p.grad is not None}
    return re, grads, rt.trace.rows()


@pytest.mark.parametrize("mode,level", [("strict", None), ("auto", None), ("strict", "L2")])
def test_gradient_checkpointing_invariant(mode, level):
    model, inputs, cfg = _policy()
    traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode=mode))
    plain, g_plain, tr_plain = _train(model, inputs, cfg, traj, mode, False, level)
    ckpt, g_ckpt, tr_ckpt = _train(model, inputs, cfg, traj, mode, True, level)
    assert_same_bytes(ckpt.velocities.detach(), plain.velocities.detach(), "v_t")
    assert_same_bytes(ckpt.logp[:3].detach(), plain.logp[:3].detach(), "logp_t")
    assert sorted(g_ckpt) == sorted(g_plain) and len(g_plain) == 42  # 48 factors, 6 without a grad
    for name in g_plain:
        assert_same_bytes(g_ckpt[name], g_plain[name], name)
    assert tr_ckpt == tr_plain  # the backward's recomputation adds no trace calls
    if mode == "strict":  # and the training recompute still matches the rollout
        assert_same_bytes(plain.logp[:3].detach(), traj.logp[:3], "logp_t vs rollout")


@pytest.fixture(scope="module")
def lora_rollout(tmp_path_factory):
    root = tmp_path_factory.mktemp("grad")
    model, _, _ = _policy()
    save_lora(model, root / "adapter")
    execute(RunSpec(lora=root / "adapter", capture="L1", samples=[1]), root / "rollout")
    return root


def test_grad_records_and_checkpointing_in_artifacts(lora_rollout):
    root = lora_rollout
    a = recompute_run(root / "rollout", root / "t-plain", train=TrainOptions(grad=True))
    b = recompute_run(root / "rollout", root / "t-ckpt",
                      train=TrainOptions(grad=True, gradient_checkpointing=True))
    assert a["grad_records"] == b["grad_records"] > 0
    ops = open_run(root / "t-plain").ops_table()
    grads = ops.filter(pc.equal(ops["role"], "grad_weight"))
    assert grads.num_rows == a["grad_records"]
    assert set(grads.column("phase").to_pylist()) == {"train"}
    assert "attn.to_q.lora_A" in set(grads.column("op").to_pylist())
    m = open_run(root / "t-plain").manifest
    assert m["lora"]["r"] == 4 and m["train"]["grad"] is True
    # two training runs diff at the gradient level: identical, grads included
    report = diff_runs(open_run(root / "t-plain"), open_run(root / "t-ckpt"))
    assert report.verdict.value == "identical", report.reason
    assert report.counts["ops"].matched == ops.num_rows
    # the rollout vs its recompute: identical, gradient records left out of the alignment
    report = diff_runs(open_run(root / "rollout"), open_run(root / "t-plain"))
    assert report.verdict.value == "identical", report.reason


def test_gradient_drift_is_named(lora_rollout):
    """Strict vs production trainer on the same rollout: the gradient records differ too."""
    root = lora_rollout
    recompute_run(root / "rollout", root / "t-prod", RerunOptions(mode="auto", overwrite=True),
                  TrainOptions(grad=True))
    if not (root / "t-plain").exists():
        recompute_run(root / "rollout", root / "t-plain", train=TrainOptions(grad=True))
    report = diff_runs(open_run(root / "t-plain"), open_run(root / "t-prod"))
    assert report.verdict.value == "drift"
    run_a = open_run(root / "t-plain").ops_table()
    grad_rows = run_a.filter(pc.equal(run_a["role"], "grad_weight")).num_rows
    assert grad_rows > 0 and report.counts["ops"].differ >= grad_rows


def test_grad_needs_an_adapter(tmp_path):
    execute(RunSpec(capture="L0", samples=[0]), tmp_path / "plain")
    with pytest.raises(DriftToolError, match="LoRA"):
        recompute_run(tmp_path / "plain", tmp_path / "t", train=TrainOptions(grad=True))


def test_a_finished_steps_autograd_graph_is_released(lora_rollout):
    """Every step's outputs reach ``on_step`` with their autograd history (after the backward of a
    step in the SDE window) and are detached after it, in and outside the window: no step keeps
    its forward's activations until the end of the run."""
    root = lora_rollout
    seen = []

    def on_step(o):
        seen.append((o.in_window, o.v.grad_fn is not None, o))

    out = recompute_run(root / "rollout", root / "t-release", RerunOptions(overwrite=True),
                        train=TrainOptions(grad=True), on_step=on_step)
    assert seen and all(had for _, had, _ in seen), "a step reached on_step without its history"
    assert {w for w, _, _ in seen} == {True, False}
    assert all(o.v.grad_fn is None and o.logp.grad_fn is None for *_, o in seen)
    assert out["trajectory"].velocities.grad_fn is None


def _adapted_shapes():
    model, _, _ = _policy()
    return [tuple(m.weight.shape) for m in lora_modules(model).values()]


def test_merged_gradients_that_cannot_fit_are_refused_before_any_step(lora_rollout, monkeypatch):
    """A strict recompute with gradients of a merged adapter needs its canonical gradient's FP32
    partials, (rows + 1) · Σ out · in · 4 bytes (one sample, both CFG branches: 2 rows), beside
    the model: one byte less available and it is refused in one line naming the unfused mode,
    before its artifact exists; exactly that much and it runs. A production trainer, which keeps
    no canonical partials, is not checked."""
    root = lora_rollout
    shapes = _adapted_shapes()
    need = memory.canonical_gradient_bytes(shapes, 2)
    assert need == 3 * sum(o * i for o, i in shapes) * 4
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    with pytest.raises(DriftToolError, match=r"--lora-mode unfused-fp32") as e:
        recompute_run(root / "rollout", root / "t-refused", train=TrainOptions(grad=True))
    assert "2 (sample, CFG branch) rows" in str(e.value) and "\n" not in str(e.value)
    assert not (root / "t-refused").exists()
    recompute_run(root / "rollout", root / "t-prod-small", RerunOptions(mode="auto"), TrainOptions(grad=True))
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    recompute_run(root / "rollout", root / "t-fits", train=TrainOptions(grad=True))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_running_out_of_device_memory_names_what_a_trainer_can_change(lora_rollout, monkeypatch, cli,
                                                                      checkpointing):
    """The device running out of memory in the recompute's steps is one ``error:`` line, exit 2:
    gradient checkpointing named when it is off, the unfused adapter for a merged one's strict
    gradients; the artifact is left incomplete."""
    import drifttool.training.recompute as rc

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 MiB.\nmore")

    monkeypatch.setattr(rc, "recompute", oom)
    out_dir = lora_rollout / f"t-oom-{checkpointing}"
    code, out = cli("recompute", lora_rollout / "rollout", "--grad", "-o", out_dir,
                    *(["--gradient-checkpointing"] if checkpointing else []))
    assert code == 2 and out.count("error:") == 1 and "Traceback" not in out, out
    assert "out of device memory in the training recompute: CUDA out of memory. Tried to allocate 48.00 MiB." in out
    assert ("--gradient-checkpointing keeps" in out) is not checkpointing, out
    assert "--lora-mode unfused-fp32" in out and "more" not in out.split("error:")[1].split("(")[0]
    assert json.loads((out_dir / "manifest.json").read_text())["complete"] is False
