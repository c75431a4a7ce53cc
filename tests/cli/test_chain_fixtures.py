"""The sealed chain fixtures: ``tiny-t2i-chain`` (prompt → text encoder → trajectory → VAE decode)
and ``tiny-edit`` (prompt and condition image → text encoder with its vision tower → VAE encode →
trajectory → VAE decode). ``fixture verify`` re-runs every stage and compares every component's
records and the decoded image's SHA-256; a changed byte anywhere fails it with one line naming the
file; a re-sealed change that the re-run meets drifts (exit 1) at the stage it touched."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("PIL")

from drifttool.exit_codes import ExitCode  # noqa: E402
from drifttool.fixture import locate, seal  # noqa: E402

STAGES = {"tiny-t2i-chain": {"text_encoder", "mmdit", "vae"}, "tiny-edit": {"text_encoder", "mmdit", "vae"}}


def _copy(name, tmp_path):
    out = tmp_path / name
    shutil.copytree(locate(name), out, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return out


def _flip(path, offset=None):
    """Change one byte (the middle one unless ``offset``), keeping the size."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _off_build_environment(name):
    """Why a production fixture's bytes need not hold here (its build's CPU dispatch level or
    torch differs from this process's), else None; strict fixtures hold everywhere."""
    from drifttool.environment import environment
    from drifttool.verify import environment_note

    built = json.loads((locate(name) / "expected" / "manifest.json").read_text())
    return environment_note(built, {"environment": environment()})


@pytest.mark.parametrize("name", sorted(STAGES))
def test_verify_reruns_every_stage_and_the_image(cli, name, tmp_path):
    import pyarrow.parquet as pq

    if (why := _off_build_environment(name)) is not None:
        pytest.skip(f"{name}: {why}")
    code, out = cli("fixture", "verify", name, "--workdir", tmp_path / "w", "--json")
    assert code == ExitCode.OK, out
    doc = json.loads(out)
    assert doc["fixture"] == name and doc["report"]["verdict"] == "identical", out
    (image,) = doc["images"]
    assert image["equal"] and image["expected"] == "expected.png", image
    assert doc["note"] is None  # built here: no environment difference
    assert (tmp_path / "w" / "replay.png").read_bytes() == (locate(name) / "expected.png").read_bytes()
    ops = pq.read_table(tmp_path / "w" / "replay" / "ops.rank0.parquet", columns=["component", "step", "op"])
    assert set(ops["component"].to_pylist()) == STAGES[name]
    manifest = json.loads((locate(name) / "expected" / "manifest.json").read_text())
    steps = manifest["settings"]["steps"]
    vae_steps = {s for c, s in zip(ops["component"].to_pylist(), ops["step"].to_pylist()) if c == "vae"}
    assert steps in vae_steps  # the decode, after the last step
    if name == "tiny-edit":
        assert -1 in vae_steps and manifest["settings"]["preset"] == "diffusers-edit"  # the encode
        assert manifest["edit"]["condition_images"][0]["sha256"]
        edit = json.loads((locate(name) / "fixture.json").read_text())["edit"]
        assert (manifest["edit"]["prompts"], manifest["edit"]["negative_prompts"], manifest["edit"]["prompt_positions"]) \
            == (edit["prompts"], edit["negative_prompts"], edit["prompt_positions"]) == (["make it blue"], ["cat"], "sequential")
        te = {op for c, op in zip(ops["component"].to_pylist(), ops["op"].to_pylist()) if c == "text_encoder"}
        assert {"te_vision_patch_embed", "te_vision_merger", "te_vision_scatter", "te_prompt_extract"} <= te, te


@pytest.mark.parametrize("name,victim", [
    ("tiny-t2i-chain", "text_encoder/model.safetensors"), ("tiny-t2i-chain", "tokenizer/tokenizer.json"),
    ("tiny-t2i-chain", "vae/diffusion_pytorch_model.safetensors"), ("tiny-t2i-chain", "expected.png"),
    ("tiny-t2i-chain", "expected/ops.rank0.parquet"), ("tiny-t2i-chain", "fixture.json"),
    ("tiny-edit", "condition.png"), ("tiny-edit", "expected.png"), ("tiny-edit", "fixture.json"),
    ("tiny-edit", "text_encoder/model.safetensors"), ("tiny-edit", "processor/preprocessor_config.json"),
    ("tiny-edit", "tokenizer/tokenizer.json"), ("tiny-edit", "transformer/diffusion_pytorch_model.safetensors"),
])
def test_a_changed_byte_fails_with_one_line_naming_the_file(cli, tmp_path, name, victim):
    fx = _copy(name, tmp_path)
    _flip(fx / victim)
    code, out = cli("fixture", "verify", fx, "--workdir", tmp_path / "w")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == ExitCode.USAGE and len(lines) == 1, out
    assert lines[0].startswith("error:") and f"modified {victim}" in lines[0], out
    assert not (tmp_path / "w" / "replay").exists()  # nothing ran


def test_a_resealed_image_that_the_rerun_does_not_make_fails(cli, tmp_path):
    """Records identical, image not: exit 1 and a line naming the image (never a pass)."""
    fx = _copy("tiny-t2i-chain", tmp_path)
    _flip(fx / "expected.png", offset=-20)  # inside the IDAT data: still a file, another hash
    seal(fx)
    code, out = cli("fixture", "verify", fx, "--workdir", tmp_path / "w")
    assert code == ExitCode.DRIFT, out
    assert "IDENTICAL" in out and "image expected.png differs" in out, out


def test_a_resealed_text_encoder_weight_drifts_in_the_text_encoder(cli, tmp_path):
    """A changed weight the seal was re-made for: the re-run runs the text encoder anew, so the
    first drift is there, not in the stored embeddings the transformer stage reads."""
    fx = _copy("tiny-t2i-chain", tmp_path)
    weights = fx / "text_encoder" / "model.safetensors"
    _flip(weights, offset=len(weights.read_bytes()) - 3)  # a high byte of the last tensor
    seal(fx)
    code, out = cli("fixture", "verify", fx, "--workdir", tmp_path / "w", "--json")
    assert code == ExitCode.DRIFT, out
    first = json.loads(out)["report"]["first_drift"]
    assert first["component"] == "text_encoder" and first["op"].startswith("te_"), first


def test_a_resealed_vision_weight_drifts_in_the_vision_tower(cli, tmp_path):
    """tiny-edit's tower weight changed and the fixture re-sealed: the re-run encodes the prompt
    anew, so it drifts, and against a re-run of the unchanged fixture on this machine the first
    drift is the text encoder's vision tower, in the changed block. (tiny-edit is production
    arithmetic: against its stored records, on a machine of another CPU dispatch level than its
    build's, the re-run already drifts at the tower's first attention.)"""
    from safetensors.torch import load_file, save_file

    fx = _copy("tiny-edit", tmp_path)
    weights = fx / "text_encoder" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["visual.blocks.1.mlp.up_proj.weight"].view(-1)[5] += 0.25  # bf16, as stored
    save_file(tensors, str(weights))
    seal(fx)
    code, out = cli("fixture", "verify", fx, "--workdir", tmp_path / "w", "--json")
    assert code == ExitCode.DRIFT, out
    cli("fixture", "verify", "tiny-edit", "--workdir", tmp_path / "w0")  # the unchanged fixture, here
    code, out = cli("diff", tmp_path / "w0" / "replay", tmp_path / "w" / "replay", "--json")
    assert code == ExitCode.DRIFT, out
    first = json.loads(out)["first_drift"]
    assert (first["component"], first["block"], first["op"]) == ("text_encoder", 1, "te_vision_mlp_gate_up_silu"), first


def test_the_build_script_writes_the_committed_weights(tmp_path):
    """The build draws every weight from the portable Philox stream: rebuilding the model folders
    gives the committed bytes (the expected runs are re-made by ``build_chain`` itself)."""
    from drifttool.fixtures import build_chain

    build_chain.write_transformer(tmp_path)
    build_chain.write_text_encoder(tmp_path)
    build_chain.write_vae(tmp_path)
    for rel in ("transformer/diffusion_pytorch_model.safetensors", "transformer/config.json",
                "text_encoder/model.safetensors", "text_encoder/config.json", "tokenizer/tokenizer.json",
                "vae/diffusion_pytorch_model.safetensors", "vae/config.json"):
        assert (tmp_path / rel).read_bytes() == (locate("tiny-t2i-chain") / rel).read_bytes(), rel
    edit = tmp_path / "edit"
    build_chain.write_text_encoder(edit, vision=True)
    build_chain.write_scheduler(edit)
    for rel in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert (tmp_path / rel).read_bytes() == (locate("tiny-edit") / rel).read_bytes(), rel
    for rel in ("text_encoder/model.safetensors", "text_encoder/config.json", "tokenizer/tokenizer.json",
                "processor/preprocessor_config.json", "processor/tokenizer.json", "scheduler/scheduler_config.json"):
        assert (edit / rel).read_bytes() == (locate("tiny-edit") / rel).read_bytes(), rel
    import torch
    from safetensors.torch import load_file

    chain, tower = (load_file(str(locate(n) / "text_encoder" / "model.safetensors")) for n in ("tiny-t2i-chain", "tiny-edit"))
    assert {k for k in tower if not k.startswith("visual.")} == set(chain)  # the same language model
    assert all(tower[k].dtype == chain[k].dtype == torch.bfloat16
               and tower[k].view(torch.int16).equal(chain[k].view(torch.int16)) for k in chain)  # raw bytes


def test_a_production_fixture_says_when_it_runs_off_its_build_environment():
    """tiny-edit runs production kernels, whose CPU bytes depend on the dispatch level: a re-run
    on another level or torch names the difference; a strict fixture never gets the note."""
    from drifttool.verify import environment_note

    built = {"settings": {"mode": "auto"}, "environment": {"cpu_capability": "AVX512", "torch": "2.13.0+cpu",
                                                           "aten_cpu_capability_env": None}}
    here = {"environment": {"cpu_capability": "DEFAULT", "torch": "2.13.0+cpu", "aten_cpu_capability_env": "default"}}
    note = environment_note(built, here)
    assert note and "cpu_capability AVX512 → DEFAULT" in note and "torch" not in note.split(", and here ")[1]
    assert environment_note(built, built) is None
    assert environment_note({**built, "settings": {"mode": "strict"}}, here) is None


def test_a_production_fixture_names_other_cpu_matrix_extensions():
    """One dispatch level (AVX512), one with AMX: oneDNN's bf16 kernels differ, so the note names
    the extensions; a build without the record is compared by its CPU model."""
    from drifttool.verify import environment_note

    env = {"cpu_capability": "AVX512", "torch": "2.13.0+cpu", "aten_cpu_capability_env": None}
    built = {"settings": {"mode": "auto"}, "environment": {**env, "cpu": "AMD EPYC", "cpu_matrix": ["avx512_bf16"]}}
    amx = {"environment": {**env, "cpu": "AMD EPYC", "cpu_matrix": ["amx_bf16", "amx_tile", "avx512_bf16"]}}
    note = environment_note(built, amx)
    assert note and "cpu_matrix ['avx512_bf16'] → ['amx_bf16', 'amx_tile', 'avx512_bf16']" in note, note
    assert environment_note(built, {"environment": {**env, "cpu": "Intel Xeon", "cpu_matrix": ["avx512_bf16"]}}) is None
    older = {"settings": {"mode": "auto"}, "environment": {**env, "cpu": "AMD EPYC"}}
    assert "cpu AMD EPYC → Intel Xeon" in environment_note(older, {"environment": {**env, "cpu": "Intel Xeon"}})
    assert environment_note(older, {"environment": {**env, "cpu": "AMD EPYC", "cpu_matrix": []}}) is None


def test_a_chain_fixture_verifies_from_an_archive(cli, tmp_path):
    """The archive is extracted to a temporary pipeline folder the whole chain runs from."""
    import tarfile

    arc = tmp_path / "chain.tar.gz"
    with tarfile.open(arc, "w:gz") as tar:
        tar.add(_copy("tiny-t2i-chain", tmp_path), arcname="tiny-t2i-chain")
    code, out = cli("fixture", "verify", arc, "--json")
    assert code == ExitCode.OK, out
    assert json.loads(out)["images"][0]["equal"], out


@pytest.mark.parametrize("change,expect", [
    ({"prompts": "make it blue"}, "'edit' 'prompts' must be a list of texts"),
    ({"prompts": None, "negative_prompts": ["cat"]}, "'negative_prompts' without 'prompts'"),
    ({"prompt_positions": 3}, "'prompt_positions' must be a name"),
    ({"prompt_positions": "3d"}, "positions '3d'"),
    ({"condition_images": ["../condition.png"]}, "'edit' needs 'condition_images'"),
])
def test_a_malformed_edit_section_is_one_line(cli, tmp_path, change, expect):
    """A sealed fixture whose ``edit`` section the re-run cannot take: exit 2, one line."""
    fx = _copy("tiny-edit", tmp_path)
    meta = json.loads((fx / "fixture.json").read_text())
    meta["edit"] = {k: v for k, v in {**meta["edit"], **change}.items() if v is not None}
    (fx / "fixture.json").write_text(json.dumps(meta))
    seal(fx)
    code, out = cli("fixture", "verify", fx, "--workdir", tmp_path / "w")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == ExitCode.USAGE and len(lines) == 1 and expect in lines[0], out


def test_verify_prints_its_environment_note_on_stderr(monkeypatch, tmp_path):
    """The note is a diagnostic, not a result: stderr, as every note (stdout keeps the report)."""
    from typer.testing import CliRunner

    import drifttool.verify as verify
    from drifttool.cli.app import app

    monkeypatch.setattr(verify, "environment_note", lambda expected, replay: "a planted environment note")
    res = CliRunner().invoke(app, ["fixture", "verify", "--workdir", str(tmp_path / "w")])
    assert res.exit_code == 0, res.output
    assert "note: a planted environment note" in res.stderr and "planted" not in res.stdout, res.output
