"""The weight digest of a checkpoint streamed onto a GPU, with and without a LoRA adapter loaded
with it (``load_checkpoint(lora=)``): the CPU's bytes and digest, and no weight read back from the
GPU to compute it; skipped without a GPU. Run on the GPU machine with ``python -m pytest
tests/gpu``."""

from __future__ import annotations

import pytest
import torch

import drifttool.model.checkpoint_stream as stream
from drifttool.model.checkpoint import load_checkpoint, save_checkpoint
from drifttool.model.lora_io import effective_weights, fingerprinted, load_lora
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.model import weights
from drifttool.model.weights import weight_digest
from tests.model.test_weight_digest_streaming import SMALL, _adapter, pinned, rehashed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _same_parameters(gpu, cpu) -> None:
    params = dict(cpu.named_parameters())
    assert list(dict(gpu.named_parameters())) == list(params)
    for n, p in gpu.named_parameters():  # used at once, on the current stream: bit for bit
        assert p.device.type == "cuda" and p.dtype == params[n].dtype, n
        assert p.requires_grad == params[n].requires_grad, n
        assert torch.equal(p.detach().reshape(-1).view(torch.uint8),
                           params[n].detach().to("cuda").reshape(-1).view(torch.uint8)), n


def _no_readback(monkeypatch) -> list:
    """The GPU tensors ``weight_digest`` copies back to the host from now on (``_Readback.hash``,
    the only way it reads a GPU tensor)."""
    calls = []
    real = weights._Readback.hash
    monkeypatch.setattr(weights._Readback, "hash", lambda self, t, d: calls.append(t.shape) or real(self, t, d))
    return calls


@pytest.mark.parametrize("stored, dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
def test_gpu_load_streams_the_cpu_bytes_and_digest(tmp_path, monkeypatch, stored, dtype):
    """Onto a GPU through pinned stages (small chunks, so every stage is reused many times):
    the same bytes and the same digest as loading onto the CPU, and the digest reads nothing
    back from the GPU."""
    src = random_init_(MMDiT(SMALL, dtype=stored), seed=11)
    folder = save_checkpoint(src, tmp_path / "ck", max_shard_bytes=40_000)
    cpu = load_checkpoint(folder, dtype=dtype)
    monkeypatch.setattr(stream, "CHUNK_BYTES", 4096)
    gpu = load_checkpoint(folder, dtype=dtype, device="cuda")
    _same_parameters(gpu, cpu)
    assert pinned(gpu)
    calls = _no_readback(monkeypatch)
    assert weight_digest(gpu) == weight_digest(cpu) and calls == []
    assert rehashed(gpu) == weight_digest(cpu) and calls  # the fallback does read back


@pytest.mark.parametrize("mode", ["merged", "fused", "unfused", "unfused-fp32"])
def test_an_adapter_loaded_with_the_weights_onto_a_gpu(tmp_path, monkeypatch, mode):
    """``load_checkpoint(lora=, device="cuda")``: the CPU load's parameters (factors included) and
    digest, pinned, so the fingerprint's digest reads nothing back from the GPU and equals the one
    of a plain load followed by ``load_lora`` (a fused adapter's effective weights excepted: those
    are computed on the GPU, then hashed)."""
    base, adapter = _adapter(tmp_path)
    cpu = load_checkpoint(base, dtype=torch.bfloat16, lora=adapter, lora_mode=mode)
    old = load_checkpoint(base, dtype=torch.bfloat16, device="cuda")
    load_lora(old, adapter, mode=mode)
    want = weight_digest(effective_weights(old) if mode == "fused" else old)
    monkeypatch.setattr(stream, "CHUNK_BYTES", 4096)
    gpu = load_checkpoint(base, dtype=torch.bfloat16, device="cuda", lora=adapter, lora_mode=mode)
    _same_parameters(gpu, cpu)
    assert pinned(gpu)
    calls = _no_readback(monkeypatch)
    assert weight_digest(gpu) == weight_digest(cpu) and calls == []
    assert weight_digest(fingerprinted(gpu)) == want
    assert (calls == []) is (mode != "fused")
    assert rehashed(gpu) == weight_digest(cpu) and calls  # the fallback does read back
