"""A fixture of the user's own (``run --fixture DIR``) whose ``fixture.json`` is malformed, of a
wrong type or range, is refused in one line naming the file and the key: it was an internal error
(``img_grid: "4x6"``), a Python exception's name (``KeyError: 'settings'``) or a flag's message
(``--samples 0,1``) the user never gave."""

from __future__ import annotations

import json
import shutil

import pytest

from drifttool.fixture import locate
from tests.conftest import one_error_line


def _settings(key, value):
    def edit(meta):
        meta["settings"][key] = value
        return meta
    return edit


DAMAGES = {
    "img_grid as text": (_settings("img_grid", "4x6"), "settings.img_grid is a string"),
    "img_grid with a zero": (_settings("img_grid", [0, 6]), "settings.img_grid[0] is 0"),
    "img_grid with text": (_settings("img_grid", [4, "6"]), "settings.img_grid[1] is a string"),
    "img_grid of three": (_settings("img_grid", [4, 6, 1]), "settings.img_grid has 3 items"),
    "seed as text": (_settings("seed", "x"), "settings.seed is a string"),
    "seed null": (_settings("seed", None), "settings.seed is null, not an integer"),
    "seed past 64 bits": (_settings("seed", 2**64), "settings: seed must be an integer in [-2^63, 2^64)"),
    "seed below 64 bits": (_settings("seed", -(2**63) - 1), "settings: seed must be an integer in [-2^63, 2^64)"),
    "eta null": (_settings("eta", None), "settings.eta is null"),
    "eta negative": (_settings("eta", -1), "settings.eta is -1"),
    "capture null": (_settings("capture", None), "settings.capture null is not one of"),
    "steps as bool": (_settings("steps", True), "settings.steps is a boolean"),
    "no samples": (_settings("samples", []), "settings.samples is empty"),
    "an unknown key": (_settings("stepz", 3), "unknown key settings.stepz"),
    "no settings": (lambda meta: {k: v for k, v in meta.items() if k != "settings"}, "'settings' object"),
    "a list": (lambda meta: [meta], "not a fixture's description"),
    "a number as its name": (lambda meta: {**meta, "name": 3}, "'name' is not a string"),
    "a huge image": (_settings("img_grid", [100000, 100000]), "settings: img_grid 100000x100000 patches is 1600000x1600000 px, past the 16384 px"),
    "a key twice": (None, "key 'steps' given more than once"),
    "an empty name": (lambda meta: {**meta, "name": " "}, "'name' is empty"),
    "a number as its description": (lambda meta: {**meta, "description": 3}, "'description' is not a string"),
    "an unknown top-level key": (lambda meta: {**meta, "setings": {}}, "unknown key 'setings'"),
    "cfg_scale NaN": (_settings("cfg_scale", float("nan")), "settings: cfg_scale must be a finite number"),
    "cfg_scale negative": (_settings("cfg_scale", -2), "settings: cfg_scale must be a finite number >= 0, got -2"),
    "one step": (_settings("steps", 1), "settings: steps must be an integer from 2"),
    "negative steps": (_settings("steps", -3), "settings: steps must be an integer from 2 to 1000, got -3"),
    "eta NaN": (_settings("eta", float("nan")), "settings.eta is nan, not a finite number"),
    "a sample twice": (_settings("samples", [0, 1, 0]), "settings: sample ids must be distinct"),
    "a negative sample": (_settings("samples", [-2]), "(-2 negative)"),
}


def _damage(fx, damage) -> None:
    text = (fx / "fixture.json").read_text()
    if damage is None:  # a key given twice: JSON's parsers keep the last one, silently
        text = text.replace('"settings": {', '"settings": {"steps": 3, ', 1)
        assert text.count('"steps"') == 2
    else:
        text = json.dumps(damage(json.loads(text)))
    (fx / "fixture.json").write_text(text)


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_malformed_fixture_json_is_refused_in_one_line(cli, tmp_path, name):
    damage, needle = DAMAGES[name]
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    _damage(fx, damage)
    code, out = cli("run", "--fixture", fx, "-o", tmp_path / "r")
    one_error_line(code, out, str(fx / "fixture.json"), needle)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_malformed_fixture_json_is_not_sealed(cli, tmp_path, name):
    """`fixture seal` checks the description as `run` and `fixture verify` read it: a seal over
    one they refuse would only fail later, at the user who trusted it."""
    damage, needle = DAMAGES[name]
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    (fx / "seal.json").unlink()
    _damage(fx, damage)
    code, out = cli("fixture", "seal", fx)
    one_error_line(code, out, str(fx / "fixture.json"), needle)
    assert not (fx / "seal.json").exists()


def test_a_well_formed_fixture_is_sealed(cli, tmp_path):
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    (fx / "seal.json").unlink()
    code, out = cli("fixture", "seal", fx)
    assert code == 0 and (fx / "seal.json").is_file(), out


def test_a_fixture_json_that_is_not_json_is_refused_in_one_line(cli, tmp_path):
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    (fx / "fixture.json").write_text('{"settings": ')
    code, out = cli("run", "--fixture", fx, "-o", tmp_path / "r")
    one_error_line(code, out, str(fx / "fixture.json"), "not JSON")
