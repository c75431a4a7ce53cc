"""Bad input: a clear one-line error and exit 2, never a traceback (issue 2 "Bad input")."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from drifttool.cli.app import app
from drifttool.fixture import locate
from drifttool.runner import execute
from drifttool.settings import RunSpec


def _assert_clean_error(code, out, *needles):
    assert code == 2, out
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, out


def test_missing_run_dir(cli, tmp_path, strict_run):
    _assert_clean_error(*cli("diff", tmp_path / "nope", strict_run), "nope")


def test_corrupt_manifest(cli, tmp_path, strict_run):
    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)
    (bad / "manifest.json").write_text("{not json")
    _assert_clean_error(*cli("diff", strict_run, bad), "manifest")


def test_unknown_schema_version(cli, tmp_path, strict_run):
    bad = tmp_path / "future"
    shutil.copytree(strict_run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["schema_version"] = 999
    (bad / "manifest.json").write_text(json.dumps(m))
    _assert_clean_error(*cli("diff", strict_run, bad), "999")


def test_truncated_arrow_in_complete_run(cli, tmp_path, strict_run):
    bad = tmp_path / "cut"
    shutil.copytree(strict_run, bad)
    data = (bad / "ops.rank0.parquet").read_bytes()
    (bad / "ops.rank0.parquet").write_bytes(data[: len(data) // 2])
    _assert_clean_error(*cli("diff", strict_run, bad), "ops.rank0.parquet")


def test_incomparable_architecture_names_the_field(cli, tmp_path, strict_run):
    from drifttool.model.checkpoint import load_checkpoint, save_checkpoint
    from drifttool.model.config import MMDiTConfig
    from drifttool.model.mmdit import MMDiT, random_init_

    base = load_checkpoint(locate("tiny-t2i") / "transformer")
    cfg = MMDiTConfig(**{**base.config.__dict__, "num_layers": 3})
    with torch.no_grad():
        save_checkpoint(random_init_(MMDiT(cfg, dtype=torch.bfloat16), seed=1), tmp_path / "deep")
    assert cli("run", "--checkpoint", tmp_path / "deep", "-o", tmp_path / "r")[0] == 0
    code, out = cli("diff", strict_run, tmp_path / "r")
    assert code == 3 and "INCOMPARABLE" in out.upper() and "num_layers" in out, out


def test_checkpoint_with_wrong_keys_and_shapes(cli, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(locate("tiny-t2i") / "transformer", ck)
    f = ck / "diffusion_pytorch_model.safetensors"
    t = load_file(str(f))
    t["img_in.weight"] = t["img_in.weight"][:, :10].contiguous()  # wrong shape
    t["bogus.weight"] = torch.zeros(1)  # unexpected
    del t["proj_out.bias"]  # missing
    save_file(t, str(f))
    _assert_clean_error(*cli("run", "--checkpoint", ck, "-o", tmp_path / "r"),
                        "img_in.weight", "bogus.weight", "proj_out.bias")


def test_nan_in_inputs_is_reported(cli, tmp_path):
    fx = tmp_path / "fx"
    shutil.copytree(locate("tiny-t2i"), fx)
    t = load_file(str(fx / "prompts.safetensors"))
    t["txt"][0, 2, 5] = float("nan")
    save_file(t, str(fx / "prompts.safetensors"))
    _assert_clean_error(*cli("run", "--fixture", fx, "-o", tmp_path / "r"), "non-finite", "txt")


def _no_neg_len(t):
    del t["neg_len"]


def _lengths_2d(t):
    t["txt_len"] = t["txt_len"][:, None].contiguous()


def _one_length_short(t):
    t["txt_len"] = t["txt_len"][:-1].contiguous()


def _integer_embeddings(t):
    t["txt"] = t["txt"].long()


def _length_past_slots(t):
    t["txt_len"][1] = t["txt"].shape[1] + 1


def _negative_length(t):
    t["txt_len"][0] = -1


def _no_prompts(t):
    t["txt"], t["txt_len"] = t["txt"][:0].contiguous(), t["txt_len"][:0].contiguous()


def _nan_embedding(t):
    t["txt"][0, 2, 5] = float("nan")


def _extra_tensor(t):
    t["foo"] = torch.zeros(1)


def _bf16_inf(t):
    t["neg_txt"] = t["neg_txt"].bfloat16()
    t["neg_txt"][0, 1, 3] = float("-inf")


@pytest.mark.parametrize("damage,needle", [
    (None, "unreadable"), (_no_neg_len, "lacks neg_len"), (_lengths_2d, "txt_len is I64 (4, 1)"),
    (_one_length_short, "txt_len 3 length(s)"), (_integer_embeddings, "txt is I64"),
    (_length_past_slots, "lengths out of range"), (_negative_length, "lengths out of range"),
    (_no_prompts, "txt holds 0 prompt(s)"), (_nan_embedding, "txt holds 1 non-finite value(s)"),
    (_extra_tensor, "holds foo, which no fixture has"), (_bf16_inf, "neg_txt holds 1 non-finite value(s)"),
], ids=["garbage", "a tensor missing", "lengths 2-D", "a length short", "integer embeddings", "a length past its slots",
        "a negative length", "no prompts", "a NaN embedding", "an extra tensor", "a bf16 -inf"])
def test_damaged_prompt_embeddings_are_named_by_their_file(cli, tmp_path, damage, needle):
    """A fixture's prompts.safetensors that is not one (garbage bytes, a tensor missing, extra or
    of another shape or type, lengths past their slots or negative, no prompt, a NaN): one line
    naming that file, from ``run --fixture`` and ``fixture seal`` alike (seal blamed fixture.json
    and named the fixture twice; a missing tensor, a length past its slots or no prompt was an
    internal error). ``fixture verify`` finds the file edited and says what ``fixture seal
    --rebuild`` would refuse, never offering it."""
    fx = tmp_path / "fx"
    shutil.copytree(locate("tiny-t2i"), fx)
    f = fx / "prompts.safetensors"
    if damage is None:
        f.write_bytes(b"not a safetensors file")
    else:
        t = load_file(str(f))
        damage(t)
        save_file(t, str(f))
    for args in (("run", "--fixture", fx, "-o", tmp_path / "r"), ("fixture", "seal", fx)):
        code, out = cli(*args)
        _assert_clean_error(code, out, f"{f}: ", needle)
        assert "fixture.json" not in out and out.count(str(fx)) == 1, out
    code, out = cli("fixture", "verify", fx)
    _assert_clean_error(code, out, "modified prompts.safetensors", "would refuse it as it is", f"{f}: ", needle)


def test_nan_in_weights_is_reported(cli, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(locate("tiny-t2i") / "transformer", ck)
    f = ck / "diffusion_pytorch_model.safetensors"
    t = load_file(str(f))
    t["transformer_blocks.1.attn.to_q.weight"][3, 4] = float("nan")
    save_file(t, str(f))
    _assert_clean_error(*cli("run", "--checkpoint", ck, "-o", tmp_path / "r"), "to_q.weight")


def test_bad_settings(cli, tmp_path):
    _assert_clean_error(*cli("run", "--mode", "fast", "-o", tmp_path / "r"), "mode")
    _assert_clean_error(*cli("run", "--dtype", "float16", "-o", tmp_path / "r2"), "float16")
    _assert_clean_error(*cli("run", "--fixture", "no-such-fixture", "-o", tmp_path / "r3"), "no-such-fixture")
    code, out = cli("run", "--samples", "1,x", "-o", tmp_path / "r4")
    assert code == 2 and "Traceback" not in out
    for bad in ("0,,1", "0,1,"):  # an empty entry is a typo, not a shorter list
        _assert_clean_error(*cli("run", "--samples", bad, "-o", tmp_path / "r5"), "an empty entry")
    _assert_clean_error(*cli("run", "--samples", " ", "-o", tmp_path / "r6"), "no sample ids")


def test_output_dir_not_empty(cli, tmp_path, strict_run):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    _assert_clean_error(*cli("run", "-o", tmp_path / "full"), "not empty")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_interrupted_run_keeps_finished_steps_and_diff_is_inconclusive(cli, tmp_path, strict_run):
    class Crash(RuntimeError):
        pass

    def crash_after_two(step_out):
        if step_out.step == 1:
            raise Crash("simulated crash")

    with pytest.raises(Crash):
        execute(RunSpec(), tmp_path / "cut", on_step=crash_after_two)
    m = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert m["complete"] is False
    from drifttool.artifact.reader import open_run

    steps = open_run(tmp_path / "cut").steps_table()
    assert sorted(set(steps.column("step").to_pylist())) == [0, 1]
    assert open_run(tmp_path / "cut").trace_rows(), "the trace so far is kept"
    code, out = cli("diff", strict_run, tmp_path / "cut", "--json")
    assert code == 3, out
    rep = json.loads(out)
    assert rep["verdict"] == "inconclusive"


def test_tampered_fixture_fails_verification(cli, tmp_path):
    fx = tmp_path / "fx"
    shutil.copytree(locate("tiny-t2i"), fx)
    meta = json.loads((fx / "fixture.json").read_text())
    meta["settings"]["eta"] = 1.0
    (fx / "fixture.json").write_text(json.dumps(meta))
    _assert_clean_error(*cli("fixture", "verify", fx), "modified fixture.json")


def test_fixture_archive_cannot_escape_target(cli, tmp_path):
    import io
    import tarfile

    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        data = b"pwned"
        info = tarfile.TarInfo("../../escaped.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    code, out = cli("fixture", "verify", evil)
    assert code == 2 and "Traceback" not in out, out
    assert not (tmp_path.parent / "escaped.txt").exists()


def test_overwrite_never_deletes_foreign_files(cli, tmp_path, strict_run):
    app_dir = tmp_path / "webapp"
    (app_dir / "src").mkdir(parents=True)
    (app_dir / "manifest.json").write_text('{"name": "app"}')
    (app_dir / "src" / "main.js").write_text("keep me")
    _assert_clean_error(*cli("run", "--overwrite", "-o", app_dir), "no drifttool run")
    code, out = cli("run", "-o", app_dir)  # without --overwrite: no hint that it would help
    _assert_clean_error(code, out, "holds no drifttool run (choose an empty or new directory)")
    assert "--overwrite" not in out
    assert (app_dir / "src" / "main.js").read_text() == "keep me"
    run = tmp_path / "run"
    shutil.copytree(strict_run, run)
    (run / "mynotes.txt").write_text("mine")
    _assert_clean_error(*cli("run", "--overwrite", "-o", run), "mynotes.txt")
    assert (run / "mynotes.txt").exists()
    (run / "mynotes.txt").unlink()
    code, out = cli("run", "--overwrite", "--steps", "2", "-o", run)
    assert code == 0, out


@pytest.mark.parametrize("args,needle", [
    (("--cfg-scale", "nan"), "cfg_scale"),
    (("--eta", "inf"), "eta"),
    (("--cfg-layout", "foo"), "cfg_layout"),
    (("--batch", "3", "--samples", "0"), "either"),
])
def test_bad_run_values(cli, tmp_path, args, needle):
    _assert_clean_error(*cli("run", *args, "-o", tmp_path / "r"), needle)


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.update(fingerprint="garbage"), "fingerprint"),
    (lambda m: m["files"].update(ops=[None]), "files.ops"),
    (lambda m: m["files"].update(ops=["../other/ops.rank0.arrow"]), "files.ops"),
    (lambda m: m["files"].update(steps=5), "files.steps"),
    (lambda m: m.update(files=None), "files"),
])
def test_hand_damaged_manifest_is_refused(cli, tmp_path, strict_run, edit, needle):
    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    edit(m)
    (bad / "manifest.json").write_text(json.dumps(m))
    _assert_clean_error(*cli("diff", strict_run, bad), needle)


def _one_line(code, out, *needles):
    _assert_clean_error(code, out, *needles)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out


@pytest.mark.parametrize("key,value", [
    ("img_grid", "x"), ("img_grid", [0]), ("img_grid", [-1, 4]), ("img_grid", [1, 2, 3]),
    ("img_grid", [4.0, 6]), ("img_grid", [True, 6]), ("num_layers", "2"), ("num_layers", 0),
    ("axes_dims_rope", [4, 6]), ("axes_dims_rope", [4, -6, 6]), ("eps", 0), ("eps", "1e-6"),
    ("inner_dim", None),
])
def test_corrupt_arch_field_is_a_corrupt_manifest(cli, tmp_path, strict_run, key, value):
    """A hand-damaged ``fingerprint.arch`` field is refused as a corrupt manifest (one line,
    exit 2), on either side of the diff, not read as an incomparable architecture."""
    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["fingerprint"]["arch"][key] = value
    (bad / "manifest.json").write_text(json.dumps(m))
    for a, b in ((strict_run, bad), (bad, strict_run)):
        _one_line(*cli("diff", a, b), "corrupt manifest", f"fingerprint.arch.{key}")


def test_corrupt_settings_grid_is_a_corrupt_manifest(cli, tmp_path, strict_run):
    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["settings"]["img_grid"] = [4, 0]
    (bad / "manifest.json").write_text(json.dumps(m))
    _one_line(*cli("diff", strict_run, bad), "corrupt manifest", "settings.img_grid[1]")


def test_binary_manifest_says_it_is_not_utf8_json(cli, tmp_path, strict_run):
    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)
    text = (strict_run / "manifest.json").read_bytes()
    for garbage, offset in ((bytes(range(256)) * 4, 128), (b"\x00\xd8" * 64, 1),
                            (text[:40] + b"\xff" + text[40:], 40)):
        (bad / "manifest.json").write_bytes(garbage)
        code, out = cli("diff", strict_run, bad)
        _one_line(code, out, "corrupt manifest", "not UTF-8", f"at offset {offset} ")
        assert "UnicodeDecodeError" not in out and "utf-16" not in out, out
    (bad / "manifest.json").write_bytes(b"\xef\xbb\xbf" + text)  # a BOM is ignored, as JSON allows
    assert cli("diff", strict_run, bad)[0] == 0


def test_diff_on_a_file_says_so(cli, tmp_path, strict_run):
    f = tmp_path / "afile"
    f.write_text("x")
    _assert_clean_error(*cli("diff", f, strict_run), "is a file")


def test_mode_off_run_is_named_in_the_diff(cli, tmp_path, strict_run):
    code, out = cli("run", "--mode", "off", "-o", tmp_path / "off")
    assert code == 0 and "captures nothing" in out
    code, out = cli("diff", strict_run, tmp_path / "off")
    assert code == 3 and "--mode off" in out, out


def test_piped_diff_keeps_its_exit_code(tmp_path, strict_run):
    import subprocess
    import sys

    cmd = f"{sys.executable} -m drifttool.cli.app diff {strict_run} {strict_run} | head -1; exit ${{PIPESTATUS[0]}}"
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "IDENTICAL" in res.stdout


def test_version(cli):
    import drifttool

    code, out = cli("--version")
    assert code == 0 and drifttool.__version__ in out


def test_replay_and_recompute_refuse_to_overwrite_their_source(cli, tmp_path, strict_run):
    src = tmp_path / "src"
    shutil.copytree(strict_run, src)
    before = (src / "manifest.json").read_text()
    for cmd in ("replay", "recompute"):
        _assert_clean_error(*cli(cmd, src, "-o", tmp_path / "x" / ".." / "src", "--overwrite"), "source run")
    assert (src / "manifest.json").read_text() == before


def test_probe_output_dir_is_not_clobbered(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _assert_clean_error(*cli("probe", "--only", "repeat", "-o", mine), "no probe matrix")
    assert (mine / "notes.txt").read_text() == "keep"


def test_overlay_needs_a_figure_name(cli, tmp_path, strict_run):
    _assert_clean_error(*cli("overlay", strict_run, strict_run, "-o", tmp_path / "fig.txt"), ".png")


def test_step_bytes_tampered_under_a_kept_digest_are_caught(cli, tmp_path, strict_run):
    import pyarrow as pa

    from tests.artifact.table_files import rewrite_table

    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)

    def flip(table):
        data = table.column("data").to_pylist()
        b = bytearray(data[3])
        b[0] ^= 1  # one bit of one latent, digest left as it was
        data[3] = bytes(b)
        i = table.schema.get_field_index("data")
        return table.set_column(i, table.schema.field("data"),
                                pa.array(data, type=table.schema.field("data").type))

    rewrite_table(bad / "steps.rank0.parquet", flip)  # the file's digest re-recorded
    _assert_clean_error(*cli("diff", strict_run, bad), f"{bad / 'steps.rank0.parquet'}: the bytes",
                        "do not match their digest")


def test_error_naming_a_path_with_markup_is_one_plain_line(cli, tmp_path, strict_run):
    weird = tmp_path / "runs[/]x[bold]"
    weird.mkdir(parents=True)
    code, out = cli("diff", weird, strict_run)
    _assert_clean_error(code, out, "runs[/]x[bold]", "missing manifest.json")
    assert len(out.strip().splitlines()) == 1, out


def test_commands_other_than_run_refuse_torchrun_ranks(tmp_path, monkeypatch):
    """Under torchrun only `run`, `replay`, `recompute` and `probe` lay runs out on ranks: every
    other command refuses in one line (rank > 0 names its rank) instead of racing the other
    ranks for the same output."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, args, name in (("0", ["overlay", str(tmp_path / "a"), str(tmp_path / "b"), "-o",
                                    str(tmp_path / "b.png")], "overlay"),
                             ("1", ["fixture", "verify"], "fixture verify"),
                             ("1", ["diff", str(tmp_path / "a"), str(tmp_path / "b")], "diff")):
        monkeypatch.setenv("RANK", rank)
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, r.output
        prefix = f"[rank {rank}] "
        assert f"error: {prefix}drifttool {name} runs in one process" in r.output.replace("\n", " ")
    assert not (tmp_path / "b").exists()


def test_fixture_verify_refuses_an_artifact_as_workdir(tmp_path):
    execute(RunSpec(capture="L0"), tmp_path / "a")
    r = CliRunner().invoke(app, ["fixture", "verify", "--workdir", str(tmp_path / "a")])
    assert r.exit_code == 2 and "is a drifttool artifact" in r.output
    assert not (tmp_path / "a" / "replay").exists()


@pytest.mark.parametrize("held", ["run", "files"])
def test_fixture_verify_replaces_only_its_own_replay_in_workdir(cli, tmp_path, monkeypatch, held):
    """``--workdir DIR`` re-runs into ``DIR/replay``: a run or files there that ``fixture verify``
    did not write are refused in one line naming the path and what to do, before any work, and
    stay as they were (they were replaced); its own earlier re-run is replaced."""
    import drifttool.verify

    work = tmp_path / "w"
    if held == "run":
        execute(RunSpec(capture="L0"), work / "replay")
    else:
        (work / "replay").mkdir(parents=True)
        (work / "replay" / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in (work / "replay").iterdir()}
    with monkeypatch.context() as m:  # any work (the seal's check first) is an internal error
        m.setattr(drifttool.verify, "extracted", lambda *a: pytest.fail("worked before refusing"))
        code, out = cli("fixture", "verify", "--workdir", work)
    _assert_clean_error(code, out, f"--workdir {work}: {work / 'replay'}, where the re-run goes, holds",
                        "did not write; give another --workdir, or move")
    assert len(out.strip().splitlines()) == 1, out
    assert {p.name: p.read_bytes() for p in (work / "replay").iterdir()} == before
    assert sorted(p.name for p in work.iterdir()) == ["replay"]
    own = tmp_path / "own"
    for _ in range(2):  # the second replaces the first's re-run
        code, out = cli("fixture", "verify", "--workdir", own)
        assert code == 0 and f"replay in {own / 'replay'}" in out, out


def _user_replay_run(work):
    shutil.rmtree(work / "replay")
    execute(RunSpec(capture="L0"), work / "replay")  # a run of the user's, where verify's was


def _user_file_in_replay(work):
    (work / "replay" / "notes.txt").write_text("mine")


def _link_as_replay(work):
    execute(RunSpec(capture="L0"), work.parent / "elsewhere")
    shutil.rmtree(work / "replay")
    (work / "replay").symlink_to(work.parent / "elsewhere")


def _file_as_replay(work):
    shutil.rmtree(work / "replay")
    (work / "replay").write_text("mine")


@pytest.mark.parametrize("damage,needle", [
    (_user_replay_run, "holds a drifttool run that"),
    (_user_file_in_replay, "also holds notes.txt that"),
    (_link_as_replay, "is a link that"),
    (_file_as_replay, "is a file that"),
    (lambda w: (w / "replay.png").write_bytes(b"\x89PNG mine"), "replay.png, where a re-run's decoded image goes, is a file"),
    (lambda w: (w / "fixture-verify.json").write_text("my notes"), "fixture-verify.json is not what"),
], ids=["run", "file-inside", "link", "file", "image", "mark"])
def test_fixture_verify_replaces_its_own_replay_only_while_it_is_unchanged(cli, tmp_path, damage, needle):
    """``--workdir`` records what its re-run wrote (``fixture-verify.json``): a run, file, link or
    image the user put there since is refused in one line, before any work, and stays as it was,
    the record too (a refused verify marks nothing)."""
    work = tmp_path / "w"
    assert cli("fixture", "verify", "--workdir", work)[0] == 0
    damage(work)
    before = {p: (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in sorted(work.rglob("*"))}
    code, out = cli("fixture", "verify", "--workdir", work)
    _assert_clean_error(code, out, f"--workdir {work}: ", needle)
    assert len(out.strip().splitlines()) == 1, out
    assert {p: (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in sorted(work.rglob("*"))} == before


@pytest.mark.parametrize("args", [("run", "-o", "{fx}/runs/a"), ("run", "-o", "{fx}"),
                                  ("experiment", "train-rollout", "-o", "{fx}/x")], ids=["run", "run-fixture", "experiment"])
def test_nothing_is_written_inside_a_sealed_fixture(cli, tmp_path, args):
    """A run or an experiment's folder inside a sealed fixture would break its seal (the next
    ``fixture verify`` of it failed): refused in one line, nothing written."""
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    before = sorted(p.relative_to(fx) for p in fx.rglob("*"))
    code, out = cli(*[a.format(fx=fx) for a in args])
    _assert_clean_error(code, out, f"inside the sealed fixture {fx.resolve()}")
    assert len(out.strip().splitlines()) == 1, out
    assert sorted(p.relative_to(fx) for p in fx.rglob("*")) == before


def test_fixture_verify_refuses_a_workdir_inside_a_sealed_fixture(cli, tmp_path):
    """The re-run's files there would break the seal (the next verify of that fixture failed on
    them): refused in one line, nothing written, the fixture's own folder too."""
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    before = sorted(p.relative_to(fx) for p in fx.rglob("*"))
    for work in (fx / "work", fx):
        code, out = cli("fixture", "verify", fx, "--workdir", work)
        _assert_clean_error(code, out, f"--workdir {work}: inside the sealed fixture {fx.resolve()}")
        assert len(out.strip().splitlines()) == 1, out
    assert sorted(p.relative_to(fx) for p in fx.rglob("*")) == before
    assert cli("fixture", "verify", fx)[0] == 0  # its seal holds


def test_fixture_verify_names_a_file_given_as_workdir(cli, tmp_path):
    """The flag is named, not the fixture's fixture.json (which is not at fault)."""
    (tmp_path / "afile").write_text("x")
    code, out = cli("fixture", "verify", "--workdir", tmp_path / "afile")
    assert code == 2 and f"--workdir {tmp_path / 'afile'}: exists and is not a directory" in out, out
    assert "fixture.json" not in out, out


def test_fixture_verify_names_a_workdir_it_cannot_create(cli, tmp_path):
    """A ``--workdir`` that cannot be made is named as such, before the seal is checked (it was
    blamed on the fixture's fixture.json, after the re-run had started)."""
    (tmp_path / "afile").write_text("x")
    code, out = cli("fixture", "verify", "--workdir", tmp_path / "afile" / "sub")
    _assert_clean_error(code, out, f"--workdir {tmp_path / 'afile' / 'sub'}: cannot create it")
    assert "fixture.json" not in out and len(out.strip().splitlines()) == 1, out


def test_a_fixture_given_as_an_artifact_names_its_expected_run(cli, strict_run):
    fx = locate("tiny-t2i")
    code, out = cli("diff", strict_run, fx)
    _assert_clean_error(code, out, f"{fx}: a fixture, not an artifact; its expected run is {fx / 'expected'}")
