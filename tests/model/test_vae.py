"""drifttool's VAE (``drifttool.model.vae``) against diffusers' ``AutoencoderKLQwenImage``: the
production family byte-equal on the CPU (FP32 and BF16: encode's mode, decode, the pipelines'
latent normalisation), strict batch- and position-invariant, the loader, and capture (every
output recorded under component ``vae`` with the VAE's blocks).

The VAE is the research notes' tiny one (base_dim 8, dim_mult [1,2,2,2], one residual block per
stage, 220 k parameters) on 16×24 images; gammas are randomised so the norms' gain is exercised.
"""

from __future__ import annotations

import json

import pytest
import torch

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.vae import QwenImageVAE, VAEConfig, random_init_
from drifttool.model.vae_checkpoint import load_vae
from drifttool.ops.specs import VAE_MODEL_OPERATORS
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes

TINY = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True, True])


@pytest.fixture(scope="module")
def diffusers_vae_dir(tmp_path_factory):
    """(a random diffusers VAE (fp32, eval), its save_pretrained folder)."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    torch.manual_seed(0)
    ref = AutoencoderKLQwenImage(**TINY).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.normal_(1.0, 0.1)
    folder = tmp_path_factory.mktemp("vae")
    ref.save_pretrained(folder)
    return ref, folder


def _images(b: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, 3, 1, 16, 24, generator=g) * 2 - 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_production_is_byte_equal_to_diffusers(diffusers_vae_dir, dtype):
    """encode → the posterior's mode (the edit pipelines' ``sample_mode="argmax"``), then
    decode, each byte-equal to diffusers' on the same weights in the same dtype."""
    ref, folder = diffusers_vae_dir
    ref = ref.to(dtype)
    vae = load_vae(folder, dtype=dtype)
    x = _images(2, dtype)
    rt = Runtime(mode="auto")
    with torch.no_grad():
        want_z = ref.encode(x).latent_dist.mode()
        z = vae.encode(x, rt)
        assert_same_bytes(z, want_z, "encode (mode)")
        assert_same_bytes(vae.decode(z, rt), ref.decode(want_z).sample, "decode")
    ref.to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_production_latent_normalisation_is_the_pipelines(dtype):
    """The edit pipelines' ``(z − mean)/std`` and every pipeline's ``z / (1/std) + mean``, with
    the statistics cast to the latents' dtype (``pipeline_qwenimage_edit.py``)."""
    vae = QwenImageVAE(VAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1))
    c = vae.config
    z = (torch.randn(2, 16, 1, 3, 5, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    mean = torch.tensor(c.latents_mean).view(1, 16, 1, 1, 1).to(dtype)
    std = torch.tensor(c.latents_std).view(1, 16, 1, 1, 1).to(dtype)
    rt = Runtime(mode="auto")
    assert_same_bytes(vae.normalize(z, rt), (z - mean) / std, "normalize")
    assert_same_bytes(vae.denormalize(z, rt), z / (1.0 / torch.tensor(c.latents_std).view(1, 16, 1, 1, 1).to(dtype)) + mean,
                      "denormalize")


@pytest.fixture(scope="module")
def strict_vae():
    return random_init_(QwenImageVAE(VAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1)), seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strict_encode_and_decode_are_batch_and_position_invariant(strict_vae, dtype):
    """A sample's strict bytes are the same alone and at every position of a batch of 3."""
    vae = strict_vae.to(dtype)
    rt = Runtime(mode="strict")
    x = _images(3, dtype, seed=5)[..., :16, :16]
    with torch.no_grad():
        z = vae.encode(x, rt)
        img = vae.decode(z, rt)
        for i in range(3):
            assert_same_bytes(vae.encode(x[i:i + 1], rt), z[i:i + 1], f"encode sample {i}")
            assert_same_bytes(vae.decode(z[i:i + 1], rt), img[i:i + 1], f"decode sample {i}")
    strict_vae.to(torch.float32)


def test_strict_is_close_to_production(diffusers_vae_dir):
    """Strict and production differ only by rounding (FP32, tiny VAE): the encode within 1e-5,
    the decoded image within 1e-4."""
    _, folder = diffusers_vae_dir
    vae = load_vae(folder)
    x = _images(1, torch.float32)
    with torch.no_grad():
        zs, zp = vae.encode(x, Runtime(mode="strict")), vae.encode(x, Runtime(mode="auto"))
        assert (zs - zp).abs().max() < 1e-5
        ds, dp = vae.decode(zp, Runtime(mode="strict")), vae.decode(zp, Runtime(mode="auto"))
        assert (ds - dp).abs().max() < 1e-4


class _Sites:
    """A capture sink keeping each captured call's identity."""

    level = "L1"

    def __init__(self):
        self.sites = []

    def capture(self, site, tensor, layout, index=0, role="output"):
        self.sites.append((site["component"], site["block"], site["op"], site["call"], layout, tuple(tensor.shape)))


def test_every_call_is_captured_under_the_vae_component():
    """encode, normalise, denormalise and decode hand every operator output to the recorder
    with component ``vae`` and the VAE's blocks (−1 inputs, then its stages in order)."""
    vae = random_init_(QwenImageVAE(VAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1)))
    sink = _Sites()
    rt = Runtime(mode="auto", recorder=sink)
    with torch.no_grad():
        z = vae.normalize(vae.encode(_images(2, torch.float32)[..., :16, :16], rt), rt)
        vae.decode(vae.denormalize(z, rt), rt)
    assert {s[0] for s in sink.sites} == {"vae"}
    assert {s[2] for s in sink.sites} == set(VAE_MODEL_OPERATORS)
    assert {s[4] for s in sink.sites} == {"B...."} and all(s[5][0] == 2 for s in sink.sites)
    enc_blocks = len(vae.encoder.down_blocks) + 2  # entries, mid, head
    assert {s[1] for s in sink.sites} == set(range(-1, enc_blocks))
    first = sink.sites[0]
    assert first[:4] == ("vae", -1, "vae_causal_conv3d", 0)  # encoder.conv_in


def test_images_only_and_supported_shapes_fail_closed():
    vae = random_init_(QwenImageVAE(VAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1)))
    rt = Runtime(mode="strict")
    with pytest.raises(UnsupportedConfigError, match="images"):
        vae.encode(torch.zeros(1, 3, 2, 16, 16), rt)
    with pytest.raises(UnsupportedConfigError, match="multiples of 8"):
        vae.encode(torch.zeros(1, 3, 1, 12, 16), rt)
    with pytest.raises(UnsupportedConfigError, match="images"):
        vae.decode(torch.zeros(1, 4, 1, 2, 2), rt)


def test_load_from_a_pipeline_folder_and_refuse_a_mismatched_config(diffusers_vae_dir, tmp_path):
    _, folder = diffusers_vae_dir
    (tmp_path / "vae").mkdir()
    for f in folder.iterdir():
        (tmp_path / "vae" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "model_index.json").write_text(json.dumps({"vae": ["diffusers", "AutoencoderKLQwenImage"]}))
    vae = load_vae(tmp_path)
    assert vae.config.base_dim == 8 and vae.config.dim_mult == (1, 2, 2, 2)
    cfg = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**cfg, "base_dim": 16}))
    with pytest.raises(CheckpointError, match="do not fit config.json: .*mis-shaped"):
        load_vae(tmp_path)
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**cfg, "attn_scales": [0.5]}))
    with pytest.raises(UnsupportedConfigError, match="attn_scales"):
        load_vae(tmp_path)
