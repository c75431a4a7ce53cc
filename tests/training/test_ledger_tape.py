"""A gradient ledger's tape (``GradLedger.tape``: what a graphed training step's capture runs its
sinks on, ``model.graphs_train``): the atoms a tape takes from a strict backward, filed into a
ledger (``file_taken``), give that ledger's own atoms and totals byte for byte; the filed atoms
are copies (a graph rewrites its buffers); a tape files nothing itself, its sinks go with
``close``, a second filing in one step is refused as a sink's would be, and a tape under a TP/SP
plan is refused."""

from __future__ import annotations

import pytest
import torch

from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec, resolve
from drifttool.training.ledger import GradLedger
from tests.conftest import assert_same_bytes

LENS = (7, 3, 7)  # sample 0's cond and uncond rows beside sample 1, its prompt padded


@pytest.fixture(scope="module")
def model():
    fx, s = resolve(RunSpec())
    m = load_checkpoint(fx.model_dir, dtype=s.torch_dtype)
    add_lora(m, rank=4, alpha=8, seed=5, init_b_std=0.05)
    return m


def _backward(model, ledger, seed: int, samples=(0, 1, 0)) -> None:
    """One strict forward of 3 rows (CFG batched) and the backward of a random projection of v."""
    g = torch.Generator().manual_seed(seed)
    cfg, grid, w = model.config, (3, 5), model.dtype
    x = torch.randn(3, 15, cfg.in_channels, generator=g).to(w)
    txt = torch.randn(3, max(LENS), cfg.joint_attention_dim, generator=g).to(w)
    mask = torch.arange(max(LENS))[None, :] < torch.tensor(LENS)[:, None]
    tau = torch.rand(3, generator=g)
    rt = Runtime(mode="strict", grad_ledger=ledger)
    with rt.scope(phase="train", step=0, sigma=0.5, samples=list(samples), branch=["cond", "cond", "uncond"],
                  txt_lens=list(LENS), img_grid=grid), torch.enable_grad():
        v = model(x, txt, mask, tau, grid, rt)
        (v.float() * torch.randn(v.shape, generator=g)).sum().backward()


def test_a_tapes_atoms_filed_into_a_ledger_are_its_own(model):
    direct = GradLedger(model, keep_atoms=True)
    _backward(model, direct, 0)
    direct.finish_step(0)

    ledger = GradLedger(model, keep_atoms=True)
    tape = ledger.tape()
    _backward(model, tape, 0)
    tape.close()
    taken = tape.taken()
    assert taken and {key for _, key, _, _ in taken} == {(0, 0), (1, 0), (0, 1)}
    assert {family for _, _, family, _ in taken} == {"cpu"}
    assert not ledger.taken(), "a tape filed into its ledger"
    ledger.file_taken(taken)
    for *_, part in taken:  # the next replay rewrites the graph's buffers
        part.fill_(float("nan"))
    ledger.finish_step(0)

    want, got = direct.history[0], ledger.history[0]
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for key in want[name]:
            assert_same_bytes(got[name][key], want[name][key], f"{name} {key}")
    assert ledger.totals.keys() == direct.totals.keys()
    for name in direct.totals:
        assert_same_bytes(ledger.totals[name], direct.totals[name], name)
    for p in model.parameters():
        p.grad = None


def test_a_closed_tape_takes_nothing_more_and_a_second_filing_is_refused(model):
    ledger = GradLedger(model)
    tape = ledger.tape()
    _backward(model, tape, 1)
    tape.close()
    taken = tape.taken()
    _backward(model, None, 2)  # new weights, perhaps on the storage the tape's sinks were keyed by
    assert len(tape.taken()) == len(taken)
    ledger.file_taken(taken)
    with pytest.raises(DriftToolError, match="two gradients"):
        ledger.file_taken(taken)
    ledger.close()
    for p in model.parameters():
        p.grad = None


def test_a_tapes_atoms_filed_for_other_samples_are_theirs(model):
    """A graph captured for samples [0, 1, 0] and replayed for [5, 3, 5]: its atoms filed under
    the replay's ids are those of a backward of the latter."""
    direct = GradLedger(model, keep_atoms=True)
    _backward(model, direct, 3, samples=(5, 3, 5))
    direct.finish_step(0)
    tape = GradLedger(model).tape()
    _backward(model, tape, 3)
    tape.close()
    ledger = GradLedger(model, keep_atoms=True)
    ledger.file_taken(tape.taken(), {0: 5, 1: 3})
    ledger.finish_step(0)
    want, got = direct.history[0], ledger.history[0]
    assert got.keys() == want.keys() and all(got[n].keys() == want[n].keys() == {(5, 0), (3, 0), (5, 1)}
                                             for n in want)
    for name in want:
        for key in want[name]:
            assert_same_bytes(got[name][key], want[name][key], f"{name} {key}")
    for p in model.parameters():
        p.grad = None


def test_a_tape_under_a_parallel_plan_is_refused(model):
    with pytest.raises(UnsupportedConfigError, match="TP/SP"):
        GradLedger(model, plan=object()).tape()
