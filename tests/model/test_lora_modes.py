"""The four LoRA modes against the real libraries (peft 0.21, diffusers 0.42, no mocks), raw bytes.

One tiny random diffusers ``QwenImageTransformer2DModel`` checkpoint and one adapter (α/r = 1.5,
random non-zero B, FP32 factors that are *not* bf16-exact, so a mode that rounds or casts at
another point fails) are loaded both ways and the production forward compared byte for byte,
in bf16 and fp32:

- ``merged``: peft ``PeftModel.from_pretrained`` + ``merge_and_unload``;
- ``fused``: ``QwenImagePipeline.load_lora_weights`` + ``pipe.fuse_lora()``;
- ``unfused``: ``QwenImagePipeline.load_lora_weights`` (peft LoRA layers active);
- ``unfused-fp32``: ``PeftModel.from_pretrained`` without merging (factors autocast to FP32).
"""

from __future__ import annotations

import pytest
import torch

from drifttool.adapters.peft_lora import canonical_parameters, lora_of
from drifttool.artifact.reader import open_run
from drifttool.errors import UnsupportedConfigError
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.config import tiny
from drifttool.model.lora import LORA_MODES, add_lora, lora_parameters
from drifttool.model.lora_io import effective_weights, load_lora, lora_record, save_lora
from drifttool.model.weights import weight_digest
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes, bits

peft = pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")

RANK, ALPHA = 4, 6.0  # scale 1.5
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base folder, adapter folder): a random checkpoint and a drifttool-written adapter."""
    from tests.model.conftest import make_diffusers_transformer

    tmp = tmp_path_factory.mktemp("lora_modes")
    cfg = {k: v for k, v in tiny().to_diffusers_config().items() if not k.startswith("_")}
    make_diffusers_transformer(13, **cfg).save_pretrained(tmp / "base")
    ours = load_checkpoint(tmp / "base", dtype=torch.float32)
    add_lora(ours, rank=RANK, alpha=ALPHA, seed=3, init_b_std=0.05)
    return tmp / "base", save_lora(ours, tmp / "adapter")


def _inputs(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 64, generator=g).to(dtype)
    txt = torch.randn(2, 5, 32, generator=g).to(dtype)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3])[:, None]
    return x, txt, mask, torch.tensor([0.9, 0.4]), (2, 3)


def theirs(base, adapter, dtype, mode):
    """The diffusers transformer with the adapter loaded (and run) the library's way."""
    from diffusers import QwenImageTransformer2DModel
    from peft import PeftModel

    from tests.diffusers_pipeline import tiny_pipeline

    tr = QwenImageTransformer2DModel.from_pretrained(base, torch_dtype=dtype).eval()
    if mode in ("fused", "unfused"):
        pipe = tiny_pipeline(tr)
        pipe.load_lora_weights(adapter)
        if mode == "fused":
            pipe.fuse_lora()
        return tr
    wrapped = PeftModel.from_pretrained(tr, adapter).eval()
    return wrapped.merge_and_unload() if mode == "merged" else wrapped.base_model.model


def ours(base, adapter, dtype, mode):
    model = load_checkpoint(base, dtype=dtype)
    load_lora(model, adapter, mode=mode)
    return model


def forward_theirs(tr, dtype):
    x, txt, mask, tau, grid = _inputs(dtype)
    with torch.no_grad():
        return tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                  timestep=tau, img_shapes=[(1, *grid)] * 2, return_dict=False)[0]


def forward_ours(model, dtype, rt=None):
    x, txt, mask, tau, grid = _inputs(dtype)
    with torch.no_grad():
        return model(x, txt, mask, tau, grid, rt or Runtime(mode="auto"))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", LORA_MODES)
def test_mode_is_byte_equal_to_the_library(setup, mode, dtype):
    base, adapter = setup
    w = DTYPES[dtype]
    model = ours(base, adapter, w, mode)
    rt = Runtime(mode="auto")
    assert_same_bytes(forward_ours(model, w, rt), forward_theirs(theirs(base, adapter, w, mode), w),
                      f"{mode} {dtype}")
    lora_ops = {"merged": "lora_merge", "fused": "lora_fuse"}.get(mode, "lora_delta")
    assert lora_ops in {r["op"] for r in rt.trace.rows()}, "the mode's operator is in the trace"
    rec = lora_record(model)
    assert rec["mode"] == mode and rec["scale"] == ALPHA / RANK
    assert rec["factor_dtype"] == ("float32" if mode in ("merged", "unfused-fp32") else str(w).removeprefix("torch."))


def test_bf16_modes_differ_from_each_other(setup):
    """Control: the four modes give four different bf16 outputs, so each test above can fail."""
    base, adapter = setup
    outs = {m: bits(forward_ours(ours(base, adapter, torch.bfloat16, m), torch.bfloat16)) for m in LORA_MODES}
    for i, a in enumerate(LORA_MODES):
        for b in LORA_MODES[i + 1:]:
            assert not torch.equal(outs[a], outs[b]), (a, b)


def test_fused_fingerprint_weights_are_the_fused_pipelines(setup):
    """``effective_weights`` of a fused model are the bytes ``fuse_lora`` leaves in the base
    layers (peft names mapped to drifttool's)."""
    base, adapter = setup
    model = ours(base, adapter, torch.bfloat16, "fused")
    tr = theirs(base, adapter, torch.bfloat16, "fused")
    assert weight_digest(effective_weights(model)) == weight_digest(canonical_parameters(tr))
    assert weight_digest(effective_weights(model)) != weight_digest(model)


@pytest.mark.parametrize("mode", LORA_MODES[1:])
def test_the_record_of_a_loaded_pipeline_is_the_runs(setup, mode):
    """``lora_of`` a diffusers transformer loaded the library's way equals ``lora_record`` of
    drifttool's model in that mode (config, scale, digest, mode, factor dtype); the weight
    digests agree too."""
    base, adapter = setup
    model, tr = ours(base, adapter, torch.bfloat16, mode), theirs(base, adapter, torch.bfloat16, mode)
    assert lora_of(tr) == lora_record(model)
    assert weight_digest(canonical_parameters(tr)) == weight_digest(effective_weights(model))


def test_model_dtype_modes_refuse_strict_and_unknown(setup):
    """Strict runs ``merged`` and ``unfused-fp32`` (tests/model/test_lora_strict_unfused.py)."""
    base, adapter = setup
    model = ours(base, adapter, torch.float32, "unfused")
    with pytest.raises(UnsupportedConfigError, match="the strict family runs LoRA modes 'merged' and 'unfused-fp32'"):
        forward_ours(model, torch.float32, Runtime(mode="strict"))
    with pytest.raises(UnsupportedConfigError, match="lora_fuse"):
        forward_ours(ours(base, adapter, torch.float32, "fused"), torch.float32, Runtime(mode="strict"))
    with pytest.raises(UnsupportedConfigError, match="unknown LoRA mode"):
        load_lora(load_checkpoint(base, dtype=torch.float32), adapter, mode="half")
    assert all(p.dtype == torch.float32 for p in lora_parameters(model).values())


# -- settings, CLI, manifest --------------------------------------------------------------------
def test_mode_names_agree_with_the_schema():
    from drifttool.artifact import manifest_schema

    assert manifest_schema.LORA_MODES == LORA_MODES


@pytest.mark.parametrize("preset,expected", [(None, "merged"), ("diffusers", "unfused"),
                                             ("flow-grpo", "unfused-fp32")])
def test_the_preset_chooses_what_its_pipeline_runs(setup, preset, expected):
    from drifttool.settings import RunSpec, resolve

    _, adapter = setup
    mode = "strict" if preset is None else "auto"
    s = resolve(RunSpec(lora=adapter, preset=preset, mode=mode))[1]
    assert s.lora_mode == expected and s.record()["lora_mode"] == expected
    assert resolve(RunSpec(lora=adapter, preset=preset, mode="auto", lora_mode="fused"))[1].lora_mode == "fused"
    assert "lora_mode" not in resolve(RunSpec())[1].record()


def test_cli_lora_mode_is_recorded_and_replays_identical(cli, setup, tmp_path):
    import json

    _, adapter = setup
    code, out = cli("run", "-o", tmp_path / "a", "--preset", "diffusers", "--mode", "auto", "--capture", "L1",
                    "--lora", adapter, "--lora-mode", "fused")
    assert code == 0, out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["settings"]["lora_mode"] == "fused" and m["lora"]["mode"] == "fused"
    assert m["lora"]["factor_dtype"] == "bfloat16" and "lora_mode" in out and "fused" in out
    ops = {r["op"] for r in open_run(tmp_path / "a").trace_rows()}
    assert "lora_fuse" in ops and "lora_merge" not in ops
    code, out = cli("replay", tmp_path / "a", "-o", tmp_path / "b")
    assert code == 0, out
    code, out = cli("diff", tmp_path / "a", tmp_path / "b")
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.parametrize("args,needle", [
    (("--lora-mode", "fused"), "--lora-mode goes with --lora"),
    (("--lora", "ADAPTER", "--lora-mode", "unfused"), "LoRA mode 'unfused' reproduces"),
    (("--lora", "ADAPTER", "--lora-mode", "half", "--mode", "auto"), "unknown LoRA mode 'half'"),
])
def test_cli_refuses_bad_lora_modes_in_one_line(cli, setup, tmp_path, args, needle):
    _, adapter = setup
    code, out = cli("run", "-o", tmp_path / "x", *[str(adapter) if a == "ADAPTER" else a for a in args])
    assert code == 2 and needle in out and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "x").exists()


def test_an_adapter_without_alpha_is_noted_and_recorded(cli, setup, tmp_path):
    """A diffusers file without metadata gets scale 1 (α = r): the run says so in one line and
    the manifest records ``lora.alpha_given: false``."""
    import json

    from safetensors.torch import load_file, save_file

    _, adapter = setup
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(adapter / "pytorch_lora_weights.safetensors"), str(bare))  # no metadata
    code, out = cli("run", "-o", tmp_path / "a", "--lora", bare, "--capture", "L0")
    assert code == 0, out
    assert "has no alpha" in out and "scale 1" in out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["lora"]["alpha_given"] is False and m["lora"]["scale"] == 1.0
    code, out = cli("run", "-o", tmp_path / "b", "--lora", adapter, "--capture", "L0")
    assert code == 0 and "has no alpha" not in out, out


def test_cli_strict_unfused_fp32_runs_replays_and_trains(cli, setup, tmp_path):
    """``--lora-mode unfused-fp32`` under strict (the default mode): recorded, no LoRA operator in
    the trace, the replay is identical, and the training recompute (``--grad``) re-runs the
    rollout's mode: identical v_t and logp_t, gradients captured."""
    import json

    _, adapter = setup
    code, out = cli("run", "-o", tmp_path / "a", "--capture", "L1", "--lora", adapter, "--lora-mode", "unfused-fp32")
    assert code == 0, out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["settings"]["mode"] == "strict" and m["settings"]["lora_mode"] == "unfused-fp32"
    assert m["lora"]["mode"] == "unfused-fp32" and m["lora"]["factor_dtype"] == "float32"
    ops = {r["op"] for r in open_run(tmp_path / "a").trace_rows()}
    assert not ops & {"lora_merge", "lora_delta"} and "qkv_bias_gemm" in ops
    code, out = cli("replay", tmp_path / "a", "-o", tmp_path / "b")
    assert code == 0, out
    code, out = cli("diff", tmp_path / "a", tmp_path / "b")
    assert code == 0 and "IDENTICAL" in out, out
    code, out = cli("recompute", tmp_path / "a", "-o", tmp_path / "t", "--grad")
    assert code == 0, out
    t = open_run(tmp_path / "t")
    assert t.manifest["lora"]["mode"] == "unfused-fp32"
    roles = t.ops_table().column("role").to_pylist()
    assert roles.count("grad_weight") > 0
    code, out = cli("diff", tmp_path / "a", tmp_path / "t")
    assert code == 0 and "IDENTICAL" in out, out


def test_a_mode_without_an_adapter_names_a_mistyped_mode_first():
    from drifttool.errors import DriftToolError, UnsupportedConfigError
    from drifttool.settings import RunSpec, resolve

    with pytest.raises(UnsupportedConfigError, match="unknown LoRA mode 'bogus'"):
        resolve(RunSpec(lora_mode="bogus"))
    with pytest.raises(DriftToolError, match="needs an adapter"):
        resolve(RunSpec(lora_mode="unfused-fp32"))
