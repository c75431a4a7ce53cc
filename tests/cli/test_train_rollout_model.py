"""``drifttool experiment train-rollout`` on a model of one's own: a pipeline folder
(``--checkpoint``), its adapter as it is (``--lora``) and the sampler's settings (``--steps``,
``--cfg-scale``, ``--batch``), the same in every combination; the rollout's toy reward per
combination; bad combinations of options refused in one line before OUT exists."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from drifttool.artifact.reader import open_run
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_formats import read_adapter
from drifttool.model.lora_io import grad_identity, lora_digest, load_lora, save_lora
from drifttool.training.stored import load_rollout
from tests.chain.tiny_pipeline import build_pipeline

TARGETS = ("attn.to_q", "attn.add_k_proj")
"""The adapter's targets: a fresh adapter (every default target) would differ in its keys too."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random pipeline folder (another seed than the embedded default's weights) and a
    rank-2 adapter of it (peft folder), with lora_B random so it changes the output."""
    root = tmp_path_factory.mktemp("own")
    pipe = build_pipeline(root / "pipe", seed=5)
    m = load_checkpoint(pipe / "transformer")
    add_lora(m, rank=2, alpha=3.0, targets=TARGETS, seed=7, init_b_std=0.02)
    save_lora(m, root / "adapter")
    return pipe, root / "adapter"


def _digest(pipe, adapter) -> str:
    """The adapter's digest as a model of the pipeline carries it (``lora_digest``)."""
    m = load_checkpoint(pipe / "transformer", dtype=torch.bfloat16)
    load_lora(m, adapter)
    return lora_digest(m)


def _final_reward(run_dir) -> float:
    """The mean over samples of the mean of packed channels 0–3 of the stored x_N, by hand."""
    x_n = load_rollout(run_dir).latents[-1].to(torch.float64)  # [B, N, Cp]
    return float(x_n[..., :4].mean(dim=(1, 2)).mean())


def _check_settings(out, pipe, adapter, *, steps: int, cfg_scale: float, samples: list[int]):
    """Every artifact of ``out`` ran the pipeline's model with the adapter and these settings."""
    dirs = sorted(p for p in out.iterdir() if p.name.startswith(("rollout-", "train-")))
    assert len(dirs) == 4, dirs  # two rollouts, two recomputes
    want = _digest(pipe, adapter)
    for d in dirs:
        run = open_run(d)
        s = run.manifest["settings"]
        assert s["checkpoint"] == str(pipe.resolve()) and s["lora"] == str(adapter.resolve()), d
        assert (s["steps"], s["cfg_scale"], s["samples"]) == (steps, cfg_scale, samples), d
        assert run.manifest["lora"]["digest"] == want, d
        steps_seen = set(run.steps_table().column("step").to_pylist())
        assert steps_seen == set(range(steps)), (d, steps_seen)
    assert not (out / "lora").exists()  # no fresh adapter beside the given one
    recorded = json.loads((out / "train_rollout.settings.json").read_text())
    assert recorded["lora"] == {"path": str(adapter.resolve()), "digest": want}
    assert (recorded["steps"], recorded["cfg_scale"], recorded["checkpoint"]) == (steps, cfg_scale,
                                                                                 str(pipe.resolve()))


def _rows(out) -> dict:
    table = pa.ipc.open_stream(open(out / "train_rollout.arrow", "rb")).read_all()
    assert table.schema.metadata[b"drifttool.schema_version"] == b"3"
    assert table.schema.field("reward").type == pa.float64()
    rows = {r["combo"]: r for r in json.loads((out / "train_rollout.json").read_text())}
    assert table.column("reward").to_pylist() == [r["reward"] for r in rows.values()]
    for r in rows.values():  # the rollout's reward (the trainer re-scores the same x_N bytes)
        assert r["reward"] == pytest.approx(_final_reward(r["rollout_dir"]), rel=1e-6, abs=1e-9), r
    return rows


# about 10 s; the same command with gradients runs in the default suite
@pytest.mark.slow
def test_own_model_and_adapter_without_gradients(cli, tmp_path, model_dir):
    pipe, adapter = model_dir
    out = tmp_path / "exp"
    code, text = cli("experiment", "train-rollout", "--checkpoint", pipe, "--lora", adapter,
                     "--steps", "3", "--cfg-scale", "2.5", "--batch", "1", "--no-grad",
                     "--combos", "strict/strict,production/strict", "-o", out)
    assert code == 0, text
    _check_settings(out, pipe, adapter, steps=3, cfg_scale=2.5, samples=[0])
    rows = _rows(out)
    assert rows["strict/strict"]["identical"] and rows["strict/strict"]["v_max_abs"] == 0.0
    assert rows["production/strict"]["verdict"] == "drift"
    assert rows["strict/strict"]["reward"] != rows["production/strict"]["reward"]  # two rollouts
    flat = " ".join(text.split())
    assert "reward" in flat and f"{rows['strict/strict']['reward']:.4g}" in flat


def test_fresh_adapter_on_a_checkpoint(cli, tmp_path, model_dir):
    """Without --lora the fresh adapter (--lora-rank) is attached to the checkpoint's model."""
    pipe, _ = model_dir
    out = tmp_path / "exp"
    code, text = cli("experiment", "train-rollout", "--checkpoint", pipe, "--lora-rank", "2",
                     "--steps", "2", "--batch", "1", "--no-grad", "--combos", "strict/strict", "-o", out)
    assert code == 0, text
    _, cfg = read_adapter(out / "lora")
    assert cfg.r == 2 and cfg.lora_alpha == 8.0
    m = open_run(out / "rollout-strict").manifest
    assert m["settings"]["checkpoint"] == str(pipe.resolve())
    assert m["lora"]["digest"] == _digest(pipe, out / "lora")
    assert json.loads((out / "train_rollout.settings.json").read_text())["lora"]["rank"] == 2


def test_own_model_and_adapter_with_gradients(cli, tmp_path, model_dir):
    """The command with the trainer's backward and a clip range: the LoRA gradient records are
    the given adapter's factors only; strict/strict's first-epoch ratio is exactly 1."""
    pipe, adapter = model_dir
    out = tmp_path / "exp"
    code, text = cli("experiment", "train-rollout", "--checkpoint", pipe, "--lora", adapter,
                     "--steps", "3", "--cfg-scale", "4", "--combos", "strict/strict,production/strict",
                     "--clip-range", "1e-4", "-o", out)
    assert code == 0, text
    _check_settings(out, pipe, adapter, steps=3, cfg_scale=4.0, samples=[0, 1])
    rows = _rows(out)
    ss, ps = rows["strict/strict"], rows["production/strict"]
    assert ss["identical"] and ss["grad_rel_l2"] == 0.0 and ss["clip_ratio_dev_max"] == 0.0
    assert ps["verdict"] == "drift" and ps["grad_rel_l2"] > 0 and ps["clip_ratio_dev_max"] > 0
    tensors, _ = read_adapter(adapter)
    layers = load_checkpoint(pipe / "transformer").config.num_layers
    factors = {grad_identity(k, layers)[::2] for k in tensors}  # (block, op) per adapter factor
    for r in rows.values():
        ops = open_run(r["train_dir"]).ops_table()
        grads = ops.filter(pc.equal(ops["role"], "grad_weight"))
        seen = set(zip(grads.column("block").to_pylist(), grads.column("op").to_pylist()))
        assert seen and seen <= factors, seen - factors
        assert {op for _, op in seen} == {f"{t}.lora_{f}" for t in TARGETS for f in "AB"}
    code, text = cli("diff", out / "train-strict-on-strict", out / "rollout-strict")
    assert code == 0, text


@pytest.mark.parametrize("args,needle", [
    (["--lora-rank", "8"], "--lora-rank set the fresh adapter's shape"),
    (["--lora-alpha", "2", "--lora-rank", "2"], "drop --lora-rank and --lora-alpha"),
])
def test_lora_with_the_fresh_adapters_shape_is_one_line(cli, tmp_path, model_dir, args, needle):
    pipe, adapter = model_dir
    out = tmp_path / "exp"
    code, text = cli("experiment", "train-rollout", "--checkpoint", pipe, "--lora", adapter, *args,
                     "--combos", "strict/strict", "-o", out)
    assert code == 2 and needle in text and len(text.strip().splitlines()) == 1, text
    assert not out.exists()


@pytest.mark.parametrize("option,needle", [
    ("--checkpoint", "no such folder"), ("--lora", "no such file or folder")])
def test_a_missing_model_or_adapter_is_one_line(cli, tmp_path, option, needle):
    out = tmp_path / "exp"
    code, text = cli("experiment", "train-rollout", option, tmp_path / "nowhere",
                     "--combos", "strict/strict", "-o", out)
    assert code == 2 and needle in text and len(text.strip().splitlines()) == 1, text
    assert "Traceback" not in text and not out.exists()
