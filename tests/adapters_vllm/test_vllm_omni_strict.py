"""drifttool's strict GEMMs bound into vllm-omni's linears on the CPU: the bound layers' bytes are
the strict operators', the binding reads back into the capture's trace, and what cannot be bound
is refused in one line."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm_omni")

import torch  # noqa: E402

from drifttool.capture.recorder import Recorder  # noqa: E402
from drifttool.errors import UnsupportedConfigError  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402

pytestmark = pytest.mark.vllm_omni
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _strict(op):
    import drifttool.ops  # noqa: F401
    from drifttool.ops.registry import implementation

    return implementation(op, "strict", "cpu")


def _expected(op, layer, x):
    """The strict operator on the layer's own weight and bias, split by hand for the fused QKV."""
    w, b = layer.weight, layer.bias
    if op != "qkv_bias_gemm":
        return _strict(op)(x, w, b)
    n = w.shape[0] // 3
    parts = [(w[i * n:(i + 1) * n], b[i * n:(i + 1) * n]) for i in range(3)]
    q, k, v = _strict(op)(x, *parts[0], *parts[1], *parts[2], layer.num_heads)
    return torch.cat([t.reshape(*x.shape[:-1], n) for t in (q, k, v)], dim=-1)


def _out(layer, x):
    y = layer(x)
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bound_linears_give_the_strict_operators_bytes(load, dtype):
    from drifttool.adapters.vllm_omni_cpu import forward_context
    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms

    model = load(dtype)
    tr = model.transformer
    layers = dict(tr.named_modules())
    g = torch.Generator().manual_seed(11)
    inputs = {p: torch.randn(3, 7, m.input_size, generator=g).to(dtype)
              for p, m in layers.items() if hasattr(m, "quant_method")}
    with forward_context(model.od_config), torch.no_grad():
        before = {p: _out(layers[p], x) for p, x in inputs.items()}
        with bind_strict_gemms(tr, model.od_config) as binding:
            assert sorted(set(binding.bound.values())) == [
                "attn_out_bias_gemm", "latent_proj_gemm", "mlp_down_gemm", "qkv_bias_gemm"]
            assert len(binding.bound) == 2 + 2 * (2 + 2 + 2)  # img_in, proj_out; per block 6
            assert set(binding.bound) | set(binding.unbound) == set(inputs)
            assert all("swap" in why for why in binding.unbound.values()), binding.unbound
            changed = 0
            for path, op in binding.bound.items():
                got, want = _out(layers[path], inputs[path]), _expected(op, layers[path], inputs[path])
                assert got.dtype == dtype and got.shape == before[path].shape
                assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype])), path
                changed += not torch.equal(got.view(BITS[dtype]), before[path].view(BITS[dtype]))
            for path in binding.unbound:  # vLLM's own GEMM, untouched
                assert torch.equal(_out(layers[path], inputs[path]).view(BITS[dtype]),
                                   before[path].view(BITS[dtype])), path
        if dtype == torch.float32:  # the strict order is not F.linear's on these inputs; in bf16
            assert changed > 0  # the rounded outputs may all agree (an AVX2 CPU; not on AVX-512)
        for path, x in inputs.items():  # restored: vLLM's bytes again
            assert torch.equal(_out(layers[path], x).view(BITS[dtype]), before[path].view(BITS[dtype]))
    assert all(type(m.quant_method).__name__ == "UnquantizedLinearMethod"
               for m in layers.values() if hasattr(m, "quant_method"))


def test_the_binding_is_read_back_into_the_trace(load):
    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms

    model = load(torch.float32)
    g = torch.Generator().manual_seed(12)
    grid = (3, 5)
    x, txt = torch.randn(2, 15, 64, generator=g), torch.randn(2, 6, 32, generator=g)
    mask, tau = torch.arange(6)[None, :] < torch.tensor([[6], [3]]), torch.rand(2, generator=g)
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    scope = dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=[0, 1],
                 txt_lens=[6, 3], img_grid=grid)
    with bind_strict_gemms(model.transformer, model.od_config) as binding, \
            rt.scope(**scope), torch.no_grad():
        model(x, txt, mask, tau, grid, rt)
    entries = rt.trace.entries()
    for op in set(binding.bound.values()):
        got = [e.kernel for e in entries if e.op == op]
        assert got and all(f"[StrictLinearMethod/strict:{op}]" in k for k in got), (op, got)
    for op in ("mlp_up_gemm_gelu", "adaln_mod_projection"):  # left to module swaps
        got = [e.kernel for e in entries if e.op == op]
        assert got and all("UnquantizedLinearMethod/" in k and "strict:" not in k for k in got)


def _config(od, **changes):
    od = copy.copy(od)
    pc = copy.copy(od.parallel_config)
    for k, v in changes.items():
        setattr(pc if hasattr(pc, k) and not hasattr(od, k) else od, k, v)
    od.parallel_config = pc
    return od


@pytest.mark.parametrize("changes, message", [
    ({"enforce_eager": False}, "needs enforce_eager=True"),
    ({"cache_backend": "tea_cache"}, "refuses cache backend 'tea_cache'"),
    ({"tensor_parallel_size": 2}, "refuses tensor_parallel_size=2"),
    ({"ring_degree": 2, "sequence_parallel_size": 2}, "refuses ring_degree=2"),
    ({"ulysses_degree": 2, "sequence_parallel_size": 2, "mask_sp_padding": False},
     "sequence_parallel_size=2 with mask_sp_padding=False"),
], ids=["compiled", "cache", "tp", "ring", "sp-padding"])
def test_refuses_what_cannot_be_bound_in_one_line(load, changes, message):
    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms

    model = load(torch.float32)
    with pytest.raises(UnsupportedConfigError, match=message) as e:
        bind_strict_gemms(model.transformer, _config(model.od_config, **changes))
    assert "\n" not in str(e.value)
    assert not any(type(m.quant_method).__name__ == "StrictLinearMethod"
                   for m in model.transformer.modules() if hasattr(m, "quant_method"))


def test_masked_sequence_parallel_padding_is_accepted(load):
    from drifttool.adapters.vllm_omni_strict import refusal

    od = load(torch.float32).od_config
    assert refusal(od) is None
    assert refusal(_config(od, ulysses_degree=2, sequence_parallel_size=2,
                           mask_sp_padding=True)) is None


def test_refuses_a_quantized_or_already_bound_linear_and_binds_nothing(load):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms

    model = load(torch.float32)
    tr = model.transformer
    with bind_strict_gemms(tr, model.od_config):
        with pytest.raises(UnsupportedConfigError, match="img_in is already bound"):
            bind_strict_gemms(tr, model.od_config)

    class Fp8LikeMethod(UnquantizedLinearMethod):
        pass

    layer = tr.transformer_blocks[1].attn.to_out
    original = layer.quant_method
    layer.quant_method = Fp8LikeMethod()
    try:
        with pytest.raises(UnsupportedConfigError,
                           match=r"transformer_blocks\.1\.attn\.to_out: its linear method is "
                                 "Fp8LikeMethod"):
            bind_strict_gemms(tr, model.od_config)
        assert type(tr.img_in.quant_method) is UnquantizedLinearMethod  # nothing half-bound
    finally:
        layer.quant_method = original


def _joint(seed, dtype, B=2, L=6, N=15, H=2, Dh=16, lens=(6, 3)):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L + N, H, Dh, generator=g).to(dtype) for _ in range(3))
    mask = torch.cat([torch.arange(L)[None, :] < torch.tensor(lens)[:, None],
                      torch.ones(B, N, dtype=torch.bool)], dim=1)
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bound_attention_gives_the_strict_operators_bytes(load, dtype):
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

    from drifttool.adapters.vllm_omni_cpu import forward_context
    from drifttool.adapters.vllm_omni_strict_attention import bind_strict_attention

    model = load(dtype)
    tr = model.transformer
    layer = tr.transformer_blocks[0].attn.attn
    q, k, v, mask = _joint(13, dtype, H=layer.num_heads, Dh=layer.head_size)
    meta = AttentionMetadata(attn_mask=mask)
    want = _strict("joint_attention_fused")(q, k, v, mask, text_len=6)
    with forward_context(model.od_config), torch.no_grad():
        before = layer(q, k, v, meta)
        with bind_strict_attention(tr, model.od_config) as binding:
            assert binding.bound == [f"transformer_blocks.{i}.attn.attn" for i in range(2)]
            with pytest.raises(UnsupportedConfigError, match="no text length"):
                layer(q, k, v, meta)  # outside the Qwen-Image attention: refused
            layer.attention.text_len = 6
            got = layer(q, k, v, meta)
            assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))
            if dtype == torch.float32:  # the text length is part of the strict arithmetic
                layer.attention.text_len = 7
                assert not torch.equal(layer(q, k, v, meta).view(BITS[dtype]), got.view(BITS[dtype]))
            with pytest.raises(UnsupportedConfigError, match="additive torch.float32 mask"):
                layer(q, k, v, AttentionMetadata(attn_mask=mask.float()))
        assert not torch.equal(before.view(BITS[dtype]), want.view(BITS[dtype]))
        assert torch.equal(layer(q, k, v, meta).view(BITS[dtype]), before.view(BITS[dtype]))
    assert type(layer.attention).__name__ == "CpuSDPAImpl"
    assert not [n for n, m in tr.named_modules() if m._forward_pre_hooks]


def test_a_bound_forward_runs_strict_attention_and_reads_it_back(load):
    """The whole transformer with GEMMs and attention bound: each attention layer's output is
    the strict operator on the inputs it received, with the text length of that forward."""
    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms
    from drifttool.adapters.vllm_omni_strict_attention import bind_strict_attention

    model = load(torch.float32)
    tr = model.transformer
    g = torch.Generator().manual_seed(14)
    grid = (3, 5)
    x, txt = torch.randn(2, 15, 64, generator=g), torch.randn(2, 5, 32, generator=g)
    mask, tau = torch.arange(5)[None, :] < torch.tensor([[5], [2]]), torch.rand(2, generator=g)
    seen = []
    handles = [blk.attn.attn.register_forward_hook(lambda m, a, o: seen.append((a, o)))
               for blk in tr.transformer_blocks]
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    scope = dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=[0, 1],
                 txt_lens=[5, 2], img_grid=grid)
    try:
        with bind_strict_gemms(tr, model.od_config), bind_strict_attention(tr, model.od_config), \
                rt.scope(**scope), torch.no_grad():
            model(x, txt, mask, tau, grid, rt)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == 2
    for (q, k, v, meta), o in seen:
        assert q.shape[1] == 5 + 15
        want = _strict("joint_attention_fused")(q, k, v, meta.attn_mask, text_len=5)
        assert torch.equal(o.view(torch.int32), want.view(torch.int32))
    attn = [e.kernel for e in rt.trace.entries() if e.op == "joint_attention_fused"]
    assert len(attn) == 2 and all("/StrictAttentionImpl/NoParallelAttention]" in k for k in attn), attn
    gemm = [e.kernel for e in rt.trace.entries() if e.op == "mlp_down_gemm"]
    assert gemm and all("StrictLinearMethod/strict:mlp_down_gemm" in k for k in gemm)


def test_attention_refuses_another_scale_and_a_compiled_run_and_binds_nothing(load):
    from drifttool.adapters.vllm_omni_strict_attention import bind_strict_attention

    model = load(torch.float32)
    tr = model.transformer
    with pytest.raises(UnsupportedConfigError, match="needs enforce_eager=True"):
        bind_strict_attention(tr, _config(model.od_config, enforce_eager=False))
    impl = tr.transformer_blocks[1].attn.attn.attention
    scale = impl.softmax_scale
    impl.softmax_scale = 0.5
    try:
        with pytest.raises(UnsupportedConfigError,
                           match=r"transformer_blocks\.1\.attn\.attn: softmax_scale=0.5"):
            bind_strict_attention(tr, model.od_config)
    finally:
        impl.softmax_scale = scale
    assert type(tr.transformer_blocks[0].attn.attn.attention).__name__ == "CpuSDPAImpl"


def test_the_capture_wrapper_binds_as_its_transformer(load):
    """``load_transformer`` returns the capture wrapper; binding it binds the model inside."""
    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms
    from drifttool.adapters.vllm_omni_strict_attention import bind_strict_attention

    model = load(torch.float32)
    with bind_strict_gemms(model, model.od_config) as gemms, \
            bind_strict_attention(model, model.od_config) as attn:
        assert gemms.bound and attn.bound
        assert type(model.transformer.img_in.quant_method).__name__ == "StrictLinearMethod"


def test_refuses_a_compiled_module_another_version_and_a_non_transformer(load, monkeypatch):
    import importlib.metadata

    from drifttool.adapters.vllm_omni_strict import bind_strict_gemms
    from drifttool.adapters.vllm_omni_strict_attention import bind_strict_attention
    from drifttool.errors import DriftToolError

    model = load(torch.float32)
    for bind in (bind_strict_gemms, bind_strict_attention):
        with pytest.raises(UnsupportedConfigError, match="takes vllm-omni's Qwen-Image transformer"):
            bind(torch.nn.Linear(2, 2), model.od_config)
    block = model.transformer.transformer_blocks[0]
    monkeypatch.setattr(block, "_compiled_call_impl", lambda *a, **k: None, raising=False)
    for bind in (bind_strict_gemms, bind_strict_attention):
        with pytest.raises(UnsupportedConfigError, match="refuses a compiled transformer") as e:
            bind(model.transformer, model.od_config)  # the config still says enforce_eager=True
        assert "\n" not in str(e.value)
    monkeypatch.undo()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.31.0" if name == "vllm-omni" else real(name))
    with pytest.raises(DriftToolError, match="vllm-omni 0.31.0 is not supported"):
        bind_strict_gemms(model.transformer, model.od_config)
    assert type(model.transformer.img_in.quant_method).__name__ != "StrictLinearMethod"
