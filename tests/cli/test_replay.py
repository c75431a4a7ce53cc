"""``drifttool replay``, ``drifttool recompute`` and ``drifttool experiment``: end to end, and bad
input (incomplete or tampered artifact, foreign model, LoRA file with wrong keys) → exit 2."""

from __future__ import annotations

import json
import re
import shutil

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from drifttool.runner import execute

from drifttool.settings import RunSpec
from tests.artifact.table_files import rewrite_table
from tests.conftest import fixture_copy


def _clean_error(code, out, *needles):
    assert code == 2, out
    assert "Traceback" not in out, out
    flat = " ".join(out.split())
    for n in needles:
        assert n in flat, out


def test_replay_is_identical(cli, tmp_path, strict_run):
    code, out = cli("replay", strict_run, "-o", tmp_path / "replay")
    assert code == 0, out
    manifest = json.loads((tmp_path / "replay" / "manifest.json").read_text())
    assert manifest["replay_of"]["path"] == str(strict_run) and manifest["kind"] == "rollout"
    code, out = cli("diff", strict_run, tmp_path / "replay")
    assert code == 0 and "IDENTICAL" in out, out


def _table(out: str) -> dict[str, str]:
    """The rows of a summary table (``│ key │ value │``) as a dict."""
    cells = [[c.strip() for c in ln.strip("│ ").split("│")] for ln in out.splitlines() if ln.startswith("│")]
    return {c[0]: c[1] for c in cells if len(c) == 2}


SETTINGS = ("fixture", "dtype", "cfg_scale", "eta", "seed", "img_grid", "cfg_layout")


def test_replay_and_recompute_tables_show_the_rollouts_settings_and_adapter_mode(cli, tmp_path, strict_run):
    """``replay`` and ``recompute`` show the rollout's settings as ``run`` does, ``lora_mode``
    included when it ran with an adapter (the mode the replay and trainer load it in), and no
    ``lora_mode`` row without one."""
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora
    from drifttool.fixture import locate

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=4, init_b_std=0.05)
    save_lora(m, tmp_path / "ad")
    code, out = cli("run", "-o", tmp_path / "a", "--steps", "2", "--lora", tmp_path / "ad",
                    "--lora-mode", "unfused-fp32")
    assert code == 0, out
    ran = _table(out)
    assert ran["lora_mode"] == "unfused-fp32", out
    for cmd in ("replay", "recompute"):
        code, out = cli(cmd, tmp_path / "a", "-o", tmp_path / cmd)
        assert code == 0, out
        rows = _table(out)
        assert {k: rows.get(k) for k in (*SETTINGS, "lora_mode")} == {k: ran[k] for k in (*SETTINGS, "lora_mode")}, out
        assert out.count("cfg_layout") == 1, out
        code, out = cli(cmd, strict_run, "-o", tmp_path / f"{cmd}-plain")
        assert code == 0 and "lora_mode" not in _table(out) and _table(out)["fixture"] == "tiny-t2i", out
    assert json.loads((tmp_path / "replay" / "manifest.json").read_text())["lora"]["mode"] == "unfused-fp32"


def test_recompute_and_diff(cli, tmp_path, strict_run):
    code, out = cli("recompute", strict_run, "-o", tmp_path / "train")
    assert code == 0 and "sigma_fp32" in out and "float32" in out, out
    code, out = cli("diff", strict_run, tmp_path / "train")
    assert code == 0 and "IDENTICAL" in out and "training recompute" in out, out
    code, out = cli("recompute", strict_run, "-o", tmp_path / "prod", "--mode", "auto")
    assert code == 0, out
    code, out = cli("diff", strict_run, tmp_path / "prod")
    assert code == 1 and "DRIFT" in out, out
    assert "first drift at rollout step 0 cond before block 0 timestep_embed_mlp#0 sample 0" in " ".join(out.split())


def test_recompute_bad_input(cli, tmp_path, strict_run):
    execute(RunSpec(), tmp_path / "cut", max_steps=1)
    _clean_error(*cli("recompute", tmp_path / "cut", "-o", tmp_path / "t1"), "incomplete")

    bad = tmp_path / "tampered"
    shutil.copytree(strict_run, bad)

    def zero_x3(table):
        rows = table.to_pylist()
        r = next(r for r in rows if r["quantity"] == "x_t" and r["step"] == 3)
        r["data"] = bytes(len(r["data"]))
        return pa.Table.from_pylist(rows, schema=table.schema)

    rewrite_table(bad / "steps.rank0.parquet", zero_x3)  # the file's digest re-recorded
    _clean_error(*cli("recompute", bad, "-o", tmp_path / "t2"), "tampered")

    from drifttool.model.checkpoint import save_checkpoint
    from drifttool.model.config import tiny
    from drifttool.model.mmdit import MMDiT, random_init_

    save_checkpoint(random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=5), tmp_path / "other")
    _clean_error(*cli("recompute", strict_run, "-o", tmp_path / "t3", "--checkpoint", tmp_path / "other"),
                 "fingerprint differs", "weights")
    _clean_error(*cli("replay", strict_run, "-o", tmp_path / "t4", "--checkpoint", tmp_path / "other"),
                 "fingerprint differs")

    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32),
               "transformer_blocks.0.attn.to_k.lora_B.weight": torch.zeros(32, 4),
               "transformer_blocks.0.attn.nope.lora_A.weight": torch.zeros(4, 32)},
              str(tmp_path / "wrong.safetensors"))
    _clean_error(*cli("recompute", strict_run, "-o", tmp_path / "t5", "--lora", tmp_path / "wrong.safetensors"),
                 "does not match the model", "missing keys", "unexpected keys")
    _clean_error(*cli("run", "-o", tmp_path / "t6", "--lora", tmp_path / "wrong.safetensors"),
                 "does not match the model")
    _clean_error(*cli("replay", tmp_path / "nowhere", "-o", tmp_path / "t7"), "nowhere")
    _clean_error(*cli("recompute", strict_run, "-o", tmp_path / "t8", "--grad"), "LoRA")


# the four cells in one process (about 12 s); tests/probes/test_clip_range.py and
# tests/cli/test_train_rollout_model.py run the command in the default suite
@pytest.mark.slow
def test_experiment_train_rollout(cli, tmp_path):
    code, out = cli("experiment", "train-rollout", "-o", tmp_path / "exp", "--no-grad")
    assert code == 0, out
    rows = json.loads((tmp_path / "exp" / "train_rollout.json").read_text())
    table = pa.ipc.open_stream(open(tmp_path / "exp" / "train_rollout.arrow", "rb")).read_all()
    assert table.column("combo").to_pylist() == [r["combo"] for r in rows] == [
        "production/production", "strict/production", "production/strict", "strict/strict"]
    by = {r["combo"]: r for r in rows}
    ss = by.pop("strict/strict")
    assert ss["identical"] and ss["v_max_abs"] == ss["logp_max_abs"] == ss["kl_max"] == 0.0
    assert ss["first_drift"] == "" and ss["grad_rel_l2"] == "nan"  # --no-grad (JSON spells NaN "nan")
    for combo, r in by.items():  # the other three show their drift
        assert r["verdict"] == "drift" and r["v_max_abs"] > 0 and r["logp_max_abs"] > 0, combo
        assert r["kl_max"] > 0 and r["first_drift"].startswith("rollout step 0"), combo
        assert r["train_seconds"] > 0 and r["rollout_seconds"] > 0
    assert by["strict/production"]["first_drift_op"] == "timestep_embed_mlp"
    assert by["production/production"]["first_drift_op"] == "joint_attention_fused"
    flat = " ".join(out.split())
    assert "strict/strict" in flat and "identical" in flat and "train_rollout.arrow" in "".join(out.split())
    assert "timestep_embed_mlp" in flat and "joint_attention_fused" in flat
    hint = re.search(r"e\.g\. prod/prod: drifttool diff (\S+) (\S+)\)", out)  # folders, not labels
    assert hint and cli("diff", hint[1], hint[2])[0] == 1, out
    code, out = cli("diff", tmp_path / "exp" / "rollout-strict", tmp_path / "exp" / "train-strict-on-strict")
    assert code == 0, out


def test_experiment_grpo(cli, tmp_path):
    code, out = cli("experiment", "grpo", "-o", tmp_path / "g", "--combos", "production/production",
                    "--steps", "1", "--inner-epochs", "1", "--groups", "1")
    assert code == 0, out
    rows = json.loads((tmp_path / "g" / "grpo.json").read_text())
    assert len(rows) == 1 and rows[0]["combo"] == "production/production"
    assert {"ratio_mean", "clip_fraction", "approx_kl", "kl", "reward_mean"} <= set(rows[0])
    assert (tmp_path / "g" / "grpo.arrow").is_file()
    code, out = cli("experiment", "grpo", "-o", tmp_path / "g2", "--combos", "strict/fast")
    assert code == 2 and "strict/fast" in out


def _edit_manifest(run, edit):
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))


def _truncate(name, keep):
    def damage(run):
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: int(len(data) * keep)])
    return damage


SOURCE_DAMAGES = {
    "truncated steps": _truncate("steps.rank0.parquet", 0.9),
    "truncated ops": _truncate("ops.rank0.parquet", 0.5),
    "missing ops": lambda run: (run / "ops.rank0.parquet").unlink(),
    "settings.cfg_layout invalid": lambda run: _edit_manifest(
        run, lambda m: m["settings"].update(cfg_layout="b`tched")),
    "kind recompute on a rollout": lambda run: _edit_manifest(run, lambda m: m.update(kind="recompute")),
    "capture_level lowered to L0": lambda run: _edit_manifest(run, lambda m: m.update(capture_level="L0")),
    "fingerprint deleted": lambda run: _edit_manifest(run, lambda m: m.pop("fingerprint")),
    "replay.noise key renamed": lambda run: _edit_manifest(
        run, lambda m: m["replay"]["noise"].update({"generator^device": m["replay"]["noise"].pop(
            "generator_device")})),
}


def _snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("name", sorted(SOURCE_DAMAGES))
@pytest.mark.parametrize("command", ["replay", "recompute"])
def test_damaged_source_is_refused_before_anything_is_written(cli, tmp_path, strict_run, command,
                                                              name):
    """``replay`` and ``recompute`` read and check every file of the source (``Run.check``)
    before re-executing it: a damaged source is one line, exit 2, no output directory, the
    source unchanged (a truncated steps or ops file used to replay with exit 0)."""
    src = tmp_path / "src"
    shutil.copytree(strict_run, src)
    SOURCE_DAMAGES[name](src)
    before = _snapshot(src)
    code, out = cli(command, src, "-o", tmp_path / "out")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), out
    assert "Traceback" not in out and str(src) in " ".join(out.split()), out
    assert not (tmp_path / "out").exists(), "wrote an output for a damaged source"
    assert _snapshot(src) == before


def test_replay_of_a_run_naming_no_sample_names_no_flag_it_lacks(cli, tmp_path, strict_run):
    """A manifest whose settings.samples is empty: replay asked for '--samples 0,1 or --batch N',
    flags it does not have; the manifest is named, corrupt."""
    src = tmp_path / "src"
    shutil.copytree(strict_run, src)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["settings"]["samples"] = []
    (src / "manifest.json").write_text(json.dumps(manifest))
    code, out = cli("replay", src, "-o", tmp_path / "out")
    _clean_error(code, out, f"{src / 'manifest.json'}: corrupt manifest (settings.samples is empty")
    assert "--" not in out and not (tmp_path / "out").exists(), out


def _fixture_copy(tmp_path, name, **settings):
    return fixture_copy(tmp_path / f"{name}-copy", name, **settings)


@pytest.mark.parametrize("fixture,needle", [
    ("tiny-t2i-chain", "a chain fixture, whose prompts are texts its pipeline encodes; the experiment runs "
                       "a fixture of prompt embeddings"),
    ("tiny-edit", "an edit fixture, whose prompts are texts its pipeline encodes"),
    ("preset", "its preset 'flow-grpo' reproduces a production pipeline's arithmetic, which the "
               "experiment's strict sides cannot run"),
    ("no eta", "its settings lack eta, which the experiment takes from its fixture"),
])
def test_experiment_refuses_a_fixture_it_cannot_run_naming_no_flag_it_lacks(cli, tmp_path, fixture, needle):
    """``experiment train-rollout --fixture``: a chain or edit fixture, one with a preset, one
    lacking a setting the experiment has no option for were refused in ``drifttool run``'s words
    ('give --prompt-embeds', 'use --mode auto or off', 'give --eta')."""
    copies = {"preset": {"preset": "flow-grpo"}, "no eta": {"eta": None}}
    name = _fixture_copy(tmp_path, "tiny-t2i", **copies[fixture]) if fixture in copies else fixture
    code, out = cli("experiment", "train-rollout", "--fixture", name, "-o", tmp_path / "exp")
    _clean_error(code, out, needle)
    assert len(out.strip().splitlines()) == 1, out
    assert not re.search(r"--(?!fixture)[a-z]", out), out
    assert not (tmp_path / "exp").exists()
