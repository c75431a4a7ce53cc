"""MMDiTConfig, flavors and the diffusers config mapping (numerics §1, §6)."""

import inspect
import re

import pytest
import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.model.config import FLAVORS, MMDiTConfig, from_diffusers_config, full, tiny


def test_full_matches_diffusers_constructor_defaults():
    from diffusers import QwenImageTransformer2DModel

    defaults = {
        k: p.default
        for k, p in inspect.signature(QwenImageTransformer2DModel.__init__).parameters.items()
        if k != "self"
    }
    assert from_diffusers_config({}) == full()
    cfg = full().to_diffusers_config()
    for k, v in defaults.items():
        want = list(v) if isinstance(v, tuple) else v
        assert cfg[k] == want, k
    assert (full().inner_dim, full().out_dim, full().mlp_dim) == (3072, 64, 12288)


def test_flavors_are_functions_returning_configs():
    assert set(FLAVORS) == {"tiny", "full"}
    for name, fn in FLAVORS.items():
        assert isinstance(fn(), MMDiTConfig), name
    t = tiny()
    assert (t.in_channels, t.out_channels, t.patch_size) == (64, 16, 2)  # real latent packing
    assert sum(t.axes_dims_rope) == t.attention_head_dim
    assert t.inner_dim == 32 and t.num_layers == 2


def test_diffusers_config_round_trip():
    for fn in FLAVORS.values():
        cfg = fn()
        assert from_diffusers_config(cfg.to_diffusers_config()) == cfg


# diffusers' own unit-test model (tests/models/transformers/test_models_transformer_qwenimage.py)
DIFFUSERS_UNIT_TEST = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 4, "joint_attention_dim": 16, "guidance_embeds": False, "axes_dims_rope": [8, 4, 4],
}


def _diffusers_built(cfg: dict):
    """What diffusers builds from ``cfg`` (on the meta device): its widths and block count."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        m = QwenImageTransformer2DModel.from_config(cfg)
    return (m.img_in.in_features, m.proj_out.out_features, len(m.transformer_blocks),
            m.inner_dim, m.txt_in.in_features)


@pytest.mark.parametrize("cfg", [
    DIFFUSERS_UNIT_TEST,
    {**DIFFUSERS_UNIT_TEST, "out_channels": None},  # proj_out 4·16 = 64 wide, x_t 16 wide
    {**DIFFUSERS_UNIT_TEST, "out_channels": 0},  # diffusers: ``out_channels or in_channels``
    {**DIFFUSERS_UNIT_TEST, "patch_size": 1, "out_channels": 16},
    {**DIFFUSERS_UNIT_TEST, "pooled_projection_dim": 768, "_name_or_path": "x", "_diffusers_version": "0.30.0"},
    {**DIFFUSERS_UNIT_TEST, "num_layers": 5, "_use_default_values": ["out_channels", "num_layers"]},
], ids=["unit_test", "out_none", "out_zero", "patch1", "ignored_keys", "use_default_values"])
def test_loads_what_diffusers_builds(cfg):
    c = from_diffusers_config(dict(cfg))
    assert (c.in_channels, c.out_dim, c.num_layers, c.inner_dim, c.joint_attention_dim) == _diffusers_built(cfg)


def test_latent_channels_only_when_a_rollout_can_run():
    assert from_diffusers_config(DIFFUSERS_UNIT_TEST).latent_channels == 4
    assert from_diffusers_config({**DIFFUSERS_UNIT_TEST, "patch_size": 1, "out_channels": 16}).latent_channels == 4
    assert tiny().latent_channels == full().latent_channels == 16
    for cfg, needle in (({**DIFFUSERS_UNIT_TEST, "out_channels": None}, "v_t width"),
                        ({**DIFFUSERS_UNIT_TEST, "in_channels": 18, "out_channels": None, "patch_size": 1},
                         "not a multiple of 4")):
        with pytest.raises(UnsupportedConfigError, match=needle):
            from_diffusers_config(cfg).latent_channels


@pytest.mark.parametrize("cfg, needle", [
    ([1, 2], "JSON object"),
    ("config", "JSON object"),
    ({"num_layers": "2"}, "num_layers='2' must be an integer"),
    ({"num_layers": 2.0}, "num_layers=2.0 must be an integer"),
    ({"num_layers": True}, "num_layers=True must be an integer"),
    ({"attention_head_dim": 0}, "attention_head_dim=0"),
    ({"num_layers": -3}, "num_layers=-3"),
    ({"num_layers": 10**1000}, "num_layers=<huge>"),
    ({"in_channels": None}, "in_channels=None"),
    ({"axes_dims_rope": "abc"}, "axes_dims_rope"),
    ({"axes_dims_rope": [16, 56, 10**30]}, "axes_dims_rope"),
    ({"guidance_embeds": "no"}, "guidance_embeds='no' must be true or false"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"_use_default_values": "num_layers"}, "_use_default_values"),
])
def test_hostile_configs_refused_naming_the_key(cfg, needle):
    with pytest.raises(UnsupportedConfigError, match=re.escape(needle)):
        from_diffusers_config(cfg)


@pytest.mark.parametrize("flag", ["guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"])
def test_unsupported_flags_fail_closed(flag):
    d = tiny().to_diffusers_config()
    d[flag] = True
    with pytest.raises(UnsupportedConfigError, match=flag):
        from_diffusers_config(d)


def test_other_class_fails_closed():
    d = tiny().to_diffusers_config()
    with pytest.raises(UnsupportedConfigError, match="_class_name"):
        from_diffusers_config({**d, "_class_name": "FluxTransformer2DModel"})
    # private keys are ignored
    assert from_diffusers_config({**d, "_name_or_path": "x", "_diffusers_version": "0.42.1"}) == tiny()


@pytest.mark.parametrize(
    "bad",
    [
        dict(axes_dims_rope=(4, 6, 8)),  # sum != head dim
        dict(axes_dims_rope=(5, 5, 6)),  # odd axis
        dict(num_layers=0),
        dict(patch_size=0),
        dict(eps=0.0),
    ],
)
def test_invalid_shapes_rejected(bad):
    kw = {**tiny().__dict__, **bad}
    with pytest.raises(UnsupportedConfigError):
        MMDiTConfig(**kw)


def test_arch_fields_fingerprint():
    a, b = tiny().arch_fields(), full().arch_fields()
    assert set(a) == set(b) and a != b
    assert a["axes_dims_rope"] == [4, 6, 6] and a["inner_dim"] == 32
    # only shape-relevant data, all JSON-serialisable scalars/lists
    import json

    json.dumps(a)
