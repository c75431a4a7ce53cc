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
    "eta null": (_settings("eta", None), "settings.eta is null"),
    "eta negative": (_settings("eta", -1), "settings.eta is -1"),
    "capture null": (_settings("capture", None), "settings.capture None is not one of"),
    "steps as bool": (_settings("steps", True), "settings.steps is a boolean"),
    "no samples": (_settings("samples", []), "settings.samples is empty"),
    "an unknown key": (_settings("stepz", 3), "unknown key settings.stepz"),
    "no settings": (lambda meta: {k: v for k, v in meta.items() if k != "settings"}, "'settings' object"),
    "a list": (lambda meta: [meta], "not a fixture's description"),
    "a number as its name": (lambda meta: {**meta, "name": 3}, "'name' is not a string"),
}


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_malformed_fixture_json_is_refused_in_one_line(cli, tmp_path, name):
    damage, needle = DAMAGES[name]
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    meta = json.loads((fx / "fixture.json").read_text())
    (fx / "fixture.json").write_text(json.dumps(damage(meta)))
    code, out = cli("run", "--fixture", fx, "-o", tmp_path / "r", "--steps", "2")
    one_error_line(code, out, str(fx / "fixture.json"), needle)
    assert not (tmp_path / "r").exists()


def test_a_fixture_json_that_is_not_json_is_refused_in_one_line(cli, tmp_path):
    fx = tmp_path / "my-fixture"
    shutil.copytree(locate("tiny-t2i"), fx)
    (fx / "fixture.json").write_text('{"settings": ')
    code, out = cli("run", "--fixture", fx, "-o", tmp_path / "r")
    one_error_line(code, out, str(fx / "fixture.json"), "not JSON")
