"""Error and verdict texts say what is wrong in the user's terms (issue #8, confusing texts)."""

import json
import shutil

import pytest

from tests.conftest import one_error_line


def test_string_schema_version_says_it_must_be_an_integer(cli, tmp_path, strict_run):
    bad = tmp_path / "bad"
    shutil.copytree(strict_run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["schema_version"] = str(m["schema_version"])
    (bad / "manifest.json").write_text(json.dumps(m))
    code, out = cli("diff", strict_run, bad)
    assert code == 2 and "schema_version must be an integer, got '" in out, out
    assert "is not supported" not in out, out


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from drifttool.fixture import locate
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=2)
    path = tmp_path_factory.mktemp("lora") / "ad"
    save_lora(m, path)
    return path


def test_grad_without_lora_names_the_cli(cli, tmp_path, strict_run):
    code, out = cli("recompute", strict_run, "-o", tmp_path / "t", "--grad")
    assert code == 2 and "drifttool run --lora ADAPTER" in out, out
    assert "RunSpec" not in out, out


@pytest.mark.parametrize("cmd", ["replay", "recompute"])
def test_lora_on_a_run_without_one_says_what_it_means(cli, tmp_path, strict_run, adapter, cmd):
    code, out = cli(cmd, strict_run, "-o", tmp_path / "t", "--lora", adapter)
    assert code == 2 and "the rollout ran without a LoRA adapter" in out and "drop --lora" in out, out
    assert "trainer's model" not in out, out


def test_another_adapter_is_named_as_what_was_loaded(cli, tmp_path, adapter):
    """A replay has no trainer: the refusal names the rollout's adapter and the loaded one."""
    from drifttool.fixture import locate
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=2, init_b_std=0.05, seed=7)
    save_lora(m, tmp_path / "other")
    assert cli("run", "--steps", "2", "--capture", "L0", "--lora", adapter, "-o", tmp_path / "r")[0] == 0
    for cmd in ("replay", "recompute"):
        code, out = cli(cmd, tmp_path / "r", "-o", tmp_path / cmd, "--lora", tmp_path / "other")
        lines = out.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "differs from the model loaded to re-run it" in out, out
        assert "lora adapter: rollout xxh3" in out and ", loaded xxh3" in out and "trainer" not in out, out


def test_diff_of_disjoint_sample_sets_says_so(cli, tmp_path):
    for i in (0, 1):
        assert cli("run", "--samples", str(i), "--steps", "2", "-o", tmp_path / f"s{i}")[0] == 0
    code, out = cli("diff", tmp_path / "s0", tmp_path / "s1", "--json")
    rep = json.loads(out)
    assert code == 3 and rep["verdict"] == "inconclusive", out
    assert "sample sets are disjoint (samples [0] vs [1])" in rep["reason"], rep["reason"]
    assert "common records" not in rep["reason"], rep["reason"]


@pytest.mark.parametrize("args,needle", [
    (["--samples", "0,0"], "sample ids must be distinct"),
    (["--lora-alpha", "nan"], "--lora-alpha must be a finite number > 0"),
    (["--lora-rank", "0"], "--lora-rank"),
])
def test_experiment_checks_every_setting_before_writing(cli, tmp_path, args, needle):
    """A bad experiment setting is refused before OUT (or its LoRA adapter) is created."""
    out = tmp_path / "exp"
    code, text = cli("experiment", "train-rollout", "-o", out, "--no-grad", "--combos", "strict/strict", *args)
    assert code == 2 and needle in text and len(text.strip().splitlines()) == 1, text
    assert not out.exists()


def test_empty_combos_is_a_usage_error(cli, tmp_path):
    code, text = cli("experiment", "train-rollout", "-o", tmp_path / "exp", "--combos", "")
    assert code == 2 and "--combos is empty" in text and len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "exp").exists()


def test_fixture_verify_of_a_run_directory_says_it_is_not_a_fixture(cli, strict_run):
    code, text = cli("fixture", "verify", strict_run)
    assert code == 2 and "not a fixture (no fixture.json)" in text and "Errno" not in text, text


@pytest.mark.parametrize("args,needle", [
    (["run", "--fixture", "nope"], "one of tiny-edit, tiny-t2i, tiny-t2i-chain"),
    (["run", "--dtype", "fp16"], "one of bfloat16, float32"),
    (["run", "--samples", "-3,2,2,-1"], "(-3, -1 negative; 2 given more than once)"),
    (["probe", "--mode", "off"], "one of strict, auto"),
    (["probe", "--preset", "huge"], "(one of tiny)"),
])
def test_choices_and_bad_values_in_words_not_python_lists(cli, tmp_path, args, needle):
    code, text = cli(*args, "-o", tmp_path / "out")
    line = one_error_line(code, text, needle)
    assert "[" not in line, line


def test_a_chain_runs_summary_in_words(cli, tmp_path):
    code, text = cli("run", "--prompt", "a red cube", "--steps", "2", "-o", tmp_path / "chain")
    assert code == 0, text
    cells = set(text.replace("│", " ").split())
    assert {"yes"} <= cells and not {"True", "False", "[0]"} & cells, text


def test_an_l0_diffs_ops_column_says_not_counted(cli, tmp_path):
    """L0 runs hold no operator records: the per-step table's ops column is "-", not a 0 that
    reads as "no operator differs" beside drifting steps."""
    for name, mode in (("a", "strict"), ("b", "auto")):
        assert cli("run", "--capture", "L0", "--steps", "2", "--mode", mode, "-o", tmp_path / name)[0] == 0
    code, text = cli("diff", tmp_path / "a", tmp_path / "b")
    assert code == 1, text
    rows = [ln.split() for ln in text.split("per step")[1].splitlines() if ln.strip()[:1].isdigit()]
    assert rows and all(r[-1] == "-" for r in rows), text


def test_a_preset_is_read_in_any_case(cli, tmp_path):
    """``--preset`` (run, probe) and a fixture.json's preset are read in any case, as ``--mode``
    and the fixture's other names are (``unknown preset 'Diffusers'`` refused it), and recorded
    by their canonical names; an unknown one is still refused naming the presets."""
    import json as _json

    from drifttool.fixture import locate
    from drifttool.settings import RunSpec

    code, text = cli("run", "--preset", "Diffusers", "--mode", "AUTO", "--steps", "2", "-o", tmp_path / "run")
    assert code == 0, text
    assert _json.loads((tmp_path / "run" / "manifest.json").read_text())["settings"]["preset"] == "diffusers"
    assert RunSpec(preset="FLOW-GRPO").preset == "flow-grpo"
    code, text = cli("probe", "--preset", "TINY", "--list")
    assert code == 0 and "repeat" in text, text
    one_error_line(*cli("run", "--preset", "Huge", "--mode", "auto", "-o", tmp_path / "huge"),
                   "unknown preset 'Huge' (one of diffusers, diffusers-edit, diffusers-edit-plus, flow-grpo)")
    fx = tmp_path / "edit"
    shutil.copytree(locate("tiny-edit"), fx)
    meta = _json.loads((fx / "fixture.json").read_text())
    meta["settings"]["preset"] = "Diffusers-Edit"
    (fx / "fixture.json").write_text(_json.dumps(meta))
    # rebuilt first: the shipped expected/ was made on another CPU, whose production arithmetic
    # (the edit fixture's text encoder) may differ from this one's (fixture verify says so)
    code, text = cli("fixture", "seal", fx, "--rebuild")
    assert code == 0 and text.startswith(f"sealed {fx}: "), text
    assert _json.loads((fx / "expected" / "manifest.json").read_text())["settings"]["preset"] == "diffusers-edit"
    code, text = cli("fixture", "seal", fx)  # its re-run matches expected/ under the preset's other case
    assert code == 0 and text.startswith(f"sealed {fx}: "), text
