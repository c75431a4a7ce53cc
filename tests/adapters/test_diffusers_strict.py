"""Strict binding of an unmodified diffusers transformer (``drifttool.adapters.diffusers_strict``):
inside ``bind_strict`` its forward is drifttool's strict MMDiT on its own parameters — byte-equal
to drifttool's model loaded from the same folder (bf16 and FP32, batch 3 with masked prompts),
every traced operator of the strict family, an in-place weight update seen; with a peft adapter,
output and every LoRA gradient (accumulated into peft's own factors) byte-equal to drifttool's
model with the adapter loaded by drifttool; the hook gone afterwards, also after a refused call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from drifttool.adapters.diffusers_qwenimage import load_transformer  # noqa: E402
from drifttool.adapters.diffusers_strict import bind_strict  # noqa: E402
from drifttool.errors import UnsupportedConfigError  # noqa: E402
from drifttool.model.checkpoint import load_checkpoint  # noqa: E402
from drifttool.model.lora import add_lora, lora_modules  # noqa: E402
from drifttool.model.lora_io import load_lora, save_lora  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.settings import RunSpec, resolve  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402

FOLDER = "fixtures/tiny-t2i/transformer"


def _inputs(dtype):
    """Batch 3 of the embedded default (prompts of different lengths: a mask), a fresh tau."""
    fx, s = resolve(RunSpec(samples=[0, 1, 2]))
    model = load_checkpoint(fx.model_dir, dtype=torch.float32)
    inp, _ = s.inputs(fx, model.config)
    tau = torch.rand(3, generator=torch.Generator().manual_seed(1))
    return inp.x0.to(dtype), inp.txt.to(dtype), inp.txt_mask, tau, tuple(inp.img_grid)


def _call(tr, x, txt, mask, tau, grid):
    return tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=tau,
              img_shapes=[[(1, *grid)]] * x.shape[0], return_dict=False)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bound_forward_is_drifttools_strict_model(dtype):
    x, txt, mask, tau, grid = _inputs(dtype)
    assert mask is not None and not bool(mask.all())
    tr = load_transformer(FOLDER, dtype)
    plain = _call(tr, x, txt, mask, tau, grid)
    want = load_checkpoint(FOLDER, dtype=dtype)(x, txt, mask, tau, grid, Runtime(mode="strict"))
    with bind_strict(tr) as bound:
        got = _call(tr, x, txt, mask, tau, grid)
        assert_same_bytes(got, want, "bound transformer vs drifttool's strict MMDiT")
        assert bound.calls == 1 and {e.actual for e in bound.rt.trace.entries()} == {"strict"}
        bound.rt.trace.check_strict()  # no fallback
        with torch.no_grad():  # the parameters are the transformer's own: an update is seen
            tr.proj_out.weight.mul_(0.5)
        halved = _call(tr, x, txt, mask, tau, grid)
        assert not torch.equal(halved, got)
        assert bound.model.proj_out.weight.data_ptr() == tr.proj_out.weight.data_ptr()
    with torch.no_grad():
        tr.proj_out.weight.mul_(2.0)
    assert_same_bytes(_call(tr, x, txt, mask, tau, grid), plain, "unbound again: diffusers' own forward")
    assert not torch.equal(plain, want)  # production and strict arithmetic differ: the test can tell


def test_peft_adapter_trains_under_strict_operators_with_drifttools_gradients(tmp_path):
    base = load_checkpoint(FOLDER, dtype=torch.float32)
    add_lora(base, rank=4, alpha=6.0, seed=2, init_b_std=0.05)
    adapter = save_lora(base, tmp_path / "adapter")
    x, txt, mask, tau, grid = _inputs(torch.float32)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))  # out_dim = in_channels

    ours = load_checkpoint(FOLDER, dtype=torch.float32)
    load_lora(ours, adapter, mode="merged")  # the strict family's LoRA arithmetic
    want = ours(x, txt, mask, tau, grid, Runtime(mode="strict"))
    (want * g).sum().backward()

    tr = load_transformer(FOLDER, torch.float32)
    tr.load_lora_adapter(str(adapter), use_safetensors=True)  # loaded frozen: a trainer unfreezes
    for name, p in tr.named_parameters():
        p.requires_grad_(".lora_" in name)
    peft = {n: m for n, m in tr.named_modules() if hasattr(m, "base_layer")}
    assert peft
    flags = {n: p.requires_grad for n, p in tr.named_parameters()}
    with bind_strict(tr):
        # binding keeps the trainer's choice: the frozen base stays frozen
        assert {n: p.requires_grad for n, p in tr.named_parameters()} == flags
        got = _call(tr, x, txt, mask, tau, grid)
        assert_same_bytes(got, want, "bound peft transformer vs drifttool with the adapter")
        (got * g).sum().backward()
    ours_mods = lora_modules(ours)
    assert set(ours_mods) == set(peft)
    reached = 0
    for name, layer in peft.items():
        (adapter_name,) = list(layer.lora_A)
        for fac in ("lora_A", "lora_B"):
            got_g = getattr(layer, fac)[adapter_name].weight.grad
            want_g = getattr(ours_mods[name], fac).weight.grad
            if want_g is None:  # the last block's text-stream output feeds nothing
                assert got_g is None, f"{name}.{fac}: a gradient drifttool's model does not have"
                continue
            assert got_g is not None, f"{name}.{fac}: no gradient reached peft's factor"
            assert_same_bytes(got_g, want_g, f"{name}.{fac} gradient")
            reached += 1
    assert reached >= len(peft)  # most factors train


def test_refused_arguments_and_the_hook_is_gone_after_an_error():
    x, txt, mask, tau, grid = _inputs(torch.float32)
    tr = load_transformer(FOLDER, torch.float32)
    plain = _call(tr, x, txt, mask, tau, grid)
    with pytest.raises(UnsupportedConfigError, match="guidance"):
        with bind_strict(tr):
            tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=tau,
               img_shapes=[[(1, *grid)]] * 3, guidance=torch.ones(3), return_dict=False)
    assert_same_bytes(_call(tr, x, txt, mask, tau, grid), plain, "after the refused call")


def test_the_gradient_ledger_sets_peft_factors_canonical_gradients(tmp_path):
    """With the ledger on the binding's runtime, peft's factors get the canonical gradient
    (``finish_step``), byte-equal to drifttool's own model under its ledger."""
    from drifttool.training.ledger import GradLedger

    base = load_checkpoint(FOLDER, dtype=torch.float32)
    add_lora(base, rank=4, alpha=6.0, seed=4, init_b_std=0.05)
    adapter = save_lora(base, tmp_path / "adapter")
    x, txt, mask, tau, grid = _inputs(torch.float32)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    scope = dict(samples=[0, 1, 2], branch="cond")

    ours = load_checkpoint(FOLDER, dtype=torch.float32)
    load_lora(ours, adapter, mode="merged")
    with GradLedger(ours) as led:
        rt = Runtime(mode="strict", grad_ledger=led)
        with rt.scope(**scope):
            (ours(x, txt, mask, tau, grid, rt) * g).sum().backward()
        led.finish_step(0)

    tr = load_transformer(FOLDER, torch.float32)
    tr.load_lora_adapter(str(adapter), use_safetensors=True)
    for name, p in tr.named_parameters():
        p.requires_grad_(".lora_" in name)
    with bind_strict(tr) as bound:
        with GradLedger(bound.model) as led:
            bound.rt.grad_ledger = led
            with bound.rt.scope(**scope):
                (_call(tr, x, txt, mask, tau, grid) * g).sum().backward()
            led.finish_step(0)
            assert led.steps == [0] and len(led.totals) > len(lora_modules(bound.model)) // 2  # atoms came in
    peft = {n: m for n, m in tr.named_modules() if hasattr(m, "base_layer")}
    for name, m in lora_modules(ours).items():
        (adapter_name,) = list(peft[name].lora_A)
        for fac in ("lora_A", "lora_B"):
            want_g, got_g = getattr(m, fac).weight.grad, getattr(peft[name], fac)[adapter_name].weight.grad
            assert (want_g is None) == (got_g is None), name
            if want_g is not None:
                assert_same_bytes(got_g, want_g, f"{name}.{fac} canonical gradient")
