"""``drifttool fixture seal`` seals only a fixture that ``fixture verify`` can pass: a
fixture.json missing a setting, a fixture without its model or expected artifact, or one whose
expected artifact was made with other settings (a seed edited after it was built) sealed with
exit 0 and then failed every verify. ``--rebuild`` re-runs the expected artifact from
fixture.json, after which the fixture seals and verifies identical."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from drifttool.fixture import locate, seal
from tests.conftest import fixture_copy, one_error_line


def _copy(tmp_path, name="tiny-t2i", **settings):
    return fixture_copy(tmp_path / "my-fixture", name, sealed=False, **settings)


@pytest.mark.parametrize("key", ["steps", "seed", "dtype", "img_grid", "eta"])
def test_a_fixture_missing_a_setting_is_not_sealed(cli, tmp_path, key):
    fx = _copy(tmp_path, **{key: None})
    one_error_line(*cli("fixture", "seal", fx), f"{fx / 'fixture.json'}: lacks settings.{key}")
    assert not (fx / "seal.json").exists()


def test_a_fixture_without_its_model_is_not_sealed(cli, tmp_path):
    fx = _copy(tmp_path)
    shutil.rmtree(fx / "transformer")
    for extra in ((), ("--rebuild",)):
        one_error_line(*cli("fixture", "seal", fx, *extra), f"{fx}: no transformer/")
    assert not (fx / "seal.json").exists()


def test_an_edited_seed_is_refused_then_rebuilt_and_verified(cli, tmp_path):
    fx = _copy(tmp_path, seed=7)
    before = (fx / "expected" / "manifest.json").read_bytes()
    one_error_line(*cli("fixture", "seal", fx), f"{fx / 'expected'}: made with seed 386, where fixture.json "
                   "says seed 7", "--rebuild")
    assert not (fx / "seal.json").exists() and (fx / "expected" / "manifest.json").read_bytes() == before
    code, out = cli("fixture", "seal", fx, "--rebuild")
    assert code == 0 and out.startswith(f"sealed {fx}: "), out
    assert json.loads((fx / "expected" / "manifest.json").read_text())["settings"]["seed"] == 7
    code, out = cli("fixture", "verify", fx)
    assert code == 0 and "IDENTICAL" in out, out


def test_a_fixture_without_its_expected_artifact_is_rebuilt(cli, tmp_path):
    fx = _copy(tmp_path)
    shutil.rmtree(fx / "expected")
    one_error_line(*cli("fixture", "seal", fx), f"{fx}: no expected artifact", "--rebuild")
    code, out = cli("fixture", "seal", fx, "--rebuild")
    assert code == 0, out
    assert cli("fixture", "verify", fx)[0] == 0


def test_a_rebuild_that_is_refused_replaces_nothing(cli, tmp_path):
    fx = _copy(tmp_path, steps=1)  # a step count a run refuses: checked before the re-run
    before = sorted(p.relative_to(fx) for p in fx.rglob("*"))
    one_error_line(*cli("fixture", "seal", fx, "--rebuild"), "steps must be an integer from 2")
    assert sorted(p.relative_to(fx) for p in fx.rglob("*")) == before


@pytest.mark.parametrize("name", ["tiny-t2i-chain", "tiny-edit"])
def test_a_chain_or_edit_fixture_is_rebuilt_with_its_image(cli, tmp_path, name):
    fx = _copy(tmp_path, name, seed=11)
    image = (fx / "expected.png").read_bytes()
    assert cli("fixture", "seal", fx)[0] == 2
    code, out = cli("fixture", "seal", fx, "--rebuild")
    assert code == 0, out
    assert (fx / "expected.png").read_bytes() != image  # another seed, another image
    code, out = cli("fixture", "verify", fx)
    assert code == 0 and "image expected.png: sha256 identical" in out, out


def test_the_settings_that_differ_are_named_in_their_own_words(cli, tmp_path):
    fx = _copy(tmp_path, samples=[0, 1, 2], img_grid=[4, 8])
    one_error_line(*cli("fixture", "seal", fx), "made with img_grid 4x6, samples 0, 1, where fixture.json "
                   "says img_grid 4x8, samples 0, 1, 2")


@pytest.mark.parametrize("name, section", [("tiny-t2i-chain", "chain"), ("tiny-edit", "edit")])
def test_an_unknown_key_in_a_chain_or_edit_section_is_refused(cli, tmp_path, name, section):
    fx = _copy(tmp_path, name)
    meta = json.loads((fx / "fixture.json").read_text())
    meta[section]["foo"] = 1
    (fx / "fixture.json").write_text(json.dumps(meta))
    one_error_line(*cli("fixture", "seal", fx), f"{fx / 'fixture.json'}: unknown key {section}.foo (one of ")
    assert not (fx / "seal.json").exists()


def test_names_in_fixture_json_are_read_in_any_case(cli, tmp_path):
    """A mode, capture level, dtype, CFG layout or timestep policy in fixture.json is read in
    any case, as its flag is (``settings.dtype "BFloat16" is not one of …`` refused it), and the
    expected artifact made with the canonical names still matches."""
    fx = _copy(tmp_path, mode="STRICT", capture="l2", dtype="BFloat16", cfg_layout="Batched",
               timestep_policy="SIGMA_FP32")
    code, out = cli("fixture", "seal", fx)
    assert code == 0 and out.startswith(f"sealed {fx}: "), out
    code, out = cli("fixture", "verify", fx)
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.parametrize("damage,needle", [
    ("no condition image", "condition image"),
    ("mode strict", "settings: preset 'diffusers-edit' reproduces a production pipeline's arithmetic"),
])
def test_a_rebuild_refused_by_its_run_names_the_fixture_json(cli, tmp_path, damage, needle):
    """An edit fixture's re-run refuses what fixture.json asks (a condition image it lacks, a
    mode its preset cannot take): the line names that file, not only a flag the user never typed."""
    fx = _copy(tmp_path, "tiny-edit", **({"mode": "strict"} if damage == "mode strict" else {}))
    if damage == "no condition image":
        (fx / "condition.png").unlink()
    one_error_line(*cli("fixture", "seal", fx, "--rebuild"), f"{fx / 'fixture.json'}: {needle}")
    assert not (fx / "seal.json").exists()


@pytest.mark.parametrize("name,damage,needle", [
    ("tiny-edit", "mode strict", "/fixture.json: settings: preset 'diffusers-edit' reproduces a production "
     "pipeline's arithmetic (bf16 latents, its scheduler step), and the settings name mode 'strict', of "
     "the strict family: set settings.mode to auto or off"),
    ("tiny-t2i", "prompts.safetensors", ": no prompt embeddings (prompts.safetensors), which a fixture "
     "without a 'chain' or 'edit' entry in fixture.json runs from"),
    ("tiny-edit", "text_encoder", ": no text_encoder/ (an edit fixture re-runs its own pipeline"),
    ("tiny-t2i-chain", "vae", ": no vae/ (a chain fixture re-runs its own pipeline: tokenizer/ and "
     "text_encoder/ encode its prompts, vae/ its images)"),
])
@pytest.mark.parametrize("rebuild", [False, True], ids=["seal", "rebuild"])
def test_a_refused_rerun_names_no_flag_of_drifttool_run(cli, tmp_path, name, damage, needle, rebuild):
    """The fixture's re-run (seal's verification, --rebuild, fixture verify) refused what
    ``drifttool run`` refuses in its own flags' words: 'use --mode auto or off', 'give
    --prompt-embeds', '--checkpoint DIR: … lacks text_encoder/'. The line says what to change in
    the fixture and names no flag but seal's own."""
    fx = _copy(tmp_path, name, **({"mode": "strict"} if damage == "mode strict" else {}))
    if damage == "prompts.safetensors":
        (fx / damage).unlink()
    elif damage != "mode strict":
        shutil.rmtree(fx / damage)
    line = one_error_line(*cli("fixture", "seal", fx, *(["--rebuild"] if rebuild else [])),
                          f"{fx}{needle}")
    assert "--" not in line.replace("--rebuild", ""), line
    assert not (fx / "seal.json").exists()


@pytest.mark.parametrize("seed", [-5, 2**63])
@pytest.mark.parametrize("rebuild", [False, True], ids=["seal", "rebuild"])
def test_a_seed_its_preset_refuses_is_not_offered_a_rebuild(cli, tmp_path, seed, rebuild):
    """An edit fixture whose seed its preset's generators cannot take (diffusers' generator list:
    seed + sample id in [0, 2^63)): seal said its expected/ was made with another seed and
    offered `--rebuild`, which then refused the seed. Both say what to change in fixture.json."""
    fx = _copy(tmp_path, "tiny-edit", seed=seed)
    line = one_error_line(*cli("fixture", "seal", fx, *(["--rebuild"] if rebuild else [])),
                          f"{fx / 'fixture.json'}: settings: preset 'diffusers-edit' seeds sample i's "
                          f"generator with seed + i (diffusers' generator list): seed + sample id must be "
                          f"in [0, 2^63), got seed {seed} with sample 0")
    assert "--rebuild" not in line, line
    assert not (fx / "seal.json").exists()


def test_a_fixture_whose_run_is_refused_or_drifts_is_not_sealed(cli, tmp_path):
    """What only a run shows: an edit fixture's condition image missing (the run is refused), a
    weight's bytes changed (the run drifts from expected/). Neither is sealed; a seal that was
    there before is restored."""
    edit = tmp_path / "edit"
    shutil.copytree(locate("tiny-edit"), edit)
    before = (edit / "seal.json").read_bytes()
    (edit / "condition.png").unlink()
    one_error_line(*cli("fixture", "seal", edit), f"{edit / 'fixture.json'}", "condition.png: missing")
    assert (edit / "seal.json").read_bytes() == before
    fx = _copy(tmp_path)
    weights = next((fx / "transformer").glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-2] ^= 0x40  # one bf16 weight's exponent: the same file, another value
    weights.write_bytes(bytes(raw))
    one_error_line(*cli("fixture", "seal", fx), "does not reproduce expected/", "first drift at")
    assert not (fx / "seal.json").exists()
    code, out = cli("fixture", "seal", fx, "--rebuild")  # re-made from the weights it now holds
    assert code == 0 and (fx / "seal.json").exists(), out


def test_verify_of_an_edited_fixture_names_the_seal_command_that_re_seals_it(cli, tmp_path):
    """A fixture whose fixture.json was edited after it was sealed: ``fixture verify`` offered
    `drifttool fixture seal DIR --rebuild`, a placeholder to fill in. It names the fixture's own
    path (quoted for a shell: this one holds a space), and that command re-seals it."""
    fx = fixture_copy(tmp_path / "my fixture", seed=7)  # sealed before the edit
    line = one_error_line(*cli("fixture", "verify", fx), f"{fx}: seal check failed: modified fixture.json")
    assert "DIR" not in line, line
    command = line.split("`")[1]
    assert command == f"drifttool fixture seal '{fx}' --rebuild", line
    assert line.endswith(f"; if edited on purpose, `{command}` re-seals it"), line
    code, out = cli(*shlex.split(command)[1:])
    assert code == 0 and out.startswith(f"sealed {fx}: "), out
    code, out = cli("fixture", "verify", fx)
    assert code == 0 and "IDENTICAL" in out, out


def _no_vae(fx):
    shutil.rmtree(fx / "vae")


@pytest.mark.parametrize("name, settings, damage", [
    ("tiny-t2i", {"steps": None}, None),            # an incomplete fixture.json
    ("tiny-t2i", {"preset": "diffusers"}, None),    # a preset under mode strict
    ("tiny-edit", {"seed": -5}, None),              # a seed its preset's generators cannot take
    ("tiny-t2i", {"stepz": 3}, None),               # a key fixture.json does not take
    ("tiny-t2i-chain", {}, _no_vae),                # a chain fixture without its VAE
], ids=["no steps", "preset under strict", "preset seed", "unknown key", "no vae"])
def test_verify_of_an_edit_seal_rebuild_refuses_says_what_seal_would_say(cli, tmp_path, name, settings,
                                                                          damage):
    """An edit that `fixture seal --rebuild` refuses: ``fixture verify``'s broken seal offered that
    command all the same. It says instead what the command would say, word for word, and
    offers nothing the command would refuse."""
    fx = fixture_copy(tmp_path / "my-fixture", name, **settings)
    if damage is not None:
        damage(fx)
    refusal = one_error_line(*cli("fixture", "seal", fx, "--rebuild")).removeprefix("error: ")
    line = one_error_line(*cli("fixture", "verify", fx), f"{fx}: seal check failed: ")
    assert line.endswith(f"; `drifttool fixture seal {fx} --rebuild` would refuse it as it is: {refusal}"), line
    assert "re-seals it" not in line and "DIR" not in line, line


@pytest.mark.parametrize("name, settings, key", [
    ("tiny-t2i", {"steps": None}, "steps"),
    ("tiny-t2i", {"img_grid": None}, "img_grid"),
    ("tiny-t2i", {"samples": None}, "samples"),
    ("tiny-t2i", {"cfg_layout": None}, "cfg_layout"),
    ("tiny-t2i", {"mode": "auto", "preset": "flow-grpo", "eta": None}, "eta"),  # its SDE takes eta
    ("tiny-t2i-chain", {"seed": None}, "seed"),
], ids=["steps", "img_grid", "samples", "cfg_layout", "flow-grpo eta", "chain seed"])
def test_verify_of_a_sealed_fixture_that_lacks_a_setting_names_its_fixture_json(cli, tmp_path, name,
                                                                               settings, key):
    """A sealed fixture whose fixture.json lacks a setting its re-run needs (sealed by hand, or
    by an older drifttool): ``fixture verify`` said "give --steps", an option it does not have.
    It names the fixture's file and the setting: one line, exit 2, nothing run."""
    fx = fixture_copy(tmp_path / "my-fixture", name, **settings)
    seal(fx)  # the seal alone: `fixture seal` refuses such a fixture
    line = one_error_line(*cli("fixture", "verify", fx), f"{fx / 'fixture.json'}: lacks settings.{key} "
                          "(an incomplete or corrupt fixture")
    assert "give" not in line and "--" not in line, line
    one_error_line(*cli("fixture", "seal", fx), f"{fx / 'fixture.json'}: lacks settings.{key}")

