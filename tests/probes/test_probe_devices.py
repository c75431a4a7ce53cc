"""The strict probe matrix per device: variants resolve their base per call from the call's
device, CPU-only variants fail closed elsewhere, and the catalog for ``cuda`` (built here, no GPU
needed) declares every probe that would refuse the device pending with the refusal's reason; the
training controls' CUDA form (a LoRA adapter trained, capture at L1) runs and holds on the CPU."""

from __future__ import annotations

import pytest
import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from drifttool.probes import controls as C
from drifttool.probes import sampler_variants as SV
from drifttool.probes import suspect_variants as SU
from drifttool.probes import variants as V
from drifttool.probes.catalog import catalog
from drifttool.probes.runner import run_matrix
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec

VARIANT_CLASSES = [c for m in (V, SV, SU) for c in vars(m).values()
                   if isinstance(c, type) and issubclass(c, V.Variant) and c is not V.Variant]


def _parts(p):
    """Everything of probe ``p`` that may refuse a device: its built variants, its execution
    and the variants that execution builds (``suspects.Paired``)."""
    parts = [factory() for _, factory in p.variants.values()]
    if p.execute is not None:
        parts.append(p.execute)
        parts += [factory() for _, factory in getattr(p.execute, "variants", {}).values()]
    return parts


def _refusals(p, device):
    return [why for part in _parts(p) if hasattr(part, "refuses") and (why := part.refuses(device))]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_catalog_pends_exactly_the_probes_that_refuse_the_device(device):
    settings = {"device": device} if device != "cpu" else {}
    probes = {p.name: p for p in catalog(settings, family="strict", device=device)}
    refused = {n: _refusals(p, device) for n, p in probes.items()}
    if device == "cpu":
        assert not any(refused.values())
    for name, p in probes.items():
        if refused[name]:
            assert p.pending == refused[name][0], name
        else:  # pending only for a reason of its own (the prompt chain runs on the CPU only)
            assert not p.pending or p.name == "text_encoder_batch", (name, p.pending)
    if device == "cuda":
        assert {n for n, r in refused.items() if r} >= {"gelu_exact", "dp_split_strided"}
        assert "gloo CPU ranks" in probes["dp_split_strided"].pending
        # fp32 baselines add timestep_scale_first, whose GEMMs are the CPU family's
        fp32 = {p.name: p for p in catalog({"dtype": "float32"}, device=device)}
        assert fp32["timestep_scale_first"].pending.startswith("variant timestep_scale_first ")


def test_every_cpu_only_variant_fails_closed_off_the_cpu():
    cpu_only = [c for c in VARIANT_CLASSES if c.cpu_only]
    assert {c.name for c in cpu_only} == {"gelu_exact", "timestep_scale_first"}
    meta = torch.empty(2, 4, device="meta")
    for cls in cpu_only:
        v = cls()
        v.bind_runtime(Runtime())
        assert v.refuses("cpu") == ""
        with pytest.raises(UnsupportedConfigError, match=f"variant {cls.name} runs on the CPU only"):
            v(meta, meta, meta, *([meta, meta] if cls is V.TimestepScaleFirst else []))
    for cls in VARIANT_CLASSES:
        if not cls.cpu_only:
            assert cls.refuses(cls.__new__(cls), "cuda") == "", cls.name


def test_base_is_resolved_per_call_from_the_calls_device():
    v = V.QKNormNoGain()
    v.bind_runtime(Runtime())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 2, 8, generator=g).to(torch.bfloat16)  # [B, S, H, Dh]
    gain = torch.randn(8, generator=g)
    cpu = implementation("qk_rmsnorm", "strict", "cpu")(x, gain)
    got = v.base(x, gain)
    assert got.device.type == "cpu" and torch.equal(got.view(torch.int16), cpu.view(torch.int16))
    # the same callable asks the registry for the device of the call, not for the CPU's
    with pytest.raises(UnsupportedConfigError, match="for device 'meta'"):
        v.base(x.to("meta"), gain.to("meta"))
    with pytest.raises(UnsupportedConfigError, match="for device 'meta'"):
        v.impl("mlp_down_gemm")(x.to("meta"), gain.to("meta"), None)


def test_lora_unmerged_expectation_is_the_devices():
    cpu, cuda = ({p.name: p for p in catalog(device=d)}["lora_unmerged"].expect for d in ("cpu", "cuda"))
    assert (cpu.op, cpu.stream) == ("qkv_bias_gemm", "txt")
    assert (cuda.op, cuda.stream, cuda.step, cuda.block) == ("mlp_up_gemm_gelu", "img", 0, 0)


@pytest.mark.slow  # three LoRA rollouts and their gradient recomputes (about 11 s)
def test_training_controls_cuda_form_holds_on_the_cpu(tmp_path):
    """The controls as the CUDA catalog declares them (LoRA trained, runs at L1), on the CPU."""
    names = ("train_recompute", "gradient_checkpointing", "train_micro_batch")
    probes = [p for p in catalog(device="cuda") if p.name in names]
    assert [p.execute.capture for p in probes] == [C.TRAIN_CAPTURE["cuda"]] * 3 == ["L1"] * 3
    assert all(p.execute.capture is None for p in catalog(device="cpu") if p.name in names)
    m = run_matrix(probes, tmp_path, base=RunSpec())
    assert {r.name: r.status for r in m.results} == dict.fromkeys(names, "PASS"), \
        [(r.name, r.reasons) for r in m.results]
    from drifttool.artifact.reader import open_run

    for name in names:
        run = open_run(tmp_path / "runs" / name)
        assert run.manifest["capture_level"] == "L1" and run.manifest["kind"] == "recompute"
        assert run.manifest.get("lora"), name  # the adapter is what trains
