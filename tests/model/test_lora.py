"""LoRA adapters (drifttool.model.lora, lora_io): peft key naming, save/load, bad files, the
merge operator, frozen base weights and adapter gradients. Interchange with peft and diffusers:
test_lora_interchange.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.errors import CheckpointError
from drifttool.model.config import tiny
from drifttool.model.weights import weight_digest
from drifttool.model.lora import LORA_TARGET_MODULES, add_lora, base_parameters, lora_parameters
from drifttool.model.lora_io import load_lora, lora_record, save_lora
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes

# Adapter factors that cannot reach the image output: in the last block the text stream's
# output (to_add_out, txt_mlp) is never used, and its text queries (add_q_proj) only feed text
# rows. Their gradients are None (not in the graph) or exactly zero (add_q_proj).
DEAD_IN_LAST_BLOCK = ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2", "attn.add_q_proj")


def _model(dtype=torch.bfloat16, seed=3):
    return random_init_(MMDiT(tiny(), dtype=dtype), seed=seed)


def _inputs(dtype, B=2, grid=(2, 3), L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, grid[0] * grid[1], 64, generator=g).to(dtype)
    txt = torch.randn(B, L, 32, generator=g).to(dtype)
    mask = torch.arange(L)[None, :] < torch.tensor([L, L - 2][:B] + [L] * max(0, B - 2))[:, None]
    tau = torch.tensor([0.9, 0.4, 0.7][:B])
    return x, txt, mask, tau, grid


def test_peft_key_naming():
    m = _model()
    params = add_lora(m, rank=4, alpha=8)
    assert len(params) == 2 * len(LORA_TARGET_MODULES) * tiny().num_layers
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in params
    assert "transformer_blocks.1.attn.to_out.0.lora_B.weight" in params
    assert "transformer_blocks.0.img_mlp.net.0.proj.lora_A.weight" in params
    assert "transformer_blocks.1.txt_mlp.net.2.lora_B.weight" in params
    assert params["transformer_blocks.0.attn.to_q.lora_A.weight"].shape == (4, 32)
    assert params["transformer_blocks.0.img_mlp.net.0.proj.lora_B.weight"].shape == (128, 4)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params.values())
    assert not any(p.requires_grad for p in base_parameters(m).values())


def test_keys_match_peft_on_diffusers():
    """The same names peft gives a diffusers QwenImageTransformer2DModel (``add_adapter``)."""
    pytest.importorskip("peft")
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    cfg = {k: v for k, v in tiny().to_diffusers_config().items() if not k.startswith("_")}
    ref = QwenImageTransformer2DModel(**cfg)
    ref.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGET_MODULES)))
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(ref).items()}
    m = _model()
    add_lora(m, rank=4, alpha=8)
    assert {k: tuple(v.shape) for k, v in lora_parameters(m).items()} == want


def test_save_load_roundtrip(tmp_path):
    m = _model()
    add_lora(m, rank=2, alpha=3, seed=5, init_b_std=0.1)
    save_lora(m, tmp_path / "ad")
    conf = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 2 and conf["lora_alpha"] == 3
    assert sorted(conf["target_modules"]) == sorted(LORA_TARGET_MODULES)
    other = _model()
    load_lora(other, tmp_path / "ad")
    assert weight_digest(other) == weight_digest(m)
    assert lora_record(other) == lora_record(m)


def test_bad_lora_files_are_refused(tmp_path):
    m = _model()
    add_lora(m, rank=2, alpha=2, init_b_std=0.1)
    save_lora(m, tmp_path / "ok")
    sd = load_file(str(tmp_path / "ok" / "adapter_model.safetensors"))
    cases = {
        "missing": {k: v for k, v in sd.items() if "blocks.1.attn.to_q" not in k},
        "unexpected": {**sd, "transformer_blocks.0.attn.norm_q.lora_A.weight": torch.zeros(2, 16)},
        "mis-shaped": {**sd, "transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 31)},
        "non-finite": {**sd, "transformer_blocks.0.attn.to_q.lora_B.weight": torch.full((32, 2), float("nan"))},
    }
    for word, tensors in cases.items():
        folder = tmp_path / word.replace(" ", "")
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text((tmp_path / "ok" / "adapter_config.json").read_text())
        fresh = _model()
        with pytest.raises(CheckpointError, match=word):
            load_lora(fresh, folder)
        assert not lora_parameters(fresh)  # nothing half-attached
    save_file({"foo.weight": torch.zeros(2, 2)}, str(tmp_path / "alien.safetensors"))
    with pytest.raises(CheckpointError, match="no key names a LoRA.*its 1 keys: foo.weight$"):
        load_lora(_model(), tmp_path / "alien.safetensors")
    save_file({f"k{i}": torch.zeros(2) for i in range(7)}, str(tmp_path / "seven.safetensors"))
    with pytest.raises(CheckpointError, match="its 7 keys: k0, k1, k2, k3, …$"):  # cut short, and says so
        load_lora(_model(), tmp_path / "seven.safetensors")
    with pytest.raises(CheckpointError, match="nowhere: no such file or folder; --lora takes"):
        load_lora(_model(), tmp_path / "nowhere")


def test_adapter_paths_are_read_or_refused_by_name(tmp_path):
    """``read_adapter`` (every loader: run, replay and recompute of a stored adapter, experiment)
    reads a peft folder, its weights file as the folder, or a diffusers file, and refuses what is
    no adapter in one line naming the path: a peft config file (its folder named), a folder
    without adapter files, a file that is no .safetensors, before any file is parsed."""
    from drifttool.model.lora_formats import read_adapter
    from drifttool.model.lora_paths import adapter_location

    m = _model()
    add_lora(m, rank=2, alpha=2, init_b_std=0.1)
    ad = save_lora(m, tmp_path / "ad")
    assert adapter_location(ad / "adapter_model.safetensors") == ad
    file = ad / "pytorch_lora_weights.safetensors"
    assert adapter_location(file) == file and adapter_location(ad) == ad
    want, _ = read_adapter(ad)
    got, _ = read_adapter(ad / "adapter_model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text((ad / "adapter_config.json").read_text())
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    for path, why in ((ad / "adapter_config.json", f"the config file of a peft adapter, not the adapter: pass its folder {ad};"),
                      (tmp_path / "half", "a folder with adapter_config.json but no adapter_model.safetensors;"),
                      (tmp_path / "empty", "a folder without adapter files"),
                      (tmp_path / "weights.bin", "not a .safetensors file;")):
        with pytest.raises(CheckpointError) as e:
            read_adapter(path)
        assert str(e.value).startswith(f"LoRA adapter {path}: {why}") and "--lora takes" in str(e.value), e.value
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_zero_b_adapter_is_byte_identical_to_base(mode):
    """peft's init (B = 0): W' = W, so every output byte equals the base model's."""
    base, adapted = _model(), _model()
    add_lora(adapted, rank=4, alpha=8)
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    with torch.no_grad():
        assert_same_bytes(adapted(x, txt, mask, tau, grid, Runtime(mode=mode)),
                          base(x, txt, mask, tau, grid, Runtime(mode=mode)), f"{mode} v")


def test_adapter_goes_through_the_merge_operator():
    m = _model()
    add_lora(m, rank=2, alpha=2, init_b_std=0.05)
    rt = Runtime(mode="strict")
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    with torch.no_grad():
        m(x, txt, mask, tau, grid, rt)
    merges = [r for r in rt.trace.rows() if r["op"] == "lora_merge"]
    assert {(r["block"], r["stream"]) for r in merges} == {(b, s) for b in (0, 1) for s in ("img", "txt")}
    assert sum(r["calls"] for r in merges) == len(LORA_TARGET_MODULES) * 2
    assert all(r["contract"] == "drifttool.lora_merge.v1" and r["actual"] == "strict" for r in merges)


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_frozen_base_and_finite_nonzero_adapter_grads(mode):
    m = _model()
    add_lora(m, rank=4, alpha=8, init_b_std=0.05)
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    v = m(x, txt, mask, tau, grid, Runtime(mode=mode))
    (v.float() ** 2).mean().backward()
    assert all(p.grad is None for p in base_parameters(m).values())
    dead = [f"transformer_blocks.1.{t}." for t in DEAD_IN_LAST_BLOCK]
    for name, p in lora_parameters(m).items():
        if any(name.startswith(d) for d in dead):
            assert p.grad is None or not bool(p.grad.any()), name
            continue
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert bool(torch.isfinite(p.grad).all()) and bool(p.grad.any()), name


def test_bad_config():
    with pytest.raises(CheckpointError, match="unknown targets"):
        add_lora(_model(), rank=2, alpha=2, targets=["attn.norm_q"])
    with pytest.raises(CheckpointError, match="rank must be >= 1, got 0"):
        add_lora(_model(), rank=0, alpha=2)
    with pytest.raises(CheckpointError, match="alpha must be a finite number, got nan"):
        add_lora(_model(), rank=2, alpha=float("nan"))
    m = _model()
    add_lora(m, rank=2, alpha=2)
    with pytest.raises(CheckpointError, match="already"):
        add_lora(m, rank=2, alpha=2)
