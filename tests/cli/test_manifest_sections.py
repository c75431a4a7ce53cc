"""A run's manifest with a whole section deleted is refused by every reader: ``diff`` (either
side, ``--json`` too), ``replay``, ``report`` and ``fixture verify`` exit 2 with one ``error:``
line naming the missing section, write nothing, and never a traceback. The sections are those a
real run's manifest holds (every top-level key of a fresh ``drifttool run``'s manifest), deleted
one at a time; ``docs/manifest.schema.json`` refuses each cut manifest too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from drifttool.artifact import manifest_schema as MS
from drifttool.exit_codes import ExitCode
from drifttool.fixture import locate, seal
from tests.conftest import one_error_line

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "manifest.schema.json"


def _sections(run: Path) -> list[str]:
    return sorted(json.loads((run / "manifest.json").read_text()))


def _cut(run: Path, dest: Path, section: str) -> Path:
    shutil.copytree(run, dest)
    m = json.loads((dest / "manifest.json").read_text())
    del m[section]
    (dest / "manifest.json").write_text(json.dumps(m, indent=2))
    return dest


def _refused(code: int, out: str, section: str) -> None:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == ExitCode.USAGE, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    assert f"missing section '{section}'" in lines[0], out


def test_a_real_runs_manifest_holds_every_run_section(strict_run):
    """The sections the reader demands are the ones drifttool writes (else every run is refused)."""
    held = set(_sections(strict_run))
    assert set(MS.RUN_SECTIONS) | MS.MANIFEST_SCHEMA.required | MS.KIND_REQUIRES["rollout"] <= held


@pytest.fixture(scope="module")
def sections(tmp_path_factory):
    """The top-level sections of a fresh run's manifest (every one is deleted in turn below)."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("sections") / "run"
    execute(RunSpec(steps=2, capture="L0"), out)
    return out


def test_every_section_of_a_real_run_is_refused_when_deleted(cli, sections, tmp_path):
    names = _sections(sections)
    assert {"settings", "environment", "replay", "kind", "capture_level", "layout"} <= set(names)
    for section in names:
        cut = _cut(sections, tmp_path / section, section)
        before = sorted(p.name for p in cut.iterdir())
        _refused(*cli("diff", sections, cut), section)
        _refused(*cli("diff", cut, sections, "--json"), section)
        _refused(*cli("replay", cut, "-o", tmp_path / f"{section}-replay"), section)
        _refused(*cli("report", sections, cut, "-o", tmp_path / f"{section}.html"), section)
        assert not (tmp_path / f"{section}-replay").exists()
        assert not (tmp_path / f"{section}.html").exists()
        assert sorted(p.name for p in cut.iterdir()) == before


def test_the_json_schema_refuses_every_cut_manifest(sections):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    whole = json.loads((sections / "manifest.json").read_text())
    jsonschema.validate(whole, schema)
    for section in whole:
        cut = {k: v for k, v in whole.items() if k != section}
        with pytest.raises(jsonschema.ValidationError, match=section):
            jsonschema.validate(cut, schema)


def test_a_bare_artifact_needs_no_run_section(tmp_path):
    """``ArtifactWriter`` alone (tools, synthetic tests) writes no run section: still readable,
    and one run section makes it a run's manifest that needs them all."""
    from drifttool.artifact.manifest import read_manifest
    from drifttool.artifact.writer import ArtifactWriter
    from drifttool.errors import ArtifactError

    ArtifactWriter(tmp_path / "bare", {"fingerprint": {}}).close(complete=True)
    assert read_manifest(tmp_path / "bare")["fingerprint"] == {}
    ArtifactWriter(tmp_path / "half", {"fingerprint": {}, "replay": {
        "noise": None, "inputs": "inputs.safetensors", "prompt_lengths": [1],
        "input_digests": {}}}).close(complete=True)
    with pytest.raises(ArtifactError, match="missing section 'kind'"):
        read_manifest(tmp_path / "half")


def test_an_incomplete_run_may_lack_its_replay_record_only(sections, tmp_path):
    """A pipeline capture writes ``replay`` when the call finishes: a stopped one has none."""
    from drifttool.artifact.manifest import read_manifest
    from drifttool.errors import ArtifactError

    cut = _cut(sections, tmp_path / "stopped", "replay")
    m = json.loads((cut / "manifest.json").read_text())
    m["complete"] = False
    (cut / "manifest.json").write_text(json.dumps(m))
    assert "replay" not in read_manifest(cut)
    del m["environment"]
    (cut / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="missing section 'environment'"):
        read_manifest(cut)


def test_a_run_in_mode_off_holds_no_capture_level(tmp_path):
    """Mode off captures nothing: no recorder writes ``capture_level``, and it is not asked for."""
    from drifttool.artifact.manifest import read_manifest
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    jsonschema = pytest.importorskip("jsonschema")
    execute(RunSpec(steps=2, mode="off"), tmp_path / "off")
    m = read_manifest(tmp_path / "off")
    assert "capture_level" not in m
    jsonschema.validate(m, json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize("section", ["settings", "kind"])
def test_fixture_verify_refuses_an_expected_manifest_without_a_section(cli, tmp_path, section):
    """Resealed after the cut (so the seal holds; ``fixture.seal``, which checks nothing, as a
    hand-made seal would be): the reader refuses it before anything runs."""
    fx = tmp_path / "fx"
    shutil.copytree(locate("tiny-t2i"), fx, ignore=shutil.ignore_patterns("__pycache__"))
    m = json.loads((fx / "expected" / "manifest.json").read_text())
    del m[section]
    (fx / "expected" / "manifest.json").write_text(json.dumps(m, indent=2))
    # `fixture seal` reads the expected manifest as `fixture verify` does, and refuses it too
    one_error_line(*cli("fixture", "seal", fx), f"missing section '{section}'")
    seal(fx)
    _refused(*cli("fixture", "verify", fx, "--workdir", tmp_path / "work"), section)
    assert not (tmp_path / "work" / "replay").exists()
