"""Strict binding of an unmodified diffusers transformer on the GPU (``bind_strict``; the CPU
version is ``tests/adapters/test_diffusers_strict.py``): the bound transformer's output equals
drifttool's strict MMDiT on the same device (the strict CUDA family), and with a peft adapter
every LoRA gradient equals drifttool's (the strict CUDA backward), in LoRA mode ``merged`` (FP32) and
``unfused-fp32`` (a peft-wrapped bf16 transformer, the binding's default there). Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from drifttool.adapters.diffusers_qwenimage import load_transformer  # noqa: E402
from drifttool.adapters.diffusers_strict import bind_strict  # noqa: E402
from drifttool.model.checkpoint import load_checkpoint  # noqa: E402
from drifttool.model.lora import add_lora, lora_modules  # noqa: E402
from drifttool.model.lora_io import load_lora, save_lora  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from tests.adapters.test_diffusers_strict import (  # noqa: E402
    FOLDER,
    _call,
    _inputs,
    _peft_wrapped,
    assert_same_lora_grads,
    save_adapters,
)
from tests.conftest import assert_same_bytes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bound_forward_is_drifttools_strict_cuda_model(dtype):
    # inference (no_grad, as the pipelines call the transformer): the base weights require a
    # gradient, which the strict CUDA family's forward-only operators would refuse outside it
    x, txt, mask, tau, grid = _cuda(*_inputs(dtype))
    with torch.no_grad():
        want = load_checkpoint(FOLDER, dtype=dtype, device="cuda")(x, txt, mask, tau, grid,
                                                                   Runtime(mode="strict"))
    tr = load_transformer(FOLDER, dtype).cuda()
    with bind_strict(tr) as bound, torch.no_grad():
        got = _call(tr, x, txt, mask, tau, grid)
    assert_same_bytes(got, want, "bound transformer vs drifttool's strict CUDA MMDiT")
    assert {e.device for e in bound.rt.trace.entries()} - {"cpu"} == {"cuda:0"}


def test_peft_adapter_gradients_equal_drifttools_on_cuda(tmp_path):
    base = load_checkpoint(FOLDER, dtype=torch.float32)
    add_lora(base, rank=4, alpha=6.0, seed=2, init_b_std=0.05)
    adapter = save_lora(base, tmp_path / "adapter")
    x, txt, mask, tau, grid = _cuda(*_inputs(torch.float32))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).cuda()
    ours = load_checkpoint(FOLDER, dtype=torch.float32, device="cuda")
    load_lora(ours, adapter, mode="merged")
    (ours(x, txt, mask, tau, grid, Runtime(mode="strict")) * g).sum().backward()
    tr = load_transformer(FOLDER, torch.float32)
    tr.load_lora_adapter(str(adapter), use_safetensors=True)
    tr = tr.cuda()
    for name, p in tr.named_parameters():
        p.requires_grad_(".lora_" in name)
    with bind_strict(tr, lora_mode="merged"):
        (_call(tr, x, txt, mask, tau, grid) * g).sum().backward()
    peft = {n: m for n, m in tr.named_modules() if hasattr(m, "base_layer")}
    for name, m in lora_modules(ours).items():
        (adapter_name,) = list(peft[name].lora_A)
        for fac in ("lora_A", "lora_B"):
            want_g = getattr(m, fac).weight.grad
            got_g = getattr(peft[name], fac)[adapter_name].weight.grad
            if want_g is None:
                assert got_g is None, name
            else:
                assert_same_bytes(got_g, want_g, f"{name}.{fac} gradient")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return save_adapters(tmp_path_factory.mktemp("lora"))


@pytest.mark.parametrize("batch", [1, 3])
def test_peft_wrapped_bf16_binds_unfused_fp32_with_drifttools_cuda_bytes_and_gradients(adapters, batch):
    x, txt, mask, tau, grid = _cuda(*(t[:batch] if isinstance(t, torch.Tensor) else t
                                      for t in _inputs(torch.bfloat16)))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).cuda()
    ours = load_checkpoint(FOLDER, dtype=torch.bfloat16, device="cuda")
    load_lora(ours, adapters["blocks"], mode="unfused-fp32")
    want = ours(x, txt, mask, tau, grid, Runtime(mode="strict"))
    (want.float() * g).sum().backward()
    tr = _peft_wrapped(adapters["blocks"]).cuda()
    with bind_strict(tr) as bound:
        assert bound.lora_mode == "unfused-fp32"
        got = _call(tr, x, txt, mask, tau, grid)
        (got.float() * g).sum().backward()
    assert_same_bytes(got, want, f"batch {batch}: bound peft transformer vs drifttool's strict CUDA unfused-fp32")
    assert_same_lora_grads(tr, ours)


def test_a_base_weight_that_wants_a_gradient_is_refused_in_one_line():
    # the strict CUDA backward covers LoRA factors and activations; an unfrozen base weight of a
    # forward-only operator is refused, naming the operator and how to freeze it
    from drifttool.errors import UnsupportedConfigError

    x, txt, mask, tau, grid = _cuda(*_inputs(torch.float32))
    model = load_checkpoint(FOLDER, dtype=torch.float32, device="cuda")
    with pytest.raises(UnsupportedConfigError, match="timestep_embed_mlp.*requires_grad_"):
        model(x, txt, mask, tau, grid, Runtime(mode="strict"))
