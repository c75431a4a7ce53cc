"""Bad input is ONE ``error:`` line and exit 2 (issue #8): output locations that cannot be
created, typer/click usage errors, and no empty line before a ``run`` error."""

import os
import stat

import pytest
import torch

from tests.conftest import one_error_line


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return f


@pytest.mark.parametrize("cmd", [
    ("run",), ("replay", "{run}"), ("recompute", "{run}"), ("probe", "--only", "repeat"),
    ("experiment", "train-rollout"), ("experiment", "grpo"),
])
def test_output_under_a_regular_file_isone_error_line(cli, afile, strict_run, cmd):
    args = [a.format(run=strict_run) for a in cmd]
    one_error_line(*cli(*args, "-o", afile / "sub"), str(afile), "not a directory")


def test_overlay_figure_under_a_regular_file_isone_error_line(cli, afile, strict_run):
    one_error_line(*cli("overlay", strict_run, strict_run, "-o", afile / "sub" / "fig.png"),
              str(afile), "not a directory")


@pytest.mark.parametrize("cmd,option", [
    (("run",), "-o"), (("replay", "{run}"), "-o"), (("recompute", "{run}"), "-o"),
    (("probe", "--only", "repeat"), "-o"), (("experiment", "train-rollout"), "-o"),
    (("experiment", "grpo"), "-o"), (("overlay", "{run}", "{run}"), "-o"),
    (("report", "{run}", "{run}", "-o", "r.html"), "--junit"),
    (("diff", "{run}", "{run}"), "--junit"), (("diff", "{run}", "{run}"), "--localize-dir"),
    (("fixture", "verify"), "--workdir"),
])
def test_an_empty_output_path_is_named_as_such(cli, tmp_path, monkeypatch, strict_run, cmd, option):
    """``-o ''`` is not the current directory (``Path('')``): its own line, nothing written."""
    monkeypatch.chdir(tmp_path)
    args = [a.format(run=strict_run) for a in cmd]
    one_error_line(*cli(*args, option, ""), f"'{option}", "empty path")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("cmd,option,name", [
    (("diff", "{run}", "{run}"), "--junit", "d.xml"),
    (("report", "{run}", "{run}", "-o", "{tmp}/r.html"), "--junit", "d.xml"),
    (("report", "{run}", "{run}"), "-o", "r.html"),
    (("overlay", "{run}", "{run}"), "-o", "o.png"),
])
def test_output_files_make_missing_parents_and_refuse_a_file_in_the_way(
        cli, tmp_path, afile, strict_run, cmd, option, name):
    """As ``run -o`` makes its directory and its parents, and refuses a directory under a file
    before it runs: every output file (``--junit``, ``report -o``, ``overlay -o``) alike."""
    args = [a.format(run=strict_run, tmp=tmp_path) for a in cmd]
    code, out = cli(*args, option, tmp_path / "new" / "deeper" / name)
    assert code == 0 and (tmp_path / "new" / "deeper" / name).is_file(), out
    before = sorted(tmp_path.rglob("*"))
    one_error_line(*cli(*args, option, afile / "sub" / name), f"{option} {afile}", "not a directory")
    one_error_line(*cli(*args, option, tmp_path / "new"), f"{option} {tmp_path / 'new'}: ")
    assert sorted(tmp_path.rglob("*")) == before  # refused before anything was written


def test_localize_dir_that_is_a_file_is_refused_naming_the_option(cli, strict_run, afile):
    """Refused before the diff, naming ``--localize-dir`` (it was an error naming the file only,
    after the runs' re-execution had started)."""
    one_error_line(*cli("diff", strict_run, strict_run, "--localize-dir", afile),
                   f"--localize-dir {afile}", "not a directory")
    one_error_line(*cli("diff", strict_run, strict_run, "--localize-dir", afile / "sub"),
                   f"--localize-dir {afile / 'sub'}", "not a directory")


def test_probe_junit_under_a_regular_file_is_refused_before_the_matrix(cli, tmp_path, afile):
    one_error_line(*cli("probe", "--only", "repeat", "-o", tmp_path / "m", "--junit", afile / "j.xml"),
              f"--junit {afile}", "not a directory")
    assert not (tmp_path / "m").exists()


def test_output_name_too_long_isone_error_line(cli, tmp_path):
    one_error_line(*cli("run", "-o", tmp_path / ("a" * 300)), "too long")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_in_a_read_only_directory_isone_error_line(cli, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_error_line(*cli("run", "-o", ro / "r"), "ermission denied")
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("args,needles", [
    (("run", "--batch", "0", "-o", "r"), ("--batch", "drifttool run --help")),
    (("run", "--steps", "x", "-o", "r"), ("--steps",)),
    (("run",), ("--out",)),
    (("run", "--bogus", "-o", "r"), ("--bogus",)),
    (("recompute", "--micro-batch", "0", "r", "-o", "x"), ("--micro-batch",)),
    (("recompute", "--no-trim-padding", "r", "-o", "x"), ("--no-trim-padding goes with --micro-batch",)),
    (("replay", "-o", "x"), ("RUN_DIR",)),
    (("overlay", "a", "b"), ("--out",)),
    (("nosuch",), ("nosuch", "drifttool --help")),
    (("experiment", "grpo", "--combos", "x/y", "-o", "x"), ("rollout/train", "--combos")),
    (("experiment", "train-rollout", "--combos", "strict/strict,prod/strict,strict/strict", "-o", "x"),
     ("--combos", "combination strict/strict is named twice")),
    (("experiment", "grpo", "--combos", "prod/prod,production/production", "-o", "x"),
     ("combination production/production is named twice",)),
    (("experiment", "train-rollout", "--samples", "a,b", "-o", "x"), ("--samples", "'a,b'")),
])
def test_usage_errors_areone_error_line(cli, tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    one_error_line(*cli(*args), *needles)


@pytest.mark.parametrize("lr", ["nan", "inf", "-1"])
def test_a_bad_grpo_learning_rate_is_one_line_before_anything_is_written(cli, tmp_path, lr):
    one_error_line(*cli("experiment", "grpo", "--lr", lr, "-o", tmp_path / "g"),
                   "the learning rate must be a finite number >= 0")
    assert not (tmp_path / "g").exists()


def test_help_and_version_still_work(cli):
    code, out = cli("--help")
    assert code == 0 and "Usage" in out and "run" in out, out
    code, out = cli("run", "--help")
    assert code == 0 and "--steps" in out, out
    code, out = cli()  # a bare group prints its help; exit 2 (and one error line: below)
    assert code == 2 and "Commands" in out, out
    code, out = cli("--version")
    assert code == 0 and out.startswith("drifttool "), out


@pytest.mark.parametrize("group,commands", [
    ((), "run, diff, trace, probe, overlay, replay, recompute, report, fixture, experiment"),
    (("fixture",), "verify, seal"),
    (("experiment",), "train-rollout, grpo"),
], ids=["drifttool", "fixture", "experiment"])
def test_a_bare_group_prints_its_help_then_one_error_line(group, commands):
    """No command given: the group's help on stdout as before, and on stderr one ``error:`` line
    naming its commands and its ``--help``, exit 2 (the help alone read like success)."""
    from tests.cli.scripting import invoke

    res = invoke(*group)
    assert res.exit_code == 2 and "Usage: drifttool" in res.stdout and "error:" not in res.stdout, res.output
    path = " ".join(("drifttool", *group))
    assert res.stderr.splitlines() == [
        f"error: Missing command: give one of {commands}. (see '{path} --help')"], res.stderr


def test_run_error_has_no_empty_line_before_it(cli, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    one_error_line(*cli("run", "-o", tmp_path / "full"), "not empty")


def test_inputs_file_follows_the_umask_like_every_artifact_file(tmp_path):
    from drifttool.artifact.writer import ArtifactWriter

    old = os.umask(0o022)
    try:
        with ArtifactWriter(tmp_path / "a", {}) as w:
            w.write_inputs({"x0": torch.zeros(2, 3)})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a").iterdir()}
    assert modes["inputs.safetensors"] == 0o644, modes
    assert set(modes.values()) == {0o644}, modes


def test_fixture_verify_of_a_plain_file_isone_error_line(cli, afile):
    code, out = cli("fixture", "verify", afile)
    one_error_line(code, out, str(afile))
    assert "not a fixture directory or a readable .tar/.tar.gz archive" in out
    assert "method gz" not in out  # tarfile's list of compressions tried is not the user's business


@pytest.mark.parametrize("damage,needle", [
    (lambda sd, k: sd.update({k: torch.zeros(2, 31)}), "mis-shaped"),
    (lambda sd, k: sd.update({k: torch.full_like(sd[k], float("nan"))}), "non-finite"),
])
def test_bad_lora_isone_error_line(cli, tmp_path, damage, needle):
    from safetensors.torch import load_file, save_file

    from drifttool.fixture import locate
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=2)
    save_lora(m, tmp_path / "ad")
    sd = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    damage(sd, next(k for k in sorted(sd) if k.endswith("to_q.lora_A.weight")))
    save_file(sd, str(tmp_path / "ad" / "adapter_model.safetensors"))
    (tmp_path / "ad" / "pytorch_lora_weights.safetensors").unlink(missing_ok=True)  # the peft copy only
    one_error_line(*cli("run", "--lora", tmp_path / "ad", "-o", tmp_path / "r"), needle)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A LoRA adapter folder as ``save_lora`` writes it (peft's pair + diffusers' file), with a
    README beside them, as hub adapters have."""
    from drifttool.fixture import locate
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=2)
    folder = save_lora(m, tmp_path_factory.mktemp("lora") / "my-adapter")
    (folder / "README.md").write_text("# my adapter\n")
    return folder


TAKES = ("--lora takes a peft adapter folder (with adapter_config.json and "
         "adapter_model.safetensors) or a .safetensors file")


@pytest.mark.parametrize("cmd", [
    ("run",), ("replay", "{run}"), ("recompute", "{run}"), ("experiment", "train-rollout"),
])
@pytest.mark.parametrize("given,needles", [
    ("{ad}/adapter_config.json", ("the config file of a peft adapter", "pass its folder {ad}")),
    ("{ad}/README.md", ("not a .safetensors file", "pass the adapter folder it lies in, {ad}")),
    ("{tmp}/nowhere", ("no such file or folder",)),
    ("{tmp}/empty", ("a folder without adapter files",)),
    ("{tmp}/notes.txt", ("not a .safetensors file",)),
])
def test_a_path_that_is_no_adapter_isone_error_line(cli, tmp_path, strict_run, adapter_dir, cmd,
                                                    given, needles):
    """Every ``--lora`` names the path as given and what it takes, before any model loads."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not an adapter")
    fill = dict(ad=adapter_dir, tmp=tmp_path, run=strict_run)
    path = given.format(**fill)
    line = one_error_line(*cli(*(a.format(**fill) for a in cmd), "--lora", path, "-o", tmp_path / "o"),
                          "'--lora'", f"LoRA adapter {path}: ", TAKES, *(n.format(**fill) for n in needles))
    assert "safetensors header" not in line and "deserializing" not in line
    assert not (tmp_path / "o").exists()


def test_an_empty_adapter_path_isone_error_line(cli, tmp_path):
    one_error_line(*cli("run", "--lora", "", "-o", tmp_path / "o"), "'--lora'", "empty path")


def test_multi_line_messages_are_joined_readably():
    from drifttool.cli._console import one_line

    assert one_line("adapter x does not match:\n  missing keys (1): a\n  unexpected keys (2): b; c") \
        == "adapter x does not match: missing keys (1): a; unexpected keys (2): b; c"


@pytest.mark.parametrize("args,needles", [
    (("--steps", "100000"), ("steps", "from 2 to 1000", "num_train_timesteps", "100000")),
    (("--steps", "1"), ("from 2 to 1000",)),
    (("--eta", "nan"), ("eta must be a finite number >= 0", "nan")),
    (("--eta", "-0.5"), ("eta must be a finite number >= 0",)),
    (("--cfg-scale", "nan"), ("cfg_scale must be a finite number",)),
    (("--cfg-scale", "inf"), ("cfg_scale must be a finite number",)),
    (("--cfg-scale", "-2"), ("cfg_scale must be a finite number >= 0", "got -2")),
    (("--cfg-scale", "-inf"), ("cfg_scale must be a finite number >= 0", "got -inf")),
    (("--samples", "2147483648"), ("sample ids must be at most 2147483647",)),
    (("--preset", "diffusers", "--mode", "auto", "--seed", "-1"), ("seed + sample id", "[0, 2^63)")),
    (("--seed", str(2**64)), ("seed must be an integer in [-2^63, 2^64)", str(2**64))),
    (("--seed", str(-(2**63) - 1)), ("seed must be an integer in [-2^63, 2^64)",)),
    (("--seed", "9" * 400), ("seed must be an integer in [-2^63, 2^64)", "got a 400-digit number")),
])
def test_bad_sampler_values_say_what_is_allowed(cli, tmp_path, args, needles):
    one_error_line(*cli("run", *args, "-o", tmp_path / "r"), *needles)
    assert not (tmp_path / "r").exists()


def test_a_negative_cfg_scale_is_refused_by_the_experiment_too(cli, tmp_path):
    """A scale in [0, 1] runs without CFG (diffusers' rule); below 0 it means nothing."""
    one_error_line(*cli("experiment", "train-rollout", "--cfg-scale", "-1", "-o", tmp_path / "x"),
                   "cfg_scale must be a finite number >= 0, got -1")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("alpha", ["-3", "0", "nan", "inf"])
def test_a_meaningless_lora_alpha_is_refused_before_anything_is_written(cli, tmp_path, alpha):
    """The fresh adapter's update is scaled by alpha / rank: 0 cancels it, below 0 flips it."""
    one_error_line(*cli("experiment", "train-rollout", "--lora-alpha", alpha, "-o", tmp_path / "x"),
                   "--lora-alpha must be a finite number > 0", f"got {alpha}")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,batch", [
    (("recompute", "{run}", "--micro-batch", "3"), 2),  # the stored rollout's samples
    (("experiment", "train-rollout", "--micro-batch", "3"), 2),  # the fixture's
    (("experiment", "grpo", "--micro-batch", "5"), 4),  # 2 groups of 2
], ids=["recompute", "train-rollout", "grpo"])
def test_a_micro_batch_larger_than_the_batch_is_refused_before_any_work(cli, strict_run, tmp_path, args, batch):
    """It ran the whole batch in one forward, as no --micro-batch does, recording the size asked."""
    args = [a.format(run=strict_run) for a in args]
    one_error_line(*cli(*args, "-o", tmp_path / "x"),
                   f"--micro-batch {args[-1]} is more than the {batch} sample(s)", f"give 1 to {batch}")
    assert not (tmp_path / "x").exists()


def test_a_number_is_echoed_as_given(cli, tmp_path):
    """``--eta -1`` is not echoed as ``-1.0`` (typer parses a float)."""
    line = one_error_line(*cli("run", "--eta", "-1", "-o", tmp_path / "r"), "eta must be a finite number")
    assert line.endswith("got -1"), line


def test_every_64_bit_seed_runs():
    """The ends of the seed range, signed and unsigned 64-bit, resolve as they did."""
    from drifttool.settings import RunSpec, resolve

    for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
        assert resolve(RunSpec(seed=seed))[1].seed == seed


def test_step_limit_holds_for_every_run_path():
    """``resolve`` (run, replay, experiment and probe all go through it) takes 1000 steps and
    refuses 1001."""
    from drifttool.errors import DriftToolError
    from drifttool.settings import MAX_STEPS, RunSpec, resolve

    assert MAX_STEPS == 1000
    assert resolve(RunSpec(steps=1000))[1].steps == 1000
    with pytest.raises(DriftToolError, match="from 2 to 1000"):
        resolve(RunSpec(steps=1001))


def test_run_error_in_a_real_process_leaves_stdout_empty(tmp_path):
    """The console-script path (``main()``, a pipe rather than CliRunner): nothing on stdout, one
    line on stderr, exit 2."""
    import subprocess
    import sys

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    for args in (["run", "-o", str(tmp_path / "full")], ["run", "--steps", "x", "-o", "r"]):
        res = subprocess.run([sys.executable, "-m", "drifttool.cli.app", *args], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
        assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
        assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("error: "), res.stderr


def test_probe_junit_naming_the_output_folder_is_refused_before_the_matrix(cli, tmp_path, monkeypatch):
    """``probe -o DIR --junit DIR`` is refused at once: the matrix would make DIR a folder and
    the JUnit file could not be written after it ran (one line, nothing written)."""
    monkeypatch.chdir(tmp_path)
    one_error_line(*cli("probe", "-o", "m", "--only", "repeat", "--junit", "m"),
                   "--junit m: is the -o/--out folder")
    assert not any(tmp_path.iterdir())
