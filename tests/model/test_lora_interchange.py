"""LoRA adapters round-trip with the real peft 0.21 and diffusers 0.42 (no mocks), both ways.

For each direction the adapted forward of a diffusers ``QwenImageTransformer2DModel`` (tiny
config, one random checkpoint shared with drifttool's ``MMDiT``) is compared with drifttool's
production forward:

- bf16: byte for byte against the library's *merged* model (peft ``merge_and_unload`` /
  diffusers ``fuse_lora``), whose arithmetic drifttool's production ``lora_merge`` is;
- fp32: ≤ ``FP32_REL_L2`` relative L2 against the library's default *unmerged* forward
  (``W·x + s·B·A·x``), the bound ``tests/model/test_model_parity.py`` declares for the production
  fp32 forward.

Every adapter has α/r ≠ 1 (and random non-zero B), so ignoring the scale fails each comparison.
diffusers keeps loaded factors in the model dtype (bf16), peft's ``from_pretrained`` and
drifttool in FP32; the bf16 diffusers cases therefore use bf16-exact factors and upcast them with
peft's ``cast_adapter_dtype`` before fusing (nothing is lost, the merge then is peft's FP32 one).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.config import tiny
from drifttool.model.lora import LORA_TARGET_MODULES, add_lora, lora_parameters, lora_scales
from drifttool.model.lora_formats import DIFFUSERS_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS, read_adapter
from drifttool.model.lora_io import load_lora, lora_digest, lora_record, save_lora
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes

peft = pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")

FP32_REL_L2 = 1e-6  # tests/model/test_model_parity.py: production backend, fp32
RANK, ALPHA = 4, 6.0  # scale 1.5


@pytest.fixture
def base_folder(diffusers_folder):
    cfg = {k: v for k, v in tiny().to_diffusers_config().items() if not k.startswith("_")}
    return diffusers_folder(seed=11, **cfg)[1]


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 64, generator=g).to(dtype)
    txt = torch.randn(2, 5, 32, generator=g).to(dtype)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3])[:, None]
    return x, txt, mask, torch.tensor([0.9, 0.4]), (2, 3)


def _theirs(model, dtype):
    x, txt, mask, tau, grid = _inputs(dtype)
    with torch.no_grad():
        return model(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                     timestep=tau, img_shapes=[(1, *grid)] * 2, return_dict=False)[0]


def _ours(model, dtype):
    x, txt, mask, tau, grid = _inputs(dtype)
    with torch.no_grad():
        return model(x, txt, mask, tau, grid, Runtime(mode="auto"))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _diffusers(folder, dtype):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=dtype).eval()


def _bf16_exact_(params):
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def _compare(theirs_merged_bf16, theirs_fp32, ours_bf16, ours_fp32, what):
    """bf16 merged: byte-equal; fp32 unmerged: within FP32_REL_L2."""
    assert_same_bytes(_ours(ours_bf16, torch.bfloat16), _theirs(theirs_merged_bf16, torch.bfloat16), what)
    ref = _theirs(theirs_fp32, torch.float32)
    got = _ours(ours_fp32, torch.float32)
    assert _rel(got, ref) <= FP32_REL_L2, f"{what}: fp32 rel L2 {_rel(got, ref)}"


def _peft_folder(base_folder, tmp_path, **extra):
    """An adapter written by peft's ``PeftModel.save_pretrained`` (random non-zero B)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    config = {"r": RANK, "lora_alpha": ALPHA, "init_lora_weights": False,
              "target_modules": list(LORA_TARGET_MODULES), **extra}
    model = get_peft_model(_diffusers(base_folder, torch.float32), LoraConfig(**config))
    model.save_pretrained(tmp_path / "peft_adapter")
    return tmp_path / "peft_adapter"


def _drifttool_folder(base_folder, tmp_path):
    ours = load_checkpoint(base_folder, dtype=torch.float32)
    add_lora(ours, rank=RANK, alpha=ALPHA, seed=7, init_b_std=0.05)
    _bf16_exact_(lora_parameters(ours).values())  # so diffusers' bf16 factors lose nothing
    return save_lora(ours, tmp_path / "ours"), ours


def _loaded(base_folder, adapter, dtype):
    ours = load_checkpoint(base_folder, dtype=dtype)
    load_lora(ours, adapter)
    return ours


# ---------------------------------------------------------------------------------------------
# drifttool -> peft / diffusers


def test_drifttool_adapter_loads_completely_in_peft(base_folder, tmp_path):
    from peft import PeftModel

    folder, ours = _drifttool_folder(base_folder, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp32 = PeftModel.from_pretrained(_diffusers(base_folder, torch.float32), folder).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower()], [str(w.message) for w in caught]
    cfg = fp32.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora) == (RANK, ALPHA, False)
    loaded = {k.removeprefix("base_model.model.").replace(".default.", "."): v
              for k, v in fp32.state_dict().items() if ".lora_" in k}
    mine = lora_parameters(ours)
    assert loaded.keys() == mine.keys()
    for k, p in mine.items():
        assert_same_bytes(loaded[k], p.detach(), k)
    layer = fp32.base_model.model.transformer_blocks[0].attn.to_q
    assert layer.scaling["default"] == ALPHA / RANK
    bf16 = PeftModel.from_pretrained(_diffusers(base_folder, torch.bfloat16), folder).merge_and_unload()
    _compare(bf16, fp32, _loaded(base_folder, folder, torch.bfloat16),
             _loaded(base_folder, folder, torch.float32), "drifttool -> peft")
    base = _theirs(_diffusers(base_folder, torch.float32), torch.float32)
    assert _rel(_theirs(fp32, torch.float32), base) > 1e-3  # the adapter is applied


def _diffusers_with_adapter(base_folder, dtype, load):
    """A diffusers transformer with an adapter loaded by ``load(transformer)``; in bf16 the
    factors are upcast to FP32 (peft's ``cast_adapter_dtype``) and fused (``fuse_lora``)."""
    from peft.tuners.tuners_utils import cast_adapter_dtype

    t = _diffusers(base_folder, dtype)
    load(t)
    (name,) = t.peft_config
    if dtype == torch.bfloat16:
        cast_adapter_dtype(t, name, autocast_adapter_dtype=True)
        t.fuse_lora()
    return t


@pytest.mark.parametrize("how", ["load_lora_adapter(folder)", "load_lora_adapter(file)",
                                 "pipeline.load_lora_weights"])
def test_drifttool_adapter_loads_in_diffusers_with_its_scale(base_folder, tmp_path, how):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    folder, _ = _drifttool_folder(base_folder, tmp_path)

    def load(t):
        if how == "load_lora_adapter(folder)":  # diffusers reads the metadata only with use_safetensors
            t.load_lora_adapter(folder, use_safetensors=True)
        elif how == "load_lora_adapter(file)":
            t.load_lora_adapter(folder / DIFFUSERS_WEIGHTS, use_safetensors=True)
        else:  # a real pipeline; the text encoder and VAE play no part in loading a LoRA
            pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                                     tokenizer=None, transformer=t)
            pipe.load_lora_weights(folder)

    fp32 = _diffusers_with_adapter(base_folder, torch.float32, load)
    (cfg,) = fp32.peft_config.values()
    assert (cfg.r, cfg.lora_alpha) == (RANK, ALPHA)
    scales = {m.scaling[n] for m in fp32.modules() if hasattr(m, "scaling") for n in m.scaling}
    assert scales == {ALPHA / RANK}
    bf16 = _diffusers_with_adapter(base_folder, torch.bfloat16, load)
    _compare(bf16, fp32, _loaded(base_folder, folder, torch.bfloat16),
             _loaded(base_folder, folder, torch.float32), f"drifttool -> diffusers {how}")


# ---------------------------------------------------------------------------------------------
# peft / diffusers -> drifttool


PATTERNS = {"use_rslora": True, "rank_pattern": {"attn.to_q": 2}, "alpha_pattern": {"img_mlp.net.2": 3.0}}


@pytest.mark.parametrize("extra", [{}, PATTERNS, {"target_modules": r".*\.attn\.(to_q|add_k_proj)"}],
                         ids=["plain", "rslora_patterns", "regex_targets"])
def test_peft_adapter_loads_in_drifttool(base_folder, tmp_path, extra):
    from peft import PeftModel

    folder = _peft_folder(base_folder, tmp_path, **extra)
    ours = _loaded(base_folder, folder, torch.float32)
    theirs = PeftModel.from_pretrained(_diffusers(base_folder, torch.float32), folder).eval()
    want = {n: m.scaling["default"] for n, m in theirs.base_model.model.named_modules()
            if hasattr(m, "scaling")}
    assert lora_scales(ours) == want and len(want) == (4 if "target_modules" in extra else 24)
    if "use_rslora" in extra:
        assert want["transformer_blocks.0.attn.to_q"] == ALPHA / 2 ** 0.5
        assert want["transformer_blocks.1.img_mlp.net.2"] == 3.0 / RANK ** 0.5
    bf16 = PeftModel.from_pretrained(_diffusers(base_folder, torch.bfloat16), folder).merge_and_unload()
    _compare(bf16, theirs, _loaded(base_folder, folder, torch.bfloat16), ours, "peft -> drifttool")
    x, txt, mask, tau, grid = _inputs(torch.float32)
    with torch.no_grad():  # the strict backend too, within test_model_parity's strict fp32 bound
        strict = ours(x, txt, mask, tau, grid, Runtime(mode="strict"))
    assert _rel(strict, _theirs(theirs, torch.float32)) <= 1e-5


def _diffusers_saved(base_folder, tmp_path, layout):
    """An adapter written by diffusers: ``save_lora_adapter`` (model layout) or
    ``QwenImagePipeline.save_lora_weights`` (pipeline layout, keys and metadata ``transformer.``)."""
    from diffusers import QwenImagePipeline
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(6)
    t = _diffusers(base_folder, torch.float32)
    t.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False,
                             target_modules=list(LORA_TARGET_MODULES)))
    _bf16_exact_(p for n, p in t.named_parameters() if ".lora_" in n)
    out = tmp_path / f"diffusers_{layout}"
    if layout == "model":
        t.save_lora_adapter(out)
    else:
        QwenImagePipeline.save_lora_weights(
            out, transformer_lora_layers=get_peft_model_state_dict(t),
            transformer_lora_adapter_metadata=t.peft_config["default"].to_dict())
    return out


@pytest.mark.parametrize("layout", ["model", "pipeline"])
@pytest.mark.parametrize("given", ["folder", "file"])
def test_diffusers_adapter_loads_in_drifttool(base_folder, tmp_path, layout, given):
    out = _diffusers_saved(base_folder, tmp_path, layout)
    adapter = out if given == "folder" else out / DIFFUSERS_WEIGHTS
    prefix = None if layout == "model" else "transformer"

    def load(t):
        t.load_lora_adapter(out / DIFFUSERS_WEIGHTS, prefix=prefix, use_safetensors=True)

    fp32 = _diffusers_with_adapter(base_folder, torch.float32, load)
    ours = _loaded(base_folder, adapter, torch.float32)
    assert set(lora_scales(ours).values()) == {ALPHA / RANK}
    bf16 = _diffusers_with_adapter(base_folder, torch.bfloat16, load)
    _compare(bf16, fp32, _loaded(base_folder, adapter, torch.bfloat16), ours,
             f"diffusers {layout} -> drifttool")


def test_file_without_config_uses_alpha_equal_rank_like_diffusers(base_folder, tmp_path):
    """No adapter_config.json and no metadata: α = r (scale 1) in both libraries, recorded."""
    out = _diffusers_saved(base_folder, tmp_path, "model")
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(out / DIFFUSERS_WEIGHTS)), str(bare))  # drops the metadata
    ours = _loaded(base_folder, bare, torch.float32)
    assert set(lora_scales(ours).values()) == {1.0} and lora_record(ours)["alpha_given"] is False
    fp32 = _diffusers_with_adapter(base_folder, torch.float32,
                                   lambda t: t.load_lora_adapter(bare, prefix=None, use_safetensors=True))
    assert _rel(_ours(ours, torch.float32), _theirs(fp32, torch.float32)) <= FP32_REL_L2


# ---------------------------------------------------------------------------------------------
# what the adapter's identity covers, and what is refused


def test_digest_and_record_change_with_alpha_and_rslora():
    from drifttool.model.mmdit import MMDiT, random_init_

    def adapted(**kw):
        m = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=3)
        add_lora(m, rank=RANK, seed=1, init_b_std=0.05, **kw)
        return m

    a, b, c = adapted(alpha=6), adapted(alpha=8), adapted(alpha=6, use_rslora=True)
    assert lora_digest(a) != lora_digest(b) != lora_digest(c) != lora_digest(a)
    assert [lora_record(m)["scale"] for m in (a, b, c)] == [1.5, 2.0, 3.0]
    assert lora_digest(a) == lora_digest(adapted(alpha=6))


def _peft_dir(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    save_file({"base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 32)},
              str(folder / PEFT_WEIGHTS))
    (folder / PEFT_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                  "target_modules": ["attn.to_q"], **config}))
    return folder


@pytest.mark.parametrize("config, word", [
    ({"lora_bias": True}, "lora_bias"),
    ({"bias": "all"}, "base biases"),
    ({"modules_to_save": ["proj_out"]}, "modules_to_save"),
    ({"init_lora_weights": "pissa"}, "rewrites the base weights"),
    ({"use_qalora": True}, "unknown to drifttool"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "LOHA"}, "not a LoRA"),
    ({"rank_pattern": {"attn.to_q(": 2}}, "bad regular expression"),
    ({"lora_alpha": "big"}, "bad r / lora_alpha"),
])
def test_unsupported_configs_are_refused(tmp_path, config, word):
    with pytest.raises(CheckpointError, match=word):
        read_adapter(_peft_dir(tmp_path, "a", **config))


def test_unsupported_targets_and_layouts_are_refused(tmp_path):
    from drifttool.model.mmdit import MMDiT, random_init_

    m = random_init_(MMDiT(tiny(), dtype=torch.float32), seed=3)
    with pytest.raises(CheckpointError, match="selects no module"):
        load_lora(m, _peft_dir(tmp_path, "a", target_modules=["attn.norm_q"]))  # a gain, no Linear
    assert not lora_parameters(m)
    add_lora(m, rank=2, alpha=4, init_b_std=0.1)
    folder = save_lora(m, tmp_path / "both")
    sd = load_file(str(folder / PEFT_WEIGHTS))
    k = next(iter(sd))
    sd[k] = sd[k] + 1
    save_file(sd, str(folder / PEFT_WEIGHTS))
    with pytest.raises(CheckpointError, match="differ in their tensors"):
        read_adapter(folder)
    kohya = tmp_path / "kohya.safetensors"  # a down factor without its up factor (diffusers refuses it too)
    save_file({"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight": torch.zeros(2, 32),
               "lora_unet_transformer_blocks_0_attn_to_q.alpha": torch.tensor(4.0)}, str(kohya))
    with pytest.raises(CheckpointError, match="lora_down.weight has no transformer_blocks.0.attn.to_q.lora_up"):
        load_lora(random_init_(MMDiT(tiny(), dtype=torch.float32), seed=3), kohya)


def test_cli_refuses_an_unsupported_adapter_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    folder = _peft_dir(tmp_path, "bias", lora_bias=True)
    res = CliRunner().invoke(app, ["run", "-o", str(tmp_path / "out"), "--lora", str(folder)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "unsupported LoRA config: lora_bias=True (a bias on lora_B)" in " ".join(res.output.split())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_production_lora_merge_is_peft_merge(dtype):
    """Operator level: ``lora_merge`` (production) equals peft's ``LoraLayer.merge`` bit for bit
    (FP32 factors on a ``dtype`` base, as ``PeftModel.from_pretrained`` makes them)."""
    from peft import LoraConfig, get_peft_model

    from drifttool.ops.lora import lora_merge_production

    torch.manual_seed(0)
    net = get_peft_model(torch.nn.Sequential(torch.nn.Linear(48, 40)).to(dtype),
                         LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False, target_modules=["0"]))
    layer = net.base_model.model[0]
    w = layer.base_layer.weight.detach().clone()
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    assert a.dtype == torch.float32
    layer.merge()
    merged = lora_merge_production(w, a, b, ALPHA / RANK)
    assert_same_bytes(merged, layer.base_layer.weight.detach(), str(dtype))
