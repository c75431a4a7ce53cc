"""The adapter forms people train, against the real peft 0.21 and diffusers 0.42 (no mocks).

Adapters on the modulation (``img_mod.1``, ``txt_mod.1``), the embedders (``img_in``, ``txt_in``,
the timestep MLP), the final Linears (``norm_out.linear``, ``proj_out``), ``all-linear``, DoRA
and kohya ``.alpha`` files are made by the libraries themselves (peft ``get_peft_model`` +
``save_pretrained``, diffusers ``QwenImagePipeline.save_lora_weights``) on a tiny random
diffusers ``QwenImageTransformer2DModel``, loaded by the libraries the way each drifttool LoRA
mode reproduces (``tests/model/test_lora_modes.py``: ``theirs``), and the production forward
compared byte for byte in bf16 and fp32, as that file claims for the plain targets. Each adapter
has random non-zero factors and α/r ≠ 1, so a missing hook, a wrong scale or a wrong rounding
point fails.
"""

from __future__ import annotations

import json

import pytest
import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.config import tiny
from drifttool.model.lora import LORA_MODES, adaptable_modules, lora_modules
from drifttool.model.lora_formats import DIFFUSERS_WEIGHTS, read_adapter
from drifttool.model.lora_io import load_lora, save_lora
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes, bits
from tests.model.test_lora_modes import DTYPES, forward_ours, forward_theirs, ours, theirs

peft = pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")

NEW_TARGETS = ["img_mod.1", "txt_mod.1", "img_in", "txt_in", "time_text_embed.timestep_embedder.linear_1",
               "time_text_embed.timestep_embedder.linear_2", "norm_out.linear", "proj_out", "attn.to_q"]
FORMS = {
    "embedders_modulation_out": {"r": 4, "lora_alpha": 6.0, "target_modules": NEW_TARGETS},
    "all_linear_rslora": {"r": 4, "lora_alpha": 3.0, "target_modules": "all-linear", "use_rslora": True},
    "dora": {"r": 4, "lora_alpha": 6.0, "target_modules": NEW_TARGETS, "use_dora": True},
}
DORA_MODES = ("merged", "fused")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from tests.model.conftest import make_diffusers_transformer

    tmp = tmp_path_factory.mktemp("lora_forms")
    cfg = {k: v for k, v in tiny().to_diffusers_config().items() if not k.startswith("_")}
    make_diffusers_transformer(17, **cfg).save_pretrained(tmp / "base")
    return tmp / "base"


def _library_adapter(base, folder, config):
    """A folder holding the adapter as peft writes it (``save_pretrained``) and as diffusers'
    pipeline writes it (``save_lora_weights``), factors random, magnitudes perturbed."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(9)
    tr = QwenImageTransformer2DModel.from_pretrained(base, torch_dtype=torch.float32)
    model = get_peft_model(tr, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    sd = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(model).items()}
    meta = {k: v for k, v in json.loads((folder / "adapter_config.json").read_text()).items()}
    QwenImagePipeline.save_lora_weights(folder, transformer_lora_layers=sd, transformer_lora_adapter_metadata=meta)
    return folder


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forms")
    return {name: _library_adapter(base, tmp / name, cfg) for name, cfg in FORMS.items()}


def _modes(form):
    return DORA_MODES if form == "dora" else LORA_MODES


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form,mode", [(f, m) for f in FORMS for m in _modes(f)])
def test_form_is_byte_equal_to_the_library(base, adapters, form, mode, dtype):
    w = DTYPES[dtype]
    adapter = adapters[form]
    model = ours(base, adapter, w, mode)
    got = forward_ours(model, w)
    assert_same_bytes(got, forward_theirs(theirs(base, adapter, w, mode), w), f"{form} {mode} {dtype}")
    assert not torch.equal(bits(got), bits(forward_ours(load_checkpoint(base, dtype=w), w))), "adapter applied"


def test_every_linear_is_adaptable_and_all_linear_takes_them_all(base, adapters):
    """``all-linear`` adapts each Linear of the diffusers model, which are the MMDiT's
    ``adaptable_modules``; peft saved the expanded list, and a config saying ``all-linear``
    itself loads the same."""
    from diffusers import QwenImageTransformer2DModel

    tr = QwenImageTransformer2DModel.from_pretrained(base)
    linears = sorted(n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear))
    model = ours(base, adapters["all_linear_rslora"], torch.float32, "merged")
    assert sorted(adaptable_modules(model)) == linears == sorted(lora_modules(model))
    tensors, cfg = read_adapter(adapters["all_linear_rslora"])
    raw = json.loads((adapters["all_linear_rslora"] / "adapter_config.json").read_text())
    short = adapters["all_linear_rslora"].parent / "shorthand"
    short.mkdir()
    (short / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": "all-linear"}))
    (short / "adapter_model.safetensors").write_bytes(
        (adapters["all_linear_rslora"] / "adapter_model.safetensors").read_bytes())
    for mode in ("merged", "unfused-fp32"):  # the two modes that load through peft's own folder
        assert_same_bytes(forward_ours(ours(base, short, torch.bfloat16, mode), torch.bfloat16),
                          forward_theirs(theirs(base, short, torch.bfloat16, mode), torch.bfloat16), mode)


@pytest.mark.parametrize("mode", ["unfused", "unfused-fp32"])
def test_dora_refuses_unfused_modes_in_one_line(base, adapters, mode):
    with pytest.raises(UnsupportedConfigError, match=f"DoRA in LoRA mode '{mode}'") as e:
        ours(base, adapters["dora"], torch.float32, mode)
    assert "\n" not in str(e.value)


def test_dora_refuses_the_strict_family(base, adapters):
    model = ours(base, adapters["dora"], torch.float32, "merged")
    with pytest.raises(UnsupportedConfigError, match="DoRA adapters under the strict family"):
        forward_ours(model, torch.float32, Runtime(mode="strict"))


def test_new_targets_run_strict_merged(base, adapters):
    """The strict family merges the new targets too (FP32 W' into strict operators whose output
    stays in the model dtype): bf16 output, adapter applied."""
    model = ours(base, adapters["embedders_modulation_out"], torch.bfloat16, "merged")
    v = forward_ours(model, torch.bfloat16, Runtime(mode="strict"))
    plain = forward_ours(load_checkpoint(base, dtype=torch.bfloat16), torch.bfloat16, Runtime(mode="strict"))
    assert v.dtype == torch.bfloat16 and not torch.equal(bits(v), bits(plain))


# -- kohya .alpha files ---------------------------------------------------------------------------


def _kohya_file(adapter, path):
    """The adapter's factors renamed as kohya writes them (``lora_unet_<flat name>``,
    ``.lora_down`` / ``.lora_up``) with an ``.alpha`` per module: alternately 6 (scale 1.5) and
    1 (scale 0.25 < 0.5: diffusers splits it over both factors)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(adapter / "adapter_model.safetensors")
    out = {}
    for i, mod in enumerate(sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in sd})):
        flat = "lora_unet_" + mod.replace(".", "_")
        a, b = sd[f"base_model.model.{mod}.lora_A.weight"], sd[f"base_model.model.{mod}.lora_B.weight"]
        out[f"{flat}.lora_down.weight"], out[f"{flat}.lora_up.weight"] = a.bfloat16(), b.bfloat16()
        out[f"{flat}.alpha"] = torch.tensor(6.0 if i % 2 else 1.0)
    save_file(out, str(path))
    return path


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_kohya_alpha_file_loads_in_diffusers_and_matches(base, adapters, tmp_path, mode, dtype):
    w = DTYPES[dtype]
    path = _kohya_file(adapters["embedders_modulation_out"], tmp_path / "kohya.safetensors")
    tr = theirs(base, path, w, mode)  # pipeline.load_lora_weights: diffusers converts the file
    targets = tr.peft_config["default_0"].target_modules
    assert {"transformer_blocks.1.img_mod.1", "img_in", "proj_out"} <= set(targets), targets
    model = ours(base, path, w, mode)
    assert len(lora_modules(model)) == 3 * 2 + 6  # to_q, img_mod.1, txt_mod.1 per block + 6 others
    assert_same_bytes(forward_ours(model, w), forward_theirs(tr, w), f"kohya {mode} {dtype}")


def test_kohya_alpha_is_folded_as_diffusers_folds_it(adapters, tmp_path):
    """A module with alpha 1, r 4 (scale 0.25) gets A·0.5 and B·0.5; one with alpha 6 gets
    A·1.5 and B unchanged; the config then runs at scale 1."""
    from safetensors.torch import load_file

    path = _kohya_file(adapters["embedders_modulation_out"], tmp_path / "kohya.safetensors")
    raw = load_file(path)
    tensors, cfg = read_adapter(path)
    assert cfg.alpha_given and {cfg.scale(m) for m in cfg.target_modules} == {1.0}
    for flat in ("lora_unet_img_in", "lora_unet_transformer_blocks_0_img_mod_1"):
        mod = flat.removeprefix("lora_unet_").replace("transformer_blocks_0_", "transformer_blocks.0.")
        mod = mod.replace("img_mod_1", "img_mod.1")
        s = raw[f"{flat}.alpha"].item() / 4
        down, up = (s, 1.0) if s >= 0.5 else (0.5, 0.5)
        assert_same_bytes(tensors[f"{mod}.lora_A.weight"], raw[f"{flat}.lora_down.weight"] * down, mod)
        assert_same_bytes(tensors[f"{mod}.lora_B.weight"], raw[f"{flat}.lora_up.weight"] * up, mod)


# -- what drifttool writes -------------------------------------------------------------------------


def test_drifttool_writes_what_diffusers_load_lora_adapter_reads(base, adapters, tmp_path):
    """A DoRA / new-target adapter saved by drifttool loads in ``load_lora_adapter`` with the
    same scale and factors. diffusers 0.42.1 finds a ``.safetensors`` file in a folder only
    when asked (``use_safetensors=True`` or ``weight_name``): without either it looks for a
    pickled ``pytorch_lora_weights.bin``, even for its own ``save_lora_adapter`` output, and
    drifttool writes no pickle."""
    from diffusers import QwenImageTransformer2DModel

    model = ours(base, adapters["dora"], torch.float32, "merged")
    folder = save_lora(model, tmp_path / "ours")
    for kw in ({"use_safetensors": True}, {"weight_name": DIFFUSERS_WEIGHTS}):
        tr = QwenImageTransformer2DModel.from_pretrained(base)
        tr.load_lora_adapter(folder, **kw)
        (cfg,) = tr.peft_config.values()
        assert cfg.use_dora and sorted(cfg.target_modules) == sorted(NEW_TARGETS)
        layer = tr.transformer_blocks[1].img_mod[1]
        assert layer.scaling["default_0"] == 1.5
        mine = model.transformer_blocks[1].img_mod["1"]
        assert_same_bytes(layer.lora_magnitude_vector["default_0"].weight.detach(),
                          mine.lora_magnitude_vector.detach(), "magnitude")
    own = QwenImageTransformer2DModel.from_pretrained(base)
    own.add_adapter(peft.LoraConfig(r=2, target_modules=["to_q"]))
    own.save_lora_adapter(tmp_path / "theirs")
    with pytest.raises(OSError, match="pytorch_lora_weights.bin"):
        QwenImageTransformer2DModel.from_pretrained(base).load_lora_adapter(tmp_path / "theirs")
    load_lora(load_checkpoint(base, dtype=torch.float32), folder, mode="fused")  # and back


# -- the CLI ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    (("--mode", "auto", "--lora-mode", "unfused"), "DoRA in LoRA mode 'unfused'"),
    (("--preset", "flow-grpo", "--mode", "auto"), "DoRA in LoRA mode 'unfused-fp32'"),
    ((), "DoRA adapters under the strict family"),
])
def test_cli_refuses_dora_where_it_cannot_run_in_one_line(cli, adapters, tmp_path, args, needle):
    code, out = cli("run", "-o", tmp_path / "x", "--lora", adapters["dora"], "--capture", "L0", *args)
    assert code == 2 and needle in out and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_cli_runs_and_records_a_dora_adapter(cli, adapters, tmp_path):
    code, out = cli("run", "-o", tmp_path / "a", "--lora", adapters["dora"], "--capture", "L0",
                    "--mode", "auto", "--lora-mode", "fused")
    assert code == 0, out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["lora"]["use_dora"] is True and m["lora"]["mode"] == "fused"


@pytest.mark.parametrize("form,mode", [(f, m) for f in FORMS for m in ("fused", "unfused") if m in _modes(f)])
def test_the_record_of_a_loaded_pipeline_is_the_runs(base, adapters, form, mode):
    """``lora_of`` a diffusers transformer that loaded the adapter equals ``lora_record`` of
    drifttool's model in that mode (config, scale, digest with the DoRA magnitudes), and the
    fingerprint's weight digests agree."""
    from drifttool.adapters.peft_lora import canonical_parameters, lora_of
    from drifttool.model.lora_io import effective_weights, lora_record
    from drifttool.model.weights import weight_digest

    model = ours(base, adapters[form], torch.bfloat16, mode)
    tr = theirs(base, adapters[form], torch.bfloat16, mode)
    assert lora_of(tr) == lora_record(model)
    assert weight_digest(canonical_parameters(tr)) == weight_digest(effective_weights(model))


def test_gradient_records_name_the_call_site_of_each_target():
    """Adapter gradients are recorded at the block and stream of the operator that consumes
    the adapted weight (``drifttool.model.mmdit``'s call-site table)."""
    from drifttool.model.lora_io import grad_identity

    assert grad_identity("time_text_embed.timestep_embedder.linear_1.lora_A.weight", 2) == (
        -1, "none", "time_text_embed.timestep_embedder.linear_1.lora_A")
    assert grad_identity("txt_in.lora_B.weight", 2) == (-1, "txt", "txt_in.lora_B")
    assert grad_identity("img_in.lora_A.weight", 2) == (-1, "img", "img_in.lora_A")
    assert grad_identity("transformer_blocks.1.txt_mod.1.lora_B.weight", 2) == (1, "txt", "txt_mod.1.lora_B")
    assert grad_identity("transformer_blocks.0.img_mod.1.lora_A.weight", 2) == (0, "img", "img_mod.1.lora_A")
    assert grad_identity("transformer_blocks.0.attn.add_k_proj.lora_magnitude_vector", 2) == (
        0, "txt", "attn.add_k_proj.lora_magnitude_vector")
    assert grad_identity("norm_out.linear.lora_A.weight", 2) == (2, "img", "norm_out.linear.lora_A")
    assert grad_identity("proj_out.lora_B.weight", 2) == (2, "img", "proj_out.lora_B")
