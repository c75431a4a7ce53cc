"""The streaming checkpoint loader: tensor by tensor from the memory-mapped shards to the target
device and dtype. It gives the stored weights bit for bit (cast as ``Tensor.to`` casts), and a
fresh process loading a sharded bf16 checkpoint of a few hundred MB peaks at no more than 1.2×
the weights in host memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.model.checkpoint import load_checkpoint, save_checkpoint, tensor_shapes, weight_map
from drifttool.model.checkpoint_files import CONFIG_NAME, WEIGHTS_INDEX_NAME
from drifttool.model.config import MMDiTConfig
from drifttool.model.mmdit import MMDiT, random_init_
from tests.conftest import assert_same_bytes

SMALL = MMDiTConfig(num_layers=3, attention_head_dim=16, num_attention_heads=3,
                    joint_attention_dim=40, axes_dims_rope=(4, 6, 6))


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_streaming_load_gives_the_stored_weights(tmp_path, src_dtype, dtype):
    model = random_init_(MMDiT(SMALL, dtype=src_dtype), seed=7)
    folder = save_checkpoint(model, tmp_path / "ck", max_shard_bytes=60_000)
    assert (folder / WEIGHTS_INDEX_NAME).is_file() and len(list(folder.glob("*.safetensors"))) > 3
    stored = _stored(folder)
    loaded = load_checkpoint(folder, dtype=dtype, device="cpu")
    want = dtype or src_dtype
    assert loaded.dtype == want
    params = dict(loaded.named_parameters())
    assert set(params) == set(weight_map(SMALL).values()) == set(stored)
    for ck, name in weight_map(SMALL).items():
        p = params[name]
        assert p.device.type == "cpu" and p.is_contiguous() and p.requires_grad
        assert_same_bytes(p.detach(), stored[ck].to(want), name)


def test_loaded_parameters_own_their_memory(tmp_path):
    """Each parameter is a copy, not a view of the file's mapping: rewriting the checkpoint
    afterwards does not change the loaded model."""
    model = random_init_(MMDiT(SMALL), seed=3)
    folder = save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(folder)
    before = {n: p.detach().clone() for n, p in loaded.named_parameters()}
    other = random_init_(MMDiT(SMALL), seed=4)
    save_checkpoint(other, folder)
    for n, p in loaded.named_parameters():
        assert_same_bytes(p.detach(), before[n], n)
    with torch.no_grad():  # and they are writable, as a trainer needs
        next(loaded.parameters()).add_(1)


def test_non_float_tensors_refused_from_the_headers(tmp_path):
    model = random_init_(MMDiT(SMALL), seed=1)
    folder = save_checkpoint(model, tmp_path / "ck")
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    sd["txt_norm.weight"] = sd["txt_norm.weight"].to(torch.int32)
    save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"))
    from drifttool.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"non-float tensors \(1\): txt_norm.weight: I32"):
        load_checkpoint(folder, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# peak host memory, measured in a fresh process

WIDE = MMDiTConfig(num_layers=8, attention_head_dim=64, num_attention_heads=12,
                   joint_attention_dim=1024, axes_dims_rope=(16, 24, 24))
"""≈ 180 M parameters, ≈ 360 MB in bf16 over 4 shards."""

_CHILD = textwrap.dedent("""
    import json, sys, torch
    import drifttool.model.checkpoint as ck

    def status_kib(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

    torch.ones(1).add_(1)  # allocator and kernels warmed up before the baseline
    base = status_kib("VmRSS")
    model = ck.load_checkpoint(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
    for p in model.parameters():  # read every byte: weights still backed by the file count too
        torch.count_nonzero(p.detach())
    # the peak RSS of this process image: VmHWM, which getrusage's ru_maxrss equals here except
    # that Linux carries ru_maxrss over from the parent across fork + exec (a big pytest worker)
    peak = status_kib("VmHWM")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"increase": (peak - base) * 1024, "weights": nbytes}))
""")


def _write_random_checkpoint(folder: Path, config: MMDiTConfig, shards: int) -> int:
    """A sharded bf16 diffusers-format checkpoint of random N(0, 0.02²) weights; returns its
    tensor bytes."""
    folder.mkdir(parents=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config.to_diffusers_config()))
    shapes = list(tensor_shapes(config).items())
    gen = torch.Generator().manual_seed(0)
    per = -(-len(shapes) // shards)
    index, total = {}, 0
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
                for k, s in shapes[i * per:(i + 1) * per]}
        total += sum(t.numel() * 2 for t in part.values())
        save_file(part, str(folder / name), metadata={"format": "pt"})
        index.update({k: name for k in part})
        del part
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                         "weight_map": index}))
    return total


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("dtype, factor", [("bfloat16", 1), ("float32", 2)])
def test_peak_host_memory_at_most_1_2x_the_weights(tmp_path_factory, dtype, factor):
    folder = tmp_path_factory.getbasetemp() / "wide-bf16"
    if not folder.exists():
        _write_random_checkpoint(folder, WIDE, shards=4)
    res = subprocess.run([sys.executable, "-c", _CHILD, str(folder), dtype],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout.strip().splitlines()[-1])
    stored = sum(int(f.stat().st_size) for f in folder.glob("*.safetensors"))
    assert r["weights"] >= factor * stored * 0.99  # the model holds every stored weight
    assert r["weights"] >= 300e6 * factor  # "a few hundred MB" of bf16 weights
    assert r["increase"] <= 1.2 * r["weights"], (
        f"peak RSS increase {r['increase'] / 1e6:.0f} MB > 1.2 × weights {r['weights'] / 1e6:.0f} MB")
