"""The prompt → image chain at its limits, as a newcomer meets them (``run --prompt``, ``run --image
--fixture tiny-edit``): an image too large for the scheduler's sigma table, a run whose memory
lower bound exceeds what the machine has, a ``--prompt-positions`` outside its choices, flags the
run was not given; each is one ``error:`` line, exit 2, before any work. And the edit run's
summary says whether CFG ran, as the text-to-image one does."""

from __future__ import annotations

import re
import warnings

import pytest

pytest.importorskip("PIL")

from drifttool.fixture import locate  # noqa: E402
from tests.conftest import one_error_line  # noqa: E402

EDIT = locate("tiny-edit")


def _edit(out, *extra):
    return ("run", "--image", EDIT / "condition.png", "--fixture", "tiny-edit", "--mode", "auto",
            "--preset", "diffusers-edit", "-o", out, *extra)


@pytest.mark.parametrize("kind,steps,square", [("prompt", 4, 9424), ("edit", 3, 9248)])
def test_an_image_past_the_sigma_tables_range_isone_error_line(cli, tmp_path, kind, steps, square):
    """10240² px: μ = 21.13 from 409600 image tokens makes the table NaN (as in diffusers'
    scheduler); refused before any work and without numpy's warning, naming the largest square
    that runs at the run's step count (4: the default fixture's, 3: tiny-edit's)."""
    out = tmp_path / "r"
    size = ("--height", "10240", "--width", "10240")
    args = ("run", "--prompt", "x", "-o", out, *size) if kind == "prompt" else _edit(out, *size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would be an internal error (exit 4)
        code, text = cli(*args)
    one_error_line(code, text, "error: --height 10240 --width 10240: the scheduler's dynamic shift "
              "(mu = 21.1323 for 409600 image tokens)", f"the {steps}-step sigma table non-finite",
              "diffusers' FlowMatchEulerDiscreteScheduler computes the same NaN",
              f"every square image up to {square}x{square} px runs")
    assert not out.exists() and not (tmp_path / "r.png").exists()


def test_the_largest_square_named_passes_the_checks_and_the_next_is_refused():
    """The message's limit is the check's: 9248² at tiny-edit's 3 steps resolves (and so runs,
    memory allowing), 9264² does not."""
    from drifttool.errors import UnsupportedConfigError
    from drifttool.settings import RunSpec, resolve

    spec = dict(fixture="tiny-edit", mode="auto")
    assert resolve(RunSpec(**spec, height=9248, width=9248))[1].steps == 3
    assert resolve(RunSpec(**spec, height=16384, width=16))[1].img_grid == (1024, 1)  # 1024 tokens
    with pytest.raises(UnsupportedConfigError, match="every square image up to 9248x9248 px runs"):
        resolve(RunSpec(**spec, height=9264, width=9264))


@pytest.mark.parametrize("kind", ["prompt", "edit", "trajectory"])
def test_a_run_whose_memory_lower_bound_does_not_fit_isone_error_line(cli, tmp_path, monkeypatch, kind):
    """4096² px (65536 image tokens), the available memory's reader patched. The strict bf16
    VAE decode holds 4 channels × 4096² × (3·2 + 4·4) bytes, with the 5 fp32 latents and x0:
    1.5 GiB, against 1 GiB; the production one (tiny-edit, bf16 latents) 4 × 4096² × (3·2 + 4·2)
    bytes, 0.9 GiB with its latents and x0, against 0.5 GiB; a run without a decode (the default
    fixture, 2 samples) the transformer's image-stream MLP, 2 × 65536 × (3·32 + 128) × 2 bytes,
    and x0: 88 MiB, against 10 MiB. Each refused before any work. At capture L0 (L1 for the
    trajectory): no digest key table and no unfused attention, whose terms are larger
    (tests/cli/test_phaseb_limits.py)."""
    from drifttool import memory

    free, need, have = {"prompt": (1 << 30, "1.5 GiB", "1.0 GiB"), "edit": (1 << 29, "0.9 GiB", "0.5 GiB"),
                        "trajectory": (10 << 20, "88 MiB", "10 MiB")}[kind]
    monkeypatch.setattr(memory, "available_bytes", lambda device: free)
    out = tmp_path / "r"
    size = ("--height", "4096", "--width", "4096")
    args = {"prompt": ("run", "--prompt", "x", "-o", out, *size, "--capture", "L0"),
            "edit": _edit(out, *size, "--capture", "L0"),
            "trajectory": ("run", "-o", out, *size, "--capture", "L1")}[kind]
    samples = "2 samples at " if kind == "trajectory" else ""  # the default fixture's two
    line = one_error_line(*cli(*args), f"error: {samples}--height 4096 --width 4096: the run needs at least "
                          f"{need}, {have} available (host memory; a lower bound: ")
    assert ("VAE decode" in line) is (kind != "trajectory"), line
    assert not out.exists() and not (tmp_path / "r.png").exists()


def test_a_run_at_its_lower_bound_is_not_refused(cli, tmp_path, monkeypatch):
    """Exactly the bound available: the run goes on (the check refuses only above it)."""
    from drifttool import memory
    from drifttool.chain import default_pipeline
    from drifttool.model.checkpoint import read_config
    from drifttool.model.vae_checkpoint import vae_config
    from drifttool.settings import RunSpec, resolve

    folder = default_pipeline()
    _, s = resolve(RunSpec(checkpoint=folder, samples=[0], steps=2))
    need, _ = memory.peak_lower_bound(s, read_config(folder), vae_config(folder))
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    code, out = cli("run", "--prompt", "x", "--steps", "2", "-o", tmp_path / "r")
    assert code == 0, out
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    one_error_line(*cli("run", "--prompt", "x", "--steps", "2", "-o", tmp_path / "r2"), "needs at least")


@pytest.mark.parametrize("value", ["", "bogus", "Sequential"])
def test_prompt_positions_is_a_closed_choice(cli, tmp_path, value):
    """``--prompt-positions ''`` was taken as the default; every value but the two is refused by
    the command line, naming the option and its choices."""
    one_error_line(*cli(*_edit(tmp_path / "r", "--prompt-positions", value)), "'--prompt-positions'",
              f"{value!r} is not one of 'rope_index', 'sequential'")
    assert not (tmp_path / "r").exists()


def test_prompt_positions_choices_are_the_encoders():
    from drifttool.cli.run import PromptPositions
    from drifttool.text_encoder.encode import POSITIONS

    assert tuple(p.value for p in PromptPositions) == POSITIONS


def test_image_with_a_text_to_image_chain_fixture_names_the_edit_pipeline(cli, tmp_path):
    """Not "no prompt embeddings … or --image for an edit fixture" although --image was given."""
    line = one_error_line(*cli("run", "--image", EDIT / "condition.png", "--fixture", "tiny-t2i-chain",
                          "-o", tmp_path / "r"),
                     "--fixture tiny-t2i-chain: a text-to-image chain fixture",
                     "--image needs an edit pipeline", "tiny-edit", "--preset diffusers-edit")
    assert "prompt embeddings" not in line


@pytest.mark.parametrize("extra", [(), ("--checkpoint", EDIT)], ids=["fixture-prompts", "no-prompt"])
def test_two_images_under_the_edit_preset_name_what_was_given(cli, tmp_path, extra):
    """No --prompt given (the fixture's prompts, or none): the refusal names the two --image."""
    args = _edit(tmp_path / "r", "--image", EDIT / "condition.png", *extra)
    if extra:
        args = tuple(a for a in args if a not in ("--fixture", "tiny-edit"))
    line = one_error_line(*cli(*args), "preset 'diffusers-edit'", "exactly 1 condition image (--image); "
                     "the run has 2", "--preset diffusers-edit-plus")
    assert "--prompt" not in line and "--condition" not in line, line


def test_the_edit_fixture_without_a_mode_names_its_preset(cli, tmp_path):
    one_error_line(*cli("run", "--image", EDIT / "condition.png", "--fixture", "tiny-edit", "-o", tmp_path / "r"),
              "--fixture tiny-edit runs under its preset 'diffusers-edit'", "needs --mode auto")


def test_the_edit_run_summary_has_a_cfg_row(cli, tmp_path):
    """tiny-edit has a negative prompt and cfg_scale 4: CFG on, said as the t2i summary says it;
    with --cfg-scale 1, off."""
    code, out = cli(*_edit(tmp_path / "r", "--steps", "2"))
    assert code == 0, out
    assert re.search(r"│ CFG +│ on \(cond, uncond\) +│", out), out
    code, out = cli(*_edit(tmp_path / "s", "--steps", "2", "--cfg-scale", "1"))
    assert code == 0, out
    assert re.search(r"│ CFG +│ off \(one branch\) +│", out), out


def test_an_edit_run_without_any_prompt_is_refused(cli, tmp_path):
    # a pipeline folder given by --checkpoint brings no prompt: the default fixture's stored
    # embeddings are not this pipeline's prompt, so the run is refused rather than run on them
    line = one_error_line(*cli("run", "--image", EDIT / "condition.png", "--checkpoint", EDIT, "--mode", "auto",
                               "--preset", "diffusers-edit", "-o", tmp_path / "r"),
                          "no prompt for the edit", "--prompt TEXT", "--prompt-embeds FILE")
    assert "tiny-t2i" in line, line
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.png").exists()
