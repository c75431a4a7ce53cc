"""A prompt run (``run --prompt``) and its images beside the artifact: the image paths are checked
before any work, as the artifact directory is; an overwrite leaves no stale image; a stopped
prompt run stays a prompt run (its manifest's ``chain`` is written from the start); a replay
of one under a parallel layout is refused before any torchrun advice."""

import hashlib
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

from tests.cli.scripting import invoke  # noqa: E402

PROMPT = "a red cube"


def _prompt_run(out, *extra):
    return invoke("run", "--prompt", PROMPT, "--steps", 2, "-o", out, *extra)


def _one_error_line(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in res.stderr, res.stderr


def test_an_existing_image_not_written_by_drifttool_is_refused_before_any_work(tmp_path):
    mine = tmp_path / "holiday.png"
    mine.write_bytes(b"my holiday photo")
    for extra in ((), ("--overwrite",)):
        res = _prompt_run(tmp_path / "holiday", *extra)
        _one_error_line(res, "holiday.png exists")
        assert mine.read_bytes() == b"my holiday photo"
        assert not (tmp_path / "holiday").exists()  # refused before the artifact was made


def test_a_directory_at_the_image_path_is_refused_before_any_work(tmp_path):
    (tmp_path / "dirpng.png").mkdir()
    res = _prompt_run(tmp_path / "dirpng")
    _one_error_line(res, "dirpng.png is a directory")
    assert not (tmp_path / "dirpng").exists()


def test_overwrite_replaces_its_own_image_and_leaves_no_stale_one(tmp_path):
    out, png = tmp_path / "r", tmp_path / "r.png"
    assert _prompt_run(out).exit_code == 0 and png.is_file()
    assert _prompt_run(out).exit_code == 2  # an earlier run: --overwrite needed
    res = _prompt_run(out, "--overwrite")
    assert res.exit_code == 0, res.output
    recorded = json.loads((out / "manifest.json").read_text())["chain"]["images"][0]
    assert hashlib.sha256(png.read_bytes()).hexdigest() == recorded["sha256"]
    # a run without --prompt over the prompt run writes no image: the earlier one goes with it
    res = invoke("run", "--steps", 2, "-o", out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert not png.exists()


def test_overwrite_keeps_an_image_the_user_changed_since(tmp_path):
    out, png = tmp_path / "r", tmp_path / "r.png"
    assert _prompt_run(out).exit_code == 0
    png.write_bytes(b"edited by hand")
    res = invoke("run", "--steps", 2, "-o", out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert png.read_bytes() == b"edited by hand"


def test_a_stopped_prompt_run_stays_a_prompt_run_and_replays_every_stage(tmp_path):
    from drifttool.artifact.reader import Run
    from drifttool.chain import run_chain
    from drifttool.settings import RunSpec

    def interrupt(step):  # Ctrl-C after the first step, as `timeout -s INT` does
        raise KeyboardInterrupt

    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run_chain(RunSpec(steps=4), out, prompts=[PROMPT], on_step=interrupt)
    assert not (tmp_path / "stopped.png").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False
    assert manifest["chain"]["prompts"] == [PROMPT] and manifest["chain"]["images"] == []
    res = invoke("replay", out, "-o", tmp_path / "again")
    assert res.exit_code == 0, res.output
    components = set(Run(tmp_path / "again").ops_table()["component"].to_pylist())
    assert "text_encoder" in components, components
    diff = invoke("diff", out, tmp_path / "again")
    assert diff.exit_code != 1, diff.output  # no drift (inconclusive: both runs stopped)


@pytest.mark.parametrize("layout", [("--tp", 2), ("--cfg-parallel", 2)])
def test_a_parallel_replay_of_a_prompt_run_is_refused_without_torchrun_advice(tmp_path, layout):
    out = tmp_path / "r"
    assert _prompt_run(out).exit_code == 0
    res = invoke("replay", out, "-o", tmp_path / "again", *layout)
    _one_error_line(res, "re-runs every stage in one process")
    assert "torchrun --nproc" not in res.output


def test_an_overwrite_removes_only_images_named_after_the_run(tmp_path):
    """A manifest naming another file (moved, edited) does not make it the run's image."""
    out, other = tmp_path / "r", tmp_path / "other.png"
    assert _prompt_run(out).exit_code == 0
    other.write_bytes((tmp_path / "r.png").read_bytes())
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["chain"]["images"][0]["path"] = str(other)
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = invoke("run", "--steps", 2, "-o", out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert other.is_file()
