"""The weight digest computed while a checkpoint streams in equals ``weight_digest`` of the
loaded parameters (hashed again from the tensors themselves) for every way a checkpoint loads:
the embedded fixture, bf16 as stored, fp32 and fp16 cast to bf16 on load, a sharded index, a
weight variant, chunked reads, on the CPU (a GPU's: ``tests/gpu/test_weight_digest_cuda.py``); it is pinned to the model only while the parameters stay as
loaded (an attached LoRA adapter, an in-place write or a replaced parameter falls back to hashing
them), and the pinned path reads no weight back.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import drifttool.model.checkpoint_stream as stream
from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint, save_checkpoint
from drifttool.model.checkpoint_files import WEIGHTS_INDEX_NAME
from drifttool.model.config import MMDiTConfig
from drifttool.errors import CheckpointError
from drifttool.model.lora import add_lora, lora_parameters
from drifttool.model.lora_io import effective_weights, fingerprinted, load_lora, save_lora
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.model.weights import StreamingDigest, weight_digest

SMALL = MMDiTConfig(num_layers=3, attention_head_dim=16, num_attention_heads=3,
                    joint_attention_dim=40, axes_dims_rope=(4, 6, 6))


def rehashed(model: torch.nn.Module) -> str:
    """``weight_digest`` of the parameters as tensors: never the digest pinned at load."""
    return weight_digest(dict(model.named_parameters()))


def pinned(model: torch.nn.Module) -> bool:
    from drifttool.model.weights import _pinned_digest

    return _pinned_digest(model) is not None


def test_embedded_fixture_digest_is_the_expected_runs():
    fx = load_fixture("tiny-t2i")
    manifest = json.loads((fx.expected_dir / "manifest.json").read_text())
    model = load_checkpoint(fx.model_dir, dtype=getattr(torch, manifest["settings"]["dtype"]))
    assert pinned(model)
    assert weight_digest(model) == rehashed(model) == manifest["fingerprint"]["weights"]
    fp32 = load_checkpoint(fx.model_dir, dtype=torch.float32)
    assert weight_digest(fp32) == rehashed(fp32) != weight_digest(model)


@pytest.mark.parametrize("stored, dtype", [
    (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16), (torch.float32, None), (torch.bfloat16, torch.float32),
], ids=["bf16", "bf16-as-bf16", "fp32-to-bf16", "fp16-to-bf16", "fp32", "bf16-to-fp32"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_streaming_digest_equals_the_parameters(tmp_path, stored, dtype, sharded):
    src = random_init_(MMDiT(SMALL), seed=5)
    folder = save_checkpoint(src, tmp_path / "ck", max_shard_bytes=40_000 if sharded else None)
    assert (folder / WEIGHTS_INDEX_NAME).is_file() == sharded
    for f in folder.glob("*.safetensors"):  # stored in ``stored`` (fp16: no MMDiT dtype)
        save_file({k: t.to(stored) for k, t in load_file(str(f)).items()}, str(f))
    model = load_checkpoint(folder, dtype=dtype)
    assert pinned(model) and model.dtype == (dtype or stored)
    assert weight_digest(model) == rehashed(model)
    want = {n: p.detach().to(stored).to(dtype or stored) for n, p in src.named_parameters()}
    assert weight_digest(model) == weight_digest(want)


def test_variant_and_chunked_reads(tmp_path, monkeypatch):
    """Tensors larger than a chunk arrive in pieces (read, and cast, chunk by chunk)."""
    src = random_init_(MMDiT(SMALL, dtype=torch.float32), seed=6)
    folder = tmp_path / "ck"
    save_checkpoint(src, folder, max_shard_bytes=50_000)
    def fp16(name: str) -> str:  # diffusers' variant file name: a.b.json → a.b.fp16.json
        head, _, ext = name.rpartition(".")
        return f"{head}.fp16.{ext}"

    for f in folder.glob("*.safetensors"):  # the same folder as an fp16 variant
        save_file({k: t.half() for k, t in load_file(str(f)).items()}, str(folder / fp16(f.name)))
        f.unlink()
    index = folder / WEIGHTS_INDEX_NAME
    wm = json.loads(index.read_text())
    wm["weight_map"] = {k: fp16(v) for k, v in wm["weight_map"].items()}
    (folder / fp16(index.name)).write_text(json.dumps(wm))
    index.unlink()
    whole = load_checkpoint(folder, dtype=torch.bfloat16, variant="fp16")
    monkeypatch.setattr(stream, "CHUNK_BYTES", 1000)
    for dtype in (torch.bfloat16, torch.float32):
        model = load_checkpoint(folder, dtype=dtype, variant="fp16")
        assert pinned(model) and weight_digest(model) == rehashed(model)
    assert weight_digest(load_checkpoint(folder, dtype=torch.bfloat16, variant="fp16")) == weight_digest(whole)


def test_lora_falls_back_to_hashing_the_weights(tmp_path):
    base = save_checkpoint(random_init_(MMDiT(SMALL), seed=7), tmp_path / "base")
    donor = load_checkpoint(base)
    add_lora(donor, rank=2, alpha=4.0, seed=1, init_b_std=0.05)
    adapter = save_lora(donor, tmp_path / "adapter")
    for mode in ("merged", "fused", "unfused"):
        model = load_checkpoint(base, dtype=torch.bfloat16)
        plain = weight_digest(model)
        load_lora(model, adapter, mode=mode)
        assert not pinned(model)  # the adapter's parameters were never streamed
        assert weight_digest(model) == rehashed(model) != plain
        eff = effective_weights(model)  # what a LoRA run's fingerprint hashes
        assert weight_digest(eff) == rehashed(model) if mode != "fused" else weight_digest(eff) != plain


def _adapter(tmp_path, seed=7, **kw):
    base = save_checkpoint(random_init_(MMDiT(SMALL), seed=seed), tmp_path / "base")
    donor = load_checkpoint(base)
    add_lora(donor, rank=2, alpha=4.0, seed=1, init_b_std=0.05, **kw)
    return base, save_lora(donor, tmp_path / "adapter")


@pytest.mark.parametrize("mode", ["merged", "fused", "unfused", "unfused-fp32"])
def test_an_adapter_loaded_with_the_weights_is_in_the_pinned_digest(tmp_path, mode):
    """``load_checkpoint(lora=)`` hashes the adapter's factors in their sorted places while the
    weights stream: the pinned digest is the adapted model's parameters' (equal to hashing them
    again), the parameters and their ``requires_grad`` are those ``load_lora`` after a plain load
    gives, and the fingerprint's digest (``fingerprinted``) is the old path's, for every mode."""
    base, adapter = _adapter(tmp_path)
    model = load_checkpoint(base, dtype=torch.bfloat16, lora=adapter, lora_mode=mode)
    old = load_checkpoint(base, dtype=torch.bfloat16)
    load_lora(old, adapter, mode=mode)
    assert pinned(model) and weight_digest(model) == rehashed(model) == rehashed(old)
    got, want = dict(model.named_parameters()), dict(old.named_parameters())
    assert list(got) == list(want)
    for n, p in want.items():
        assert got[n].dtype == p.dtype and got[n].requires_grad == p.requires_grad, n
        assert torch.equal(got[n].detach().reshape(-1).view(torch.uint8), p.detach().reshape(-1).view(torch.uint8)), n
    assert weight_digest(fingerprinted(model)) == weight_digest(effective_weights(old) if mode == "fused" else old)
    assert weight_digest(fingerprinted(model)) != weight_digest(load_checkpoint(base, dtype=torch.bfloat16))
    with torch.no_grad():
        next(iter(lora_parameters(model).values())).mul_(2)  # a trained factor: hashed again
    assert not pinned(model) and weight_digest(model) == rehashed(model) != rehashed(old)


def test_an_adapter_that_does_not_fit_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    """A mismatched adapter fails ``load_checkpoint(lora=)`` with ``load_lora``'s error, before
    the checkpoint's tensors are streamed."""
    base, _ = _adapter(tmp_path)
    other = random_init_(MMDiT(MMDiTConfig(num_layers=2, attention_head_dim=16, num_attention_heads=3,
                                           joint_attention_dim=40, axes_dims_rope=(4, 6, 6))), seed=3)
    add_lora(other, rank=2, alpha=4.0, init_b_std=0.05)  # two blocks' keys for a three-block model
    wrong = save_lora(other, tmp_path / "wrong")
    import drifttool.model.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "stream_tensors", lambda *a, **kw: pytest.fail("streamed"))
    with pytest.raises(CheckpointError, match="does not match the model"):
        load_checkpoint(base, lora=wrong)


def test_extra_tensors_are_hashed_in_their_sorted_places():
    """A digest fed ``b`` and ``d`` with ``a``, ``c`` and ``e`` given as extras equals the digest
    of all five fed in order; a name both streamed and extra, and a GPU or strided extra, are
    refused."""
    t = {n: torch.arange(i + 3, dtype=torch.float32) for i, n in enumerate("abcde")}
    with StreamingDigest() as d:
        for n in "abcde":
            d.begin(n, t[n].dtype, tuple(t[n].shape))
            d.update(t[n].numpy())
        want = d.digest()
    with StreamingDigest(extra={n: t[n] for n in "ace"}) as d:
        for n in "bd":
            d.begin(n, t[n].dtype, tuple(t[n].shape))
            d.update(t[n].numpy())
        assert d.digest() == want
    with StreamingDigest(extra={"b": t["b"]}) as d, pytest.raises(ValueError, match="both streamed"):
        d.begin("b", torch.float32, (4,))
    with pytest.raises(ValueError, match="contiguous CPU"):
        StreamingDigest(extra={"a": torch.zeros(4, 4).t()})


def test_changed_parameters_are_hashed_again(tmp_path):
    folder = save_checkpoint(random_init_(MMDiT(SMALL), seed=8), tmp_path / "ck")
    model = load_checkpoint(folder)
    before = weight_digest(model)
    with torch.no_grad():
        model.img_in.bias.add_(1)  # an in-place write bumps the version counter
    assert not pinned(model) and weight_digest(model) == rehashed(model) != before
    model = load_checkpoint(folder)
    model.img_in.bias = torch.nn.Parameter(model.img_in.bias.detach().clone())  # same bytes
    assert not pinned(model) and weight_digest(model) == before
    model = load_checkpoint(folder)
    model.load_state_dict(load_checkpoint(folder).state_dict())  # copy_ into every parameter
    assert not pinned(model) and weight_digest(model) == before


def test_pinned_digest_reads_no_weight_back(tmp_path, monkeypatch):
    """The digest of a freshly loaded model copies nothing to the host: no ``Tensor.to`` or
    ``Tensor.cpu`` call (the fallback makes one per parameter, which the counter sees)."""
    folder = save_checkpoint(random_init_(MMDiT(SMALL), seed=9), tmp_path / "ck")
    model = load_checkpoint(folder, dtype=torch.bfloat16)
    calls = []
    for method in ("to", "cpu"):
        real = getattr(torch.Tensor, method)

        def counted(self, *a, _real=real, _name=method, **kw):
            calls.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, method, counted)
    want = weight_digest(model)
    assert calls == []
    assert rehashed(model) == want and len(calls) == len(list(model.parameters()))


def test_streaming_digest_needs_sorted_names():
    with StreamingDigest() as d:
        d.begin("b", torch.float32, (1,))
        with pytest.raises(ValueError, match="sorted"):
            d.begin("a", torch.float32, (1,))
    with StreamingDigest() as d, pytest.raises(ValueError, match="before begin"):
        d.update(b"x")


def test_pin_refuses_a_model_of_other_parameters(tmp_path):
    model = random_init_(MMDiT(SMALL), seed=10)
    with StreamingDigest() as d:
        d.begin("img_in.bias", torch.float32, (SMALL.inner_dim,))
        d.update(model.img_in.bias.detach().numpy())
        d.pin(model)
    assert not pinned(model)


@pytest.mark.parametrize("stored,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                          (torch.float16, torch.float32)])
def test_read_ahead_yields_every_chunk_in_order_with_the_cast_bytes(tmp_path, monkeypatch, stored, dtype):
    """The GPU path's host side: chunks read ahead by several threads into reused buffers arrive
    in order, each the bytes of ``Tensor.to(dtype)`` of its slice (tensors of odd sizes, one of
    none, chunks smaller than most tensors)."""
    from contextlib import ExitStack

    from drifttool.model.checkpoint_files import locate_tensors

    g = torch.Generator().manual_seed(5)
    tensors = {f"t{i}": torch.randn(n, generator=g).to(stored) for i, n in enumerate((1, 0, 997, 4096, 3, 2500))}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(stream, "CHUNK_BYTES", 1024)
    plan = [(n, w, dtype) for n, w in sorted(locate_tensors([tmp_path / "w.safetensors"]).items())]
    buffers = [torch.empty(1024, dtype=torch.uint8) for _ in range(3)]
    reused = []
    got = {n: [] for n, _, _ in plan}
    with ExitStack() as stack:
        for i, e0, e1, k, host in stream.read_ahead(plan, stream._Files(stack), buffers, reused.append, readers=2):
            got[plan[i][0]].append((e0, e1, host.clone()))
    for name, t in tensors.items():
        want = t.to(dtype).reshape(-1)
        spans = [(e0, e1) for e0, e1, _ in got[name]]
        assert spans == list(stream._chunks(want.numel(), max(stored.itemsize, dtype.itemsize)))
        if spans:
            assert torch.equal(torch.cat([h for *_, h in got[name]]).view(torch.uint8), want.view(torch.uint8))
    assert reused[:3] == [0, 1, 2] and len(reused) == sum(len(v) for v in got.values())
