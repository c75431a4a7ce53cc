"""``drifttool run --checkpoint`` loads what diffusers loads (issue 8, items 3 and 5a).

diffusers' own unit-test transformer (16 packed channels in, 4 out), weight variants, pipeline
folders, ignored config keys: a complete artifact. Shapes no rollout can use and hostile
config files: one line, exit 2, at once.
"""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from drifttool.artifact.manifest import read_manifest
from drifttool.artifact.reader import open_run
from tests.chain.tiny_pipeline import MODEL_INDEX  # what DiffusionPipeline.save_pretrained writes

# diffusers 0.42.1 tests/models/transformers/test_models_transformer_qwenimage.py, get_init_dict()
UNIT_TEST_CONFIG = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 4, "joint_attention_dim": 16, "guidance_embeds": False, "axes_dims_rope": (8, 4, 4),
}


def _diffusers_model(**overrides):
    from diffusers import QwenImageTransformer2DModel
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(**{**UNIT_TEST_CONFIG, **overrides}).eval()


@contextmanager
def time_bound(seconds: int):
    """Fail (instead of hanging) when the block runs longer than ``seconds``."""

    def expire(*_):
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _clean_error(code, out, *needles):
    assert code == 2, out
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, out


def _run_ok(cli, *args):
    code, out = cli("run", "--steps", "2", "--capture", "L1", *args)
    assert code == 0, out
    return out


@pytest.fixture(scope="module")
def unit_test_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "unit_test"
    _diffusers_model().save_pretrained(folder)
    return folder


def test_diffusers_unit_test_model_runs_to_a_complete_artifact(cli, tmp_path, unit_test_folder):
    out = tmp_path / "r"
    _run_ok(cli, "--checkpoint", unit_test_folder, "-o", out)
    m = read_manifest(out)
    assert m["complete"] is True
    assert m["replay"]["noise"]["channels"] == 4  # latent channels = in_channels / 4
    inputs = load_file(str(out / "inputs.safetensors"))
    assert inputs["x0"].shape[-1] == 16 and inputs["noise"].shape[-1] == 16  # x_t width = in_channels
    assert inputs["txt"].shape[-1] == 16  # joint_attention_dim
    assert m["fingerprint"]["arch"]["out_dim"] == 16
    assert len(open_run(out).steps_table()) > 0


def test_ignored_config_keys_load(cli, tmp_path, unit_test_folder):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "diffusion_pytorch_model.safetensors").write_bytes(
        (unit_test_folder / "diffusion_pytorch_model.safetensors").read_bytes())
    cfg = json.loads((unit_test_folder / "config.json").read_text())
    cfg |= {"pooled_projection_dim": 768, "_name_or_path": "somewhere", "_use_default_values": ["zero_cond_t"]}
    (ck / "config.json").write_text(json.dumps(cfg))
    _run_ok(cli, "--checkpoint", ck, "-o", tmp_path / "r")


def test_weight_variants(cli, tmp_path):
    model = _diffusers_model()
    single, sharded = tmp_path / "fp16", tmp_path / "bf16_sharded"
    model.save_pretrained(single, variant="fp16")
    model.save_pretrained(sharded, variant="bf16", max_shard_size="40KB")
    _clean_error(*cli("run", "--checkpoint", single, "-o", tmp_path / "r0"), "fp16", "--variant")
    _run_ok(cli, "--checkpoint", single, "--variant", "fp16", "-o", tmp_path / "r1")
    _run_ok(cli, "--checkpoint", sharded, "--variant", "bf16", "-o", tmp_path / "r2")
    assert read_manifest(tmp_path / "r1")["settings"]["variant"] == "fp16"
    w1, w2 = (read_manifest(tmp_path / r)["fingerprint"]["weights"] for r in ("r1", "r2"))
    assert w1 == w2  # same weights, whichever file layout
    _clean_error(*cli("run", "--checkpoint", single, "--variant", "fp32", "-o", tmp_path / "r3"), "fp32")
    _clean_error(*cli("run", "--checkpoint", single, "--variant", "../x", "-o", tmp_path / "r4"), "variant")
    _clean_error(*cli("run", "--variant", "fp16", "-o", tmp_path / "r5"), "--checkpoint")


def test_pipeline_folder_loads_from_its_root(cli, tmp_path, unit_test_folder):
    root = tmp_path / "pipe"
    _diffusers_model().save_pretrained(root / "transformer")
    # what DiffusionPipeline.save_pretrained writes for a Qwen-Image pipeline
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    _run_ok(cli, "--checkpoint", root, "-o", tmp_path / "a")
    _run_ok(cli, "--checkpoint", unit_test_folder, "-o", tmp_path / "b")
    fa, fb = (read_manifest(tmp_path / r)["fingerprint"] for r in ("a", "b"))
    assert fa["weights"] == fb["weights"]
    (root / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "FluxTransformer2DModel"]}))
    _clean_error(*cli("run", "--checkpoint", root, "-o", tmp_path / "c"), "FluxTransformer2DModel")


def test_shape_no_rollout_can_use_is_refused_before_the_artifact(cli, tmp_path):
    folder = tmp_path / "out_none"
    _diffusers_model(out_channels=None).save_pretrained(folder)  # proj_out 64 wide, x_t 16 wide
    out = tmp_path / "r"
    _clean_error(*cli("run", "--checkpoint", folder, "-o", out), "v_t width", "in_channels=16")
    assert not out.exists()


def _hostile(folder, text: str):
    (folder / "config.json").write_text(text)


CONFIG_TEXTS = {
    "list": "[1, 2, 3]",
    "string": '"QwenImageTransformer2DModel"',
    "not_json": "{num_layers: 2",
    "not_utf8": None,  # written as bytes below
    "deep_nesting": "[" * 100_000 + "]" * 100_000,
    "5000_digit_int": '{"num_layers": ' + "9" * 5000 + "}",
    "billion_layers": None,  # the real config with num_layers = 10**9
    "huge_widths": None,  # heads × head_dim = 2**60
    "negative": None,
    "wrong_type": None,
}


@pytest.mark.parametrize("case", list(CONFIG_TEXTS))
def test_hostile_config_fails_at_once_in_one_line(cli, tmp_path, unit_test_folder, case):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "diffusion_pytorch_model.safetensors").write_bytes(
        (unit_test_folder / "diffusion_pytorch_model.safetensors").read_bytes())
    cfg = json.loads((unit_test_folder / "config.json").read_text())
    edits = {"billion_layers": {"num_layers": 10**9},
             "huge_widths": {"num_attention_heads": 2**30, "attention_head_dim": 2**30,
                             "axes_dims_rope": [2**28, 2**29 - 2**28, 2**29]},
             "negative": {"joint_attention_dim": -16},
             "wrong_type": {"num_layers": "2"}}
    if case == "not_utf8":
        (ck / "config.json").write_bytes(b'{"num_layers": "\xff\xfe"}')
    elif case in edits:
        _hostile(ck, json.dumps(cfg | edits[case]))
    else:
        _hostile(ck, CONFIG_TEXTS[case])
    with time_bound(20):
        code, out = cli("run", "--checkpoint", ck, "-o", tmp_path / "r")
    _clean_error(code, out, "config")
    assert len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "r").exists()


def test_replay_of_a_variant_run(cli, tmp_path):
    model = _diffusers_model()
    model.save_pretrained(tmp_path / "v", variant="fp16")
    model.save_pretrained(tmp_path / "plain")
    _run_ok(cli, "--checkpoint", tmp_path / "v", "--variant", "fp16", "-o", tmp_path / "a")
    code, out = cli("replay", tmp_path / "a", "-o", tmp_path / "b")
    assert code == 0, out
    assert read_manifest(tmp_path / "b")["settings"]["variant"] == "fp16"
    assert cli("diff", tmp_path / "a", tmp_path / "b")[0] == 0
    # another checkpoint replaces the stored one, variant and all
    code, out = cli("replay", tmp_path / "a", "-o", tmp_path / "c", "--checkpoint", tmp_path / "plain")
    assert code == 0, out
    assert "variant" not in read_manifest(tmp_path / "c")["settings"]
    assert cli("diff", tmp_path / "a", tmp_path / "c")[0] == 0
