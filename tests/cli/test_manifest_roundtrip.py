"""What ``drifttool run`` writes, its own reader accepts: every CLI option that changes what the
manifest records (preset, --latents, --prompt-embeds with or without a negative file, --lora,
--samples/--batch, --cfg-scale, --steps, --eta, --dtype, --mode, --capture), combined at
random, gives an artifact that ``open_run`` validates, ``Run.check`` reads whole and
``drifttool diff`` compares with itself (exit 0)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from drifttool.artifact import open_run

D = 32  # joint_attention_dim of the embedded tiny model
GRID_TOKENS = 24  # the tiny-t2i fixture's 4x6 grid
CP = 64  # packed latent channels of the tiny model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Input files for batches of 2: prompt embeddings (masked), a negative prompt, latents,
    and a LoRA adapter of the tiny model."""
    from drifttool.model.config import tiny
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora
    from drifttool.model.mmdit import MMDiT, random_init_

    root = tmp_path_factory.mktemp("inputs")
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    save_file({"prompt_embeds": torch.randn(2, 4, D, generator=g) * mask[..., None],
               "prompt_embeds_mask": mask}, str(root / "pe.safetensors"))
    save_file({"prompt_embeds": torch.randn(2, 3, D, generator=g)}, str(root / "ne.safetensors"))
    save_file({"latents": torch.randn(2, GRID_TOKENS, CP, generator=g)}, str(root / "x0.safetensors"))
    model = random_init_(MMDiT(tiny()), seed=0)
    add_lora(model, rank=2, alpha=4.0, targets=("attn.to_q",), init_b_std=0.01)
    save_lora(model, root / "lora")
    return root


OPTIONS = st.fixed_dictionaries({
    "preset": st.sampled_from([None, "diffusers", "flow-grpo"]),
    "latents": st.booleans(),
    "embeds": st.sampled_from([None, "prompt", "prompt+negative"]),
    "lora": st.booleans(),
    "rows": st.sampled_from([None, "--samples 0,1", "--batch 2"]),
    "cfg_scale": st.sampled_from([None, "1.0", "3.5"]),
    "steps": st.just("2"),
    "eta": st.sampled_from([None, "0", "0.7"]),
    "dtype": st.sampled_from([None, "float32", "bfloat16"]),
    "capture": st.sampled_from([None, "L0", "L1"]),
})


def _args(o: dict, files: Path) -> list[str]:
    args = []
    if o["preset"] is not None:
        # the presets run the production family only
        args += ["--preset", o["preset"], "--mode", "auto"]
        if o["preset"] == "diffusers":
            o = {**o, "eta": None}  # diffusers' Euler step is deterministic
    if o["latents"]:
        args += ["--latents", str(files / "x0.safetensors")]
    if o["embeds"] is not None:
        args += ["--prompt-embeds", str(files / "pe.safetensors")]
        if o["embeds"] == "prompt+negative":
            args += ["--negative-prompt-embeds", str(files / "ne.safetensors")]
    if o["lora"]:
        args += ["--lora", str(files / "lora")]
    if o["rows"] is not None or o["latents"] or o["embeds"] is not None:
        args += (o["rows"] or "--batch 2").split()  # the files hold 2 rows
    for opt in ("cfg_scale", "steps", "eta", "dtype", "capture"):
        if o[opt] is not None:
            args += [f"--{opt.replace('_', '-')}", o[opt]]
    return args


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(o=OPTIONS)
def test_the_reader_accepts_every_manifest_the_writer_writes(cli, files, o):
    args = _args(o, files)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run"
        code, text = cli("run", "-o", out, *args)
        assert code == 0, (args, text)
        run = open_run(out)  # validates the manifest against the schema
        assert run.complete and run.check() == [], (args, text)
        code, text = cli("diff", out, out)
        assert code == 0 and "IDENTICAL" in text, (args, text)


def test_a_preset_run_given_latents_is_read_back(cli, files, tmp_path):
    """``--preset diffusers --latents``: how a user checks a pipeline's latents against
    drifttool; its manifest says where x0 came from, in a field the reader knows."""
    out = tmp_path / "run"
    code, text = cli("run", "-o", out, "--preset", "diffusers", "--mode", "auto", "--batch", "2",
                     "--latents", files / "x0.safetensors")
    assert code == 0, text
    open_run(out)
    code, text = cli("diff", out, out)
    assert code == 0 and "IDENTICAL" in text, text
    noise = json.loads((out / "manifest.json").read_text())["replay"]["noise"]
    assert any(step.startswith("x0: from --latents") for step in noise["consumption_order"])
