"""The canonical LoRA gradient (``drifttool.training.ledger``; RFC ``ws2_lora_grad_invariance``):
a strict training recompute's adapter gradients are byte-equal whatever the trainer's
micro-batching, CFG layout and gradient checkpointing, and equal the definition computed here
from per-sample runs — while autograd's own accumulation (the ledger off) does depend on the
micro-batching."""

from __future__ import annotations

import pytest
import torch

from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora, lora_parameters
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.rollout import recompute, rollout
from drifttool.sampling.step import sampler_model
from drifttool.settings import RunSpec, resolve
from drifttool.training.ledger import GradLedger
from drifttool.training.trainer import micro_batched
from drifttool.ops.strict_trees import tree_sum_stack
from tests.conftest import assert_same_bytes

SAMPLES = (0, 1, 2)  # prompts of different lengths: padded rows in a batch, trimmed per micro-batch


@pytest.fixture(scope="module")
def policy():
    fx, s = resolve(RunSpec(samples=list(SAMPLES)))
    model = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(model, rank=4, alpha=8, seed=5, init_b_std=0.05)
    inputs, _ = s.inputs(fx, model.config)
    cfg = SamplerConfig(num_steps=s.steps, cfg_scale=s.cfg_scale, eta=s.eta)
    traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode="strict"))
    return model, inputs, cfg, traj


def _grads(policy, *, micro=None, cfg_layout="batched", checkpointing=False, ledger=True,
           inputs=None, keep=False):
    model, all_inputs, cfg, traj = policy
    inputs = all_inputs if inputs is None else inputs
    for p in lora_parameters(model).values():
        p.grad = None
    led = GradLedger(model, keep_atoms=keep) if ledger else None
    rt = Runtime(mode="strict", grad_ledger=led)
    cfg = SamplerConfig(num_steps=cfg.num_steps, cfg_scale=cfg.cfg_scale, eta=cfg.eta,
                        cfg_layout=cfg_layout)
    latents = traj.latents[:, [all_inputs.sample_ids.index(s) for s in inputs.sample_ids]]
    batch = len(all_inputs.sample_ids)

    def step(o):
        if o.in_window:
            (-o.logp.sum() / batch).backward()  # the whole batch's mean, whatever is run here
            if led is not None:
                led.finish_step(o.step)

    model.gradient_checkpointing = checkpointing
    try:
        with torch.enable_grad():
            recompute(micro_batched(sampler_model(model), micro), inputs, latents, cfg, rt,
                      phase="train", callback=step)
    finally:
        model.gradient_checkpointing = False
        if led is not None:
            led.close()
    return {n: p.grad.clone() for n, p in lora_parameters(model).items() if p.grad is not None}, led


def _same(a, b, what):
    assert sorted(a) == sorted(b) and a, what
    for name in a:
        assert_same_bytes(a[name], b[name], f"{what}: {name}")


def test_gradients_do_not_depend_on_the_execution_layout(policy):
    base, _ = _grads(policy)
    _same(_grads(policy, micro=1)[0], base, "micro-batches of 1")
    _same(_grads(policy, micro=2)[0], base, "micro-batches of 2")
    _same(_grads(policy, cfg_layout="sequential")[0], base, "sequential CFG")
    _same(_grads(policy, micro=1, checkpointing=True)[0], base, "micro-batches of 1, checkpointing")


def test_ledger_is_the_definition(policy):
    """Each (sample, branch) atom of a batched run equals that sample's atom run alone, and the
    totals are the definition: per step the tree over the atoms in (sample, branch) order, the
    steps added in order."""
    _, whole = _grads(policy, keep=True)
    per = {s: _grads(policy, inputs=policy[1].select([s]), keep=True)[1] for s in SAMPLES}
    assert whole.steps == per[0].steps and len(whole.history) == len(whole.steps) > 1
    for t, atoms in enumerate(whole.history):
        for name, by_key in atoms.items():
            assert sorted({k[0] for k in by_key}) == list(SAMPLES) and {k[1] for k in by_key} == {0, 1}
            for key, part in by_key.items():
                assert_same_bytes(part, per[key[0]].history[t][name][key], f"step {t} {name} atom {key}")
    for name, total in whole.totals.items():
        want = None
        for atoms in whole.history:
            if name in atoms:
                by_key = atoms[name]
                g = tree_sum_stack([by_key[k] for k in sorted(by_key)])
                want = g if want is None else want + g
        assert_same_bytes(total, want, f"total {name}")


def test_without_the_ledger_micro_batching_changes_the_bytes(policy):
    """The bug the ledger fixes (issue #12 item 4): autograd's accumulation over micro-batches."""
    a, _ = _grads(policy, ledger=False)
    b, _ = _grads(policy, micro=1, ledger=False)
    differ = [n for n in a if not torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))]
    assert differ, "expected the autograd accumulation to depend on micro-batching"


NEW_TARGETS = ("img_mod.1", "txt_mod.1", "img_in", "txt_in", "time_text_embed.timestep_embedder.linear_1",
               "time_text_embed.timestep_embedder.linear_2", "norm_out.linear", "proj_out")


def test_modulation_embedder_and_final_targets_have_layout_free_gradients():
    """The same invariance for adapters on the modulation projections, the embedders (timestep
    MLP, ``txt_in``, ``img_in``) and the final Linears: each goes through a strict operator
    whose weight gradient reaches the ledger's sink."""
    fx, s = resolve(RunSpec(samples=list(SAMPLES)))
    model = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(model, rank=4, alpha=8, seed=5, init_b_std=0.05, targets=NEW_TARGETS)
    inputs, _ = s.inputs(fx, model.config)
    cfg = SamplerConfig(num_steps=s.steps, cfg_scale=s.cfg_scale, eta=s.eta)
    traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode="strict"))
    pol = (model, inputs, cfg, traj)
    base, _ = _grads(pol)
    assert len(base) == 2 * (6 + 2 * model.config.num_layers)
    _same(_grads(pol, micro=1)[0], base, "micro-batches of 1")
    _same(_grads(pol, cfg_layout="sequential")[0], base, "sequential CFG")


@pytest.mark.slow  # about 8 s on one core; the layout test above covers the ledger in the default run
def test_strict_unfused_fp32_gradients_are_canonical():
    """LoRA mode unfused-fp32 (the factors go to the strict block GEMMs, no merged weight): the
    ledger's atoms are the per-(sample, branch) partials of dA and dB themselves; the same
    invariance, and each atom of the batched run equals the sample's atom run alone."""
    fx, s = resolve(RunSpec(samples=list(SAMPLES)))
    model = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(model, rank=4, alpha=8, seed=5, init_b_std=0.05, mode="unfused-fp32")
    inputs, _ = s.inputs(fx, model.config)
    cfg = SamplerConfig(num_steps=s.steps, cfg_scale=s.cfg_scale, eta=s.eta)
    traj = rollout(sampler_model(model), inputs, cfg, Runtime(mode="strict"))
    pol = (model, inputs, cfg, traj)
    base, whole = _grads(pol, keep=True)
    # every factor but those of the last block's unused text outputs (to_add_out, txt_mlp)
    assert sorted(whole.totals) == sorted(base) and len(base) == len(lora_parameters(model)) - 6
    _same(_grads(pol, micro=1)[0], base, "micro-batches of 1")
    _same(_grads(pol, cfg_layout="sequential")[0], base, "sequential CFG")
    _same(_grads(pol, micro=2, checkpointing=True)[0], base, "micro-batches of 2, checkpointing")
    solo = _grads(pol, inputs=inputs.select([1]), keep=True)[1]
    for t, atoms in enumerate(whole.history):
        for name, by_key in atoms.items():
            for key in [k for k in by_key if k[0] == 1]:
                assert_same_bytes(by_key[key], solo.history[t][name][key], f"step {t} {name} atom {key}")
