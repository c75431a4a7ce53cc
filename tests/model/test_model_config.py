"""MMDiTConfig, flavors and the diffusers config mapping (numerics §1, §6)."""

import inspect

import pytest

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


def test_out_channels_none_means_in_channels():
    # diffusers: out_channels None -> in_channels; 64 in / 64 out is not one latent's 2×2 packing.
    with pytest.raises(UnsupportedConfigError, match="in_channels"):
        from_diffusers_config({"in_channels": 64, "out_channels": None})
    assert from_diffusers_config({"in_channels": 16 * 4, "out_channels": 16}).out_channels == 16


@pytest.mark.parametrize("flag", ["guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"])
def test_unsupported_flags_fail_closed(flag):
    d = tiny().to_diffusers_config()
    d[flag] = True
    with pytest.raises(UnsupportedConfigError, match=flag):
        from_diffusers_config(d)


def test_unknown_key_and_class_fail_closed():
    d = tiny().to_diffusers_config()
    with pytest.raises(UnsupportedConfigError, match="unknown keys"):
        from_diffusers_config({**d, "num_single_layers": 3})
    with pytest.raises(UnsupportedConfigError, match="_class_name"):
        from_diffusers_config({**d, "_class_name": "FluxTransformer2DModel"})
    # private keys are ignored
    assert from_diffusers_config({**d, "_name_or_path": "x", "_diffusers_version": "0.42.1"}) == tiny()


@pytest.mark.parametrize(
    "bad",
    [
        dict(axes_dims_rope=(4, 6, 8)),  # sum != head dim
        dict(axes_dims_rope=(5, 5, 6)),  # odd axis
        dict(patch_size=1, in_channels=16),
        dict(in_channels=16),  # not patch²·out_channels
        dict(num_layers=0),
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
