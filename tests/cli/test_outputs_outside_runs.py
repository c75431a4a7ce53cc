"""drifttool never writes its own outputs inside an existing run directory: a run directory holds
only its artifact's files, so a JUnit file, a report, a figure or a nested run there would make
the run unreadable. Every output option refuses it in one line, exit 2, before any work."""

import pytest

from drifttool.artifact.reader import open_run
from drifttool.errors import ArtifactError
from tests.cli.scripting import invoke


@pytest.mark.parametrize("args", [
    lambda a, b: ("diff", a, b, "--junit", b / "j.xml"),
    lambda a, b: ("diff", a, b, "--localize-dir", a / "loc"),
    lambda a, b: ("report", a, b, "-o", b / "report.html"),
    lambda a, b: ("report", a, b, "-o", a.parent / "r.html", "--junit", a / "deep" / "j.xml"),
    lambda a, b: ("overlay", a, b, "-o", b / "fig.png"),
    lambda a, b: ("replay", a, "-o", a / "sub"),
    lambda a, b: ("recompute", a, "-o", b / "sub"),
    lambda a, b: ("run", "-o", a / "nested"),
    lambda a, b: ("run", "-o", b / "x" / ".." / "nested"),
], ids=["diff-junit", "localize-dir", "report", "report-junit", "overlay", "replay", "recompute",
        "run", "run-dotdot"])
def test_an_output_inside_a_run_is_refused_before_any_work(runs, args):
    a, b = runs
    before = {p: sorted(x.name for x in p.iterdir()) for p in (a, b)}
    res = invoke(*args(a, b))
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines and lines[0].startswith("error:") and "inside the run directory" in res.stderr, res.stderr
    assert "Traceback" not in res.output
    for p in (a, b):  # nothing written there: both runs still read
        assert sorted(x.name for x in p.iterdir()) == before[p]
        open_run(p)
    assert invoke("diff", a, b).exit_code == 0


def test_a_relative_output_from_inside_a_run_is_refused(runs, monkeypatch):
    a, b = runs
    monkeypatch.chdir(b)
    res = invoke("diff", a, b, "--junit", "j.xml")
    assert res.exit_code == 2 and "inside the run directory" in res.stderr, res.output
    assert not (b / "j.xml").exists()


def test_an_output_beside_a_run_is_written(runs):
    a, b = runs
    res = invoke("diff", a, b, "--junit", b.parent / "ci" / "j.xml")
    assert res.exit_code == 0, res.output
    assert (b.parent / "ci" / "j.xml").is_file()


def test_a_stray_file_in_a_run_says_what_to_do(runs):
    _, b = runs
    (b / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match=r"notes\.txt.*move them out of .*b to read the run"):
        open_run(b)
