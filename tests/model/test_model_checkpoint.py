"""Checkpoint mapper: full-size weight map vs diffusers, load errors, shards, save, digest."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.checkpoint import load_checkpoint, save_checkpoint, weight_map
from drifttool.model.checkpoint_files import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from drifttool.model.config import full, tiny
from drifttool.model.lora import LORA_TARGET_MODULES
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.model.weights import weight_digest

SMALL = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
)


def test_full_size_map_matches_diffusers_on_meta():
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        ref = QwenImageTransformer2DModel()
        ours = MMDiT(full(), dtype=torch.bfloat16)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert len(ref_shapes) == 1933
    assert our_shapes == ref_shapes
    wmap = weight_map(full())
    assert len(wmap) == 1933 and sorted(wmap) == sorted(ref_shapes) and all(k == v for k, v in wmap.items())
    assert sum(v.numel() for v in ours.parameters()) == 20_430_401_088
    # LoRA targets name real Linear modules in every block
    block_modules = dict(ours.transformer_blocks[0].named_modules())
    assert all(t in block_modules and hasattr(block_modules[t], "bias") for t in LORA_TARGET_MODULES)


def test_loads_diffusers_checkpoint_by_name(diffusers_folder):
    ref, folder = diffusers_folder(**SMALL)
    model = load_checkpoint(folder)
    assert model.dtype == torch.float32 and model.config == tiny()
    sd = ref.state_dict()
    for k, p in model.named_parameters():
        assert torch.equal(p, sd[k]), k
    assert weight_digest(model) == weight_digest(dict(sd))
    bf = load_checkpoint(folder, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf.parameters())


def test_sharded_index_loads(diffusers_folder, tmp_path):
    ref, folder = diffusers_folder(max_shard_size="40KB", **SMALL)
    assert (folder / WEIGHTS_INDEX_NAME).is_file() and not (folder / WEIGHTS_NAME).exists()
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert weight_digest(load_checkpoint(folder)) == weight_digest(dict(ref.state_dict()))
    # our own sharded writer round-trips too
    model = load_checkpoint(folder)
    out = save_checkpoint(model, tmp_path / "ours", max_shard_bytes=30_000)
    assert len(list(out.glob("*.safetensors"))) > 2
    assert weight_digest(load_checkpoint(out)) == weight_digest(model)


def test_save_checkpoint_is_diffusers_readable(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    model = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=3)
    folder = save_checkpoint(model, tmp_path / "tiny")
    assert json.loads((folder / "config.json").read_text())["_class_name"] == "QwenImageTransformer2DModel"
    ref = QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    assert weight_digest(dict(ref.state_dict())) == weight_digest(model)
    assert weight_digest(load_checkpoint(folder)) == weight_digest(model)


def _corrupt(folder, edit):
    path = folder / WEIGHTS_NAME
    sd = load_file(str(path))
    edit(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


def test_missing_unexpected_misshaped_in_one_error(diffusers_folder):
    _, folder = diffusers_folder(**SMALL)

    def edit(sd):
        sd["transformer_blocks.0.attn.to_qq.weight"] = sd.pop("transformer_blocks.0.attn.to_q.weight")  # wrong key
        del sd["proj_out.bias"]  # missing
        sd["img_in.weight"] = sd["img_in.weight"][:, :32].contiguous()  # wrong shape

    _corrupt(folder, edit)
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(folder)
    msg = str(ei.value)
    for needle in (
        "missing keys (2)",
        "transformer_blocks.0.attn.to_q.weight",
        "proj_out.bias",
        "unexpected keys (1): transformer_blocks.0.attn.to_qq.weight",
        "mis-shaped keys (1): img_in.weight: checkpoint (32, 32) vs model (32, 64)",
    ):
        assert needle in msg, msg


def test_file_level_errors(diffusers_folder, tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nope")
    _, folder = diffusers_folder(**SMALL)
    (folder / WEIGHTS_NAME).rename(folder / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle weights are never loaded; convert it once to safetensors"):
        load_checkpoint(folder)
    _, folder = diffusers_folder(max_shard_size="40KB", **SMALL)
    next(folder.glob("*-00001-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard file"):
        load_checkpoint(folder)


def test_unsupported_config_refused(diffusers_folder):
    _, folder = diffusers_folder(**SMALL)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "zero_cond_t": True}))
    with pytest.raises(UnsupportedConfigError, match="zero_cond_t"):
        load_checkpoint(folder)


def test_mixed_dtypes_need_explicit_dtype(diffusers_folder):
    _, folder = diffusers_folder(**SMALL)
    _corrupt(folder, lambda sd: sd.__setitem__("txt_norm.weight", sd["txt_norm.weight"].bfloat16()))
    with pytest.raises(CheckpointError, match="mixed dtypes"):
        load_checkpoint(folder)
    assert load_checkpoint(folder, dtype=torch.float32).dtype == torch.float32


def test_weight_digest_sensitivity():
    a = random_init_(MMDiT(tiny()), seed=1)
    b = random_init_(MMDiT(tiny()), seed=1)
    assert weight_digest(a) == weight_digest(b)
    assert weight_digest(random_init_(MMDiT(tiny()), seed=2)) != weight_digest(a)
    with torch.no_grad():
        w = b.transformer_blocks[1].txt_mlp.net["2"].bias
        w.view(torch.int32)[3] ^= 1  # flip one bit
    assert weight_digest(a) != weight_digest(b)
    # same seed in bf16 = the fp32 draw rounded
    c = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=1)
    assert weight_digest(c) == weight_digest({k: v.bfloat16() for k, v in a.named_parameters()})
    assert weight_digest(c).startswith("xxh3_128:")


def _refuse_tensor_reads(monkeypatch):
    import drifttool.model.checkpoint as ck

    def no_reads(*args, **kwargs):
        raise AssertionError("tensors were read before the config was checked against the headers")

    monkeypatch.setattr(ck, "stream_tensors", no_reads)
    monkeypatch.setattr(ck, "locate_tensors", no_reads)


@pytest.mark.parametrize("edit, needle", [
    ({"num_layers": 10**9}, "num_layers=1000000000 but the weights hold 2 block(s)"),
    ({"num_layers": 1}, "num_layers=1 but the weights hold 2 block(s)"),
    ({"num_attention_heads": 2**40, "attention_head_dim": 2**20, "axes_dims_rope": [2**18, 2**18, 2**19]},
     "mis-shaped keys (75)"),
    ({"joint_attention_dim": 3 * 10**12}, "txt_norm.weight: checkpoint (32,) vs model (3000000000000,)"),
])
def test_config_checked_against_headers_before_any_read(diffusers_folder, monkeypatch, edit, needle):
    _, folder = diffusers_folder(**SMALL)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    _refuse_tensor_reads(monkeypatch)
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(folder)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_index_shards_stay_in_the_folder(diffusers_folder):
    _, folder = diffusers_folder(max_shard_size="40KB", **SMALL)
    index = json.loads((folder / WEIGHTS_INDEX_NAME).read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere.safetensors"
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard names must be file names"):
        load_checkpoint(folder)


def test_oversized_config_refused_unparsed(diffusers_folder):
    _, folder = diffusers_folder(**SMALL)
    (folder / "config.json").write_text(" " * (17 * 2**20) + "{}")
    with pytest.raises(CheckpointError, match="larger than any checkpoint JSON"):
        load_checkpoint(folder)


def test_variant_and_pipeline_folder(diffusers_folder, tmp_path):
    ref, folder = diffusers_folder(**SMALL)
    pipe = tmp_path / "pipe"
    ref.save_pretrained(pipe / "transformer", variant="fp16")
    (pipe / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "QwenImageTransformer2DModel"]}))
    want = weight_digest(load_checkpoint(folder))
    assert weight_digest(load_checkpoint(pipe, variant="fp16")) == want
    assert weight_digest(load_checkpoint(pipe / "transformer", variant="fp16")) == want
    with pytest.raises(CheckpointError, match=r"found weight variant\(s\) \['fp16'\]"):
        load_checkpoint(pipe)
    with pytest.raises(UnsupportedConfigError, match="plain name"):
        load_checkpoint(pipe, variant="fp16/../x")
