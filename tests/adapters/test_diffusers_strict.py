"""Strict binding of an unmodified diffusers transformer (``drifttool.adapters.diffusers_strict``):
inside ``bind_strict`` its forward is drifttool's strict MMDiT on its own parameters — byte-equal
to drifttool's model loaded from the same folder (bf16 and FP32, batch 3 with masked prompts),
every traced operator of the strict family, an in-place weight update seen; with a peft adapter,
output and every LoRA gradient (accumulated into peft's own factors) byte-equal to drifttool's
model with the adapter loaded by drifttool in the mode bound — ``merged`` (FP32), and
``unfused-fp32`` for a peft-wrapped bf16 transformer (FP32 factors; batch 1 and 3), which is the
default there; ``merged`` the default (recorded) for an adapter outside the block GEMMs or with
bf16 factors; refused modes in one line; the hook gone afterwards, also after a refused call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from drifttool.adapters.diffusers_qwenimage import load_transformer  # noqa: E402
from drifttool.adapters.diffusers_strict import bind_strict  # noqa: E402
from drifttool.errors import UnsupportedConfigError  # noqa: E402
from drifttool.model.checkpoint import load_checkpoint  # noqa: E402
from drifttool.model.lora import LORA_TARGET_MODULES, add_lora, lora_modules  # noqa: E402
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


def assert_same_lora_grads(tr, ours):
    """Every peft factor's ``.grad`` of ``tr`` byte-equal to the same factor's of drifttool's
    ``ours`` (both None where the factor feeds nothing), and most factors reached."""
    peft = {n: m for n, m in tr.named_modules() if hasattr(m, "base_layer")}
    ours_mods = lora_modules(ours)
    assert peft and set(ours_mods) == set(peft)
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
    flags = {n: p.requires_grad for n, p in tr.named_parameters()}
    with bind_strict(tr, lora_mode="merged") as bound:
        assert bound.lora_mode == "merged" and bound.lora_fallback is None
        # binding keeps the trainer's choice: the frozen base stays frozen
        assert {n: p.requires_grad for n, p in tr.named_parameters()} == flags
        got = _call(tr, x, txt, mask, tau, grid)
        assert_same_bytes(got, want, "bound peft transformer vs drifttool with the adapter")
        (got * g).sum().backward()
    assert_same_lora_grads(tr, ours)


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
    with bind_strict(tr, lora_mode="merged") as bound:
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


def save_adapters(folder) -> dict:
    """Two adapters saved by drifttool under ``folder`` (FP32, random non-zero B): ``blocks`` on
    the block GEMMs' Linears (Flow-GRPO's targets), ``proj_out`` on those plus ``proj_out``
    (outside the block GEMMs)."""
    out = {}
    for name, targets in (("blocks", LORA_TARGET_MODULES), ("proj_out", (*LORA_TARGET_MODULES, "proj_out"))):
        base = load_checkpoint(FOLDER, dtype=torch.float32)
        add_lora(base, rank=4, alpha=6.0, targets=targets, seed=7, init_b_std=0.05)
        out[name] = save_lora(base, folder / name)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return save_adapters(tmp_path_factory.mktemp("lora"))


def _peft_wrapped(adapter, dtype=torch.bfloat16):
    """A transformer wrapped by peft (``PeftModel``: the factors autocast to FP32 beside a
    ``dtype`` W, LoRA mode ``unfused-fp32``), the factors trainable, the base frozen."""
    from peft import PeftModel

    tr = load_transformer(FOLDER, dtype)
    PeftModel.from_pretrained(tr, str(adapter))  # injects into tr
    for name, p in tr.named_parameters():
        p.requires_grad_(".lora_" in name)
    return tr


@pytest.mark.parametrize("batch", [1, 3])
def test_peft_wrapped_bf16_binds_unfused_fp32_with_drifttools_bytes_and_gradients(adapters, batch):
    x, txt, mask, tau, grid = (t[:batch] if isinstance(t, torch.Tensor) else t for t in _inputs(torch.bfloat16))
    assert not bool(mask[0].all()) and int(mask[0].sum()) % 2 == 1  # a masked odd-length prompt
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))

    ours = load_checkpoint(FOLDER, dtype=torch.bfloat16)
    load_lora(ours, adapters["blocks"], mode="unfused-fp32")  # the strict block GEMMs add the branch
    rt = Runtime(mode="strict")
    want = ours(x, txt, mask, tau, grid, rt)
    (want.float() * g).sum().backward()

    tr = _peft_wrapped(adapters["blocks"])
    with bind_strict(tr) as bound:  # the default: the layers' own mode
        assert (bound.lora_mode, bound.lora_fallback) == ("unfused-fp32", None)
        got = _call(tr, x, txt, mask, tau, grid)
        (got.float() * g).sum().backward()
    assert_same_bytes(got, want, f"batch {batch}: bound peft transformer vs drifttool in unfused-fp32")
    assert_same_lora_grads(tr, ours)
    entries = bound.rt.trace.entries()
    assert {e.actual for e in entries} == {"strict"} and not {"lora_merge", "lora_delta"} & {e.op for e in entries}
    # control: merged is the same math rounded differently (the bf16 output may round alike, the
    # FP32 factor gradients do not), so the comparison above can tell the modes apart
    factors = [p for n, p in tr.named_parameters() if ".lora_" in n]
    unfused = [p.grad for p in factors]
    for p in factors:
        p.grad = None
    with bind_strict(tr, lora_mode="merged") as merged:
        (_call(tr, x, txt, mask, tau, grid).float() * g).sum().backward()
    assert "lora_merge" in {e.op for e in merged.rt.trace.entries()}
    assert any(a is not None and not torch.equal(a, p.grad) for a, p in zip(unfused, factors))


def test_default_mode_falls_back_to_merged_and_refusals_name_the_mode(adapters):
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    # an adapter outside the block GEMMs: drifttool's strict model refuses it unfused ...
    ours = load_checkpoint(FOLDER, dtype=torch.bfloat16)
    load_lora(ours, adapters["proj_out"], mode="unfused-fp32")
    with pytest.raises(UnsupportedConfigError, match="proj_out"), torch.no_grad():
        ours(x, txt, mask, tau, grid, Runtime(mode="strict"))
    # ... so the binding's default is merged, recorded, and it runs
    tr = _peft_wrapped(adapters["proj_out"])
    with bind_strict(tr) as bound, torch.no_grad():
        assert bound.lora_mode == "merged"
        assert "'unfused-fp32' but it also targets proj_out" in bound.lora_fallback
        _call(tr, x, txt, mask, tau, grid)
    assert "lora_merge" in {e.op for e in bound.rt.trace.entries()}
    with pytest.raises(UnsupportedConfigError, match=r"'unfused-fp32'.*proj_out.*lora_mode='merged'"):
        with bind_strict(tr, lora_mode="unfused-fp32"):
            pass
    with bind_strict(tr, Runtime(mode="auto")) as prod:  # production: the layers' own mode, as before
        assert (prod.lora_mode, prod.lora_fallback) == ("unfused-fp32", None)

    # factors in the model dtype (diffusers' loader): LoRA mode unfused, which strict does not run
    tr = load_transformer(FOLDER, torch.bfloat16)
    tr.load_lora_adapter(str(adapters["blocks"]), use_safetensors=True)
    with bind_strict(tr) as bound:
        assert bound.lora_mode == "merged" and "run LoRA mode 'unfused'" in bound.lora_fallback
    with pytest.raises(UnsupportedConfigError, match=r"'unfused-fp32'.*bfloat16, not float32.*lora_mode='merged'"):
        with bind_strict(tr, lora_mode="unfused-fp32"):
            pass
    with pytest.raises(UnsupportedConfigError, match=r"LoRA mode 'unfused' is production arithmetic.*'merged'"):
        with bind_strict(tr, lora_mode="unfused"):
            pass
    with pytest.raises(UnsupportedConfigError, match="unknown LoRA mode 'unfused_fp32'"):
        with bind_strict(tr, lora_mode="unfused_fp32"):
            pass
