"""docs/manifest.schema.json is the generator's output (``manifest_json_schema``), a valid JSON
Schema, and the manifests drifttool writes validate against it with the ``jsonschema`` library;
manifests drifttool's reader refuses for their shape, it refuses too."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from drifttool.artifact.manifest import read_manifest
from drifttool.artifact.manifest_json_schema import render
from drifttool.errors import ArtifactError
from drifttool.fixture import locate
from drifttool.runner import execute
from drifttool.settings import RunSpec
from drifttool.training.recompute import recompute_run

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "manifest.schema.json"


def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(COMMITTED.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schema_is_the_generators_output():
    assert COMMITTED.read_text() == render(), (
        "regenerate: python -m drifttool.artifact.manifest_json_schema > docs/manifest.schema.json")


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> dict[str, dict]:
    """Real manifests: a rollout, its training recompute, a run killed before it finished (an
    incomplete one, streams listed) and the sealed fixture's expected run (schema version 3)."""
    root = tmp_path_factory.mktemp("manifests")
    execute(RunSpec(steps=2, capture="L0"), root / "roll")
    recompute_run(root / "roll", root / "train")
    execute(RunSpec(steps=2, capture="L0"), root / "cut", max_steps=1)
    runs = {"rollout": root / "roll", "recompute": root / "train", "incomplete": root / "cut",
            "fixture": locate("tiny-t2i") / "expected"}
    return {name: json.loads((p / "manifest.json").read_text()) for name, p in runs.items()}


@pytest.mark.parametrize("name", ["rollout", "recompute", "incomplete", "fixture"])
def test_real_manifests_validate(manifests, name):
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator().iter_errors(
        manifests[name])]
    assert not errors, errors


def _set(path: str, value):
    *parents, key = path.split(".")

    def edit(m: dict) -> None:
        for p in parents:
            m = m[p]
        m[key] = value
    return edit


SHAPE_DAMAGES = {
    "unknown top-level key": _set("notes", "hand edit"),
    "settings.mode invalid": _set("settings.mode", "fast"),
    "settings.steps as bool": _set("settings.steps", True),
    "settings.cfg_scale as string": _set("settings.cfg_scale", "4"),
    "complete as string": _set("complete", "true"),
    "fingerprint null": _set("fingerprint", None),
    "files.digests as list": _set("files.digests", ["x"]),
    "settings.mode missing": lambda m: m["settings"].pop("mode"),
    "kind recompute without its source": _set("kind", "recompute"),
    "policy on a rollout": _set("policy", {"timestep_policy": "sigma_fp32",
                                           "cfg_layout": "batched", "cfg_scale": 4.0, "eta": 1.2}),
    "arch.img_grid as string": _set("fingerprint.arch.img_grid", "x"),
    "arch.img_grid of one item": _set("fingerprint.arch.img_grid", [0]),
    "arch.img_grid negative": _set("fingerprint.arch.img_grid", [-1, 4]),
    "arch.img_grid of three items": _set("fingerprint.arch.img_grid", [1, 2, 3]),
    "arch.num_layers zero": _set("fingerprint.arch.num_layers", 0),
    "arch.axes_dims_rope of two axes": _set("fingerprint.arch.axes_dims_rope", [8, 8]),
    "arch.eps zero": _set("fingerprint.arch.eps", 0.0),
    "settings.img_grid with a zero": _set("settings.img_grid", [4, 0]),
    "replay.noise.img_grid of one item": _set("replay.noise.img_grid", [4]),
    "settings.steps negative": _set("settings.steps", -3),  # not "records past step -4"
    "settings.eta negative": _set("settings.eta", -0.5),
    "settings.seed past 64 bits": _set("settings.seed", 2**70),  # no torch generator takes it
    "settings.seed below 64 bits": _set("settings.seed", -(2**63) - 1),
    "replay.noise.num_steps zero": _set("replay.noise.num_steps", 0),
}


def test_an_arch_key_of_another_model_is_kept(manifests, tmp_path):
    """``fingerprint.arch`` keys drifttool does not know are compared by the diff, not refused."""
    m = json.loads(json.dumps(manifests["rollout"]))
    m["fingerprint"]["arch"]["depth"] = [3, "x"]
    assert not list(validator().iter_errors(m))
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert read_manifest(tmp_path)["fingerprint"]["arch"]["depth"] == [3, "x"]


@pytest.mark.parametrize("name", sorted(SHAPE_DAMAGES))
def test_the_schema_and_the_reader_refuse_the_same_shapes(manifests, tmp_path, name):
    m = json.loads(json.dumps(manifests["rollout"]))
    SHAPE_DAMAGES[name](m)
    assert list(validator().iter_errors(m)), f"{name}: the JSON Schema accepts it"
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="corrupt manifest"):
        read_manifest(tmp_path)
