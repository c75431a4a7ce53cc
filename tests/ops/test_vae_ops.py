"""The VAE operators one by one: strict bytes of a sample do not depend on the batch around it
or its position (each operator at batch 3 against each sample alone), and unsupported calls
fail closed in both families."""

from __future__ import annotations

import math

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation, specs
from drifttool.ops.specs import VAE_OPERATORS
from tests.conftest import assert_same_bytes

FAMILIES = ("strict", "production")


def _rn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _w(g, co, ci, *k):
    return _rn(g, co, ci, *k, scale=1 / math.sqrt(ci * math.prod(k))), _rn(g, co, scale=0.1)


def _calls(dt):
    """(operator, batched args, kwargs, indices of the args with a batch axis) per operator."""
    g = torch.Generator().manual_seed(11)
    x = _rn(g, 3, 16, 1, 6, 10).to(dt)
    mean, std = torch.randn(16, generator=g), torch.rand(16, generator=g) + 0.5
    return [
        ("vae_causal_conv3d", (x, *_w(g, 8, 16, 3, 3, 3)), {"padding": 1}, (0,)),
        ("vae_causal_conv3d", (x, *_w(g, 16, 16, 3, 3, 3)), {"padding": 1, "residual": x}, (0,)),
        ("vae_rms_norm", (x, _rn(g, 16, 1, 1, 1) + 1), {"silu": True}, (0,)),
        ("vae_resample", (x, *_w(g, 8, 16, 3, 3)), {"mode": "upsample"}, (0,)),
        ("vae_resample", (x, *_w(g, 16, 16, 3, 3)), {"mode": "downsample"}, (0,)),
        ("vae_mid_attention", (x, _rn(g, 16, 1, 1) + 1, *_w(g, 48, 16, 1, 1), *_w(g, 16, 16, 1, 1)), {}, (0,)),
        ("vae_latent_normalize", (x, mean, std), {}, (0,)),
        ("vae_latent_normalize", (x, mean, std), {"inverse": True}, (0,)),
    ]


def _cast(args, dt):
    return tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 1 else a
                 for a in args)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strict_is_batch_and_position_invariant(dt):
    for op, args, kw, batched in _calls(dt):
        args = _cast(args, dt)
        kw = {k: v.to(dt) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        fn = implementation(op, "strict")
        full = fn(*args, **kw)
        for i in range(3):
            one = tuple(a[i:i + 1] if j in batched else a for j, a in enumerate(args))
            kw1 = {k: v[i:i + 1] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            assert_same_bytes(fn(*one, **kw1), full[i:i + 1], f"{op} {kw} sample {i}")


def test_vae_rows_are_declared_forward_only_under_component_vae():
    for op in VAE_OPERATORS:
        s = specs()[op]
        assert s.component == "vae" and not s.differentiable and s.contract == f"qwenimage.{op}.v1"
    assert set(specs(component="vae")) == set(VAE_OPERATORS)


@pytest.mark.parametrize("family", FAMILIES)
def test_unsupported_calls_fail_closed(family):
    x = torch.zeros(1, 4, 1, 4, 4)
    w, b = torch.zeros(4, 4, 3, 3, 3), torch.zeros(4)
    conv = implementation("vae_causal_conv3d", family)
    with pytest.raises(UnsupportedConfigError, match="kt = 2p"):
        conv(x, w, b, padding=0)
    with pytest.raises(UnsupportedConfigError, match="equal Ci"):
        conv(x, torch.zeros(4, 3, 3, 3, 3), b, padding=1)
    resample = implementation("vae_resample", family)
    with pytest.raises(UnsupportedConfigError, match="mode"):
        resample(x, w[:, :, 0], b, mode="upsample3d")
    with pytest.raises(UnsupportedConfigError, match="images"):
        resample(torch.zeros(1, 4, 2, 4, 4), w[:, :, 0], b, mode="downsample")
    with pytest.raises(UnsupportedConfigError, match="mean/std"):
        implementation("vae_latent_normalize", family)(x, torch.zeros(3), torch.ones(3))


def test_strict_refuses_other_dtypes():
    with pytest.raises(UnsupportedConfigError, match="dtype"):
        implementation("vae_rms_norm", "strict")(torch.zeros(1, 4, 1, 2, 2, dtype=torch.float64), torch.ones(4))
