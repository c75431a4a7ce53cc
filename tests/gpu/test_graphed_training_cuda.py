"""A training forward and backward replayed from CUDA graphs (``drifttool.model.graphs_train``)
give the eager step's bytes: the velocity and every LoRA factor's gradient, strict and production,
with and without gradient checkpointing, batch 1 and 3 (a padded prompt), on fresh inputs after
the capture; the operator trace and the capture records (L1, L2) of replayed steps are the eager
steps'; a gradient ledger gets the eager steps' atoms (CFG branches batched, checkpointing on and
off); a second forward before the first one's backward runs eagerly and both backwards stay
right; no autograd runs eagerly. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from drifttool.model.config import tiny
from drifttool.model.graphs_train import GraphedTraining
from drifttool.model.lora import LORA_TARGET_MODULES, AdapterConfig, attach_lora, lora_parameters
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime
from tests.conftest import assert_same_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


def _inputs(seed: int, batch: int, grid=(5, 7), slots=11, lens=(11, 6, 9)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g).bfloat16().cuda()
    txt = torch.randn(batch, slots, tiny().joint_attention_dim, generator=g).bfloat16().cuda()
    mask = None if batch == 1 else (torch.arange(slots)[None, :] < torch.tensor(lens[:batch])[:, None]).cuda()
    tau = torch.rand(batch, generator=g).cuda()
    weights = torch.randn(batch, grid[0] * grid[1], 64, generator=g).cuda()
    scope = dict(phase="train", step=seed, sigma=float(tau[0]), samples=list(range(batch)),
                 txt_lens=list(lens[:batch]) if batch > 1 else None, img_grid=grid)
    return (x, txt, mask, tau, grid), weights, scope


@pytest.fixture(scope="module", params=["unfused-fp32", "merged"])
def model(request):
    m = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=4)
    cfg = AdapterConfig(r=4, lora_alpha=6.0, target_modules=tuple(sorted(LORA_TARGET_MODULES)))
    attach_lora(m, cfg, seed=2, init_b_std=0.05, mode=request.param)
    return m.cuda()


def _step(fwd, args, weights, scope, rt, model):
    """One training step: v, then the gradients of ⟨v, weights⟩ into the factors (taken out)."""
    with rt.scope(**scope), torch.enable_grad():
        v = fwd(*args, rt)
        (v.float() * weights).sum().backward()
    grads = {n: p.grad for n, p in lora_parameters(model).items()}
    for p in lora_parameters(model).values():
        p.grad = None
    return v.detach(), grads


def _same(a, b) -> None:
    (va, ga), (vb, gb) = a, b
    assert torch.equal(_bits(va), _bits(vb)), "v differs"
    assert ga.keys() == gb.keys()
    bad = [n for n in ga if (ga[n] is None) != (gb[n] is None)
           or (ga[n] is not None and not torch.equal(_bits(ga[n]), _bits(gb[n])))]
    assert not bad, f"gradients differ: {bad[:4]}"


def _trace(rt: Runtime) -> list[tuple]:
    return sorted((e.op, e.block, e.stream, e.call, e.calls, e.kernel, e.contract, e.device)
                  for e in rt.trace.entries())


@pytest.mark.parametrize("mode", ["strict", "auto"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_steps_equal_eager_steps(model, mode, checkpointing, batch):
    model.gradient_checkpointing = checkpointing
    try:
        fast = GraphedTraining(model)
        eager_rt, graph_rt = Runtime(mode=mode), Runtime(mode=mode)
        for seed in range(4):  # warm-up, capture + replay, then replays on fresh inputs
            args, weights, scope = _inputs(seed, batch)
            want = _step(model, args, weights, scope, eager_rt, model)
            _same(_step(fast, args, weights, scope, graph_rt, model), want)
        assert (fast.captures, fast.replays) == (1, 3)
        assert _trace(graph_rt) == _trace(eager_rt)
    finally:
        model.gradient_checkpointing = False


def test_a_second_forward_before_the_backward_runs_eagerly(model):
    fast = GraphedTraining(model)
    rt = Runtime(mode="strict")
    for seed in range(2):
        _step(fast, *_inputs(seed, 1), rt, model)
    assert fast.replays == 1
    (a, wa, sa), (b, wb, sb) = _inputs(5, 1), _inputs(6, 1)
    want = [_step(model, a, wa, sa, rt, model), _step(model, b, wb, sb, rt, model)]
    with torch.enable_grad():
        with rt.scope(**sa):
            va = fast(*a, rt)  # replayed
        with rt.scope(**sb):
            vb = fast(*b, rt)  # eager: va's backward is pending
        assert fast.replays == 2
        (va.float() * wa).sum().backward()
        (vb.float() * wb).sum().backward()
    got = {n: p.grad for n, p in lora_parameters(model).items()}
    for p in lora_parameters(model).values():
        p.grad = None
    assert torch.equal(_bits(va), _bits(want[0][0])) and torch.equal(_bits(vb), _bits(want[1][0]))
    for n, g in got.items():  # autograd's accumulation: the first gradient, then += the second
        first, second = want[0][1][n], want[1][1][n]
        if first is None or second is None:  # a factor the forward does not reach: no gradient
            assert g is None and first is None and second is None, n
            continue
        assert torch.equal(_bits(g), _bits(first + second)), n
    _same(_step(fast, a, wa, sa, rt, model), want[0])  # pending cleared: replayed again
    assert fast.replays == 3


def test_without_autograd_it_runs_eagerly(model):
    fast = GraphedTraining(model)
    args, weights, scope = _inputs(0, 1)
    rt = Runtime(mode="strict")
    for _ in range(3):
        with torch.no_grad(), rt.scope(**scope):
            fast(*args, rt)
    assert (fast.captures, fast.replays) == (0, 0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_ledger_gets_the_eager_steps_atoms_from_replays(model, checkpointing):
    """Strict training with the gradient ledger (CFG batched: a sample's cond and uncond rows
    beside another sample, fresh sample ids at every step): every step's atoms (under the step's
    own ids), the totals and the factors' .grad after each step are the eager run's, byte for
    byte."""
    from drifttool.training.ledger import GradLedger

    model.gradient_checkpointing = checkpointing
    fast = GraphedTraining(model)
    runs = []
    try:
        for fwd in (model, fast):
            vs, grads = [], []
            with GradLedger(model, keep_atoms=True) as ledger:
                rt = Runtime(mode="strict", grad_ledger=ledger)
                for step in range(4):  # warm-up, capture + replay, replays on fresh inputs
                    args, weights, scope = _inputs(step, 3)
                    scope = {**scope, "samples": [10 * step, 10 * step + 1, 10 * step],  # fresh ids: replayed
                             "branch": ["cond", "cond", "uncond"]}
                    vs.append(_step(fwd, args, weights, scope, rt, model)[0])
                    ledger.finish_step(step)
                    grads.append({n: p.grad.clone() for n, p in lora_parameters(model).items() if p.grad is not None})
            for p in lora_parameters(model).values():
                p.grad = None
            runs.append((vs, grads, ledger.history))
    finally:
        model.gradient_checkpointing = False
    assert (fast.captures, fast.replays) == (1, 3)
    (v_e, g_e, h_e), (v_g, g_g, h_g) = runs
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(v_e, v_g)), "v differs"
    for step, (want, got) in enumerate(zip(h_e, h_g)):
        assert want and got.keys() == want.keys(), step
        for name in want:
            assert got[name].keys() == want[name].keys(), (step, name)
            bad = [k for k in want[name] if not torch.equal(_bits(got[name][k]), _bits(want[name][k]))]
            assert not bad, f"step {step} {name}: atoms {bad} differ"
    for step, (want, got) in enumerate(zip(g_e, g_g)):
        assert want and got.keys() == want.keys(), step
        assert all(torch.equal(_bits(got[n]), _bits(want[n])) for n in want), f"step {step}: .grad differs"


@pytest.mark.parametrize("mode,level", [("strict", "L1"), ("auto", "L2")])  # strict L2 under autograd:
def test_replayed_steps_file_the_eager_steps_records(model, mode, level):  # refused (forward-only)
    """Capture records of replayed training steps (the digests computed inside the forward graph,
    none from the backward's recomputations): the eager steps' rows, each under its own step and
    sample ids."""
    from drifttool.capture.recorder import Recorder

    model.gradient_checkpointing = True
    fast = GraphedTraining(model)
    tables = []
    try:
        for fwd in (model, fast):
            rec = Recorder(level)
            rt = Runtime(mode=mode, recorder=rec)
            for step in range(3):
                args, weights, scope = _inputs(step, 3)
                _step(fwd, args, weights, {**scope, "samples": [3 * step, 3 * step + 1, 3 * step + 2]}, rt, model)
            rec.flush()
            tables.append(rec.ops_table().to_pylist())
    finally:
        model.gradient_checkpointing = False
    assert (fast.captures, fast.replays) == (1, 2)
    assert_same_records(tables[1], tables[0], "replays against eager")
    assert {r["step"] for r in tables[1]} == {0, 1, 2}


def test_a_second_backward_through_one_replay_is_refused(model):
    from drifttool.errors import UnsupportedConfigError

    fast = GraphedTraining(model)
    rt = Runtime(mode="strict")
    for seed in range(2):
        _step(fast, *_inputs(seed, 1), rt, model)
    args, weights, scope = _inputs(3, 1)
    with torch.enable_grad(), rt.scope(**scope):
        loss = (fast(*args, rt).float() * weights).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(UnsupportedConfigError, match="second backward"):
            loss.backward()
    for p in lora_parameters(model).values():
        p.grad = None


def test_inputs_that_want_gradients_and_hooked_parameters_run_eagerly(model):
    fast = GraphedTraining(model)
    rt = Runtime(mode="strict")
    args, weights, scope = _inputs(0, 1)
    x = args[0].clone().requires_grad_(True)
    for _ in range(3):
        _step(fast, (x, *args[1:]), weights, scope, rt, model)
    p = next(iter(lora_parameters(model).values()))
    handle = p.register_hook(lambda g: g)
    try:
        for _ in range(3):
            _step(fast, args, weights, scope, rt, model)
    finally:
        handle.remove()
    assert (fast.captures, fast.replays) == (0, 0)


def test_a_step_that_cannot_be_captured_runs_eagerly(model, uncapturable):
    """A training forward that synchronises with the host while being captured: refused once with
    a warning, the steps run eagerly with the eager bytes from then on; the default stream stays
    current, and a new wrapper still captures and replays."""
    fast = GraphedTraining(model)
    rt = Runtime(mode="strict")
    args, weights, scope = _inputs(4, 1)
    want = _step(model, args, weights, scope, rt, model)
    with uncapturable():
        _same(_step(fast, args, weights, scope, rt, model), want)  # warm-up
        with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
            _same(_step(fast, args, weights, scope, rt, model), want)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    _same(_step(fast, args, weights, scope, rt, model), want)
    assert (fast.captures, fast.replays) == (0, 0) and fast.refused
    again = GraphedTraining(model)
    args, weights, scope = _inputs(5, 3)
    want = _step(model, args, weights, scope, rt, model)
    for _ in range(3):
        _same(_step(again, args, weights, scope, rt, model), want)
    assert (again.captures, again.replays) == (1, 2)
