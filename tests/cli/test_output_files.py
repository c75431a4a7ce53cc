"""An output file named on the command line (``report -o``, ``overlay -o``, every ``--junit``)
replaces only an earlier file of its kind that drifttool wrote: a user's file there is refused in
one line, exit 2, before any work, and stays as it was (a photo, a paper or a run's decoded image
where a figure goes, pytest's JUnit XML where drifttool's goes); so is a path inside a sealed fixture (its seal would
break; output folders too: ``--localize-dir``, ``probe -o``) and a place that cannot be written,
so that a command writing two files never leaves one written and the other refused."""

from __future__ import annotations

import os
import shutil
import zlib

import pytest

from tests.cli.scripting import invoke

OUTPUTS = {  # what writes one file: (its arguments, given the runs and the file)
    "diff-junit": lambda a, b, f: ("diff", a, b, "--junit", f),
    "report": lambda a, b, f: ("report", a, b, "-o", f),
    "report-junit": lambda a, b, f: ("report", a, b, "-o", f.with_name("r.html"), "--junit", f),
    "overlay": lambda a, b, f: ("overlay", a, b, "-o", f),
}
NAMES = {"diff-junit": "j.xml", "report": "r.html", "report-junit": "j.xml", "overlay": "fig.png"}


def _one_error(res, words: str) -> None:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert words in lines[0] and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("what", list(OUTPUTS))
def test_a_users_file_is_refused_and_an_earlier_output_replaced(runs, tmp_path, what):
    a, b = runs
    out = tmp_path / "out" / NAMES[what]
    out.parent.mkdir()
    notes = "my notes on <testsuites> and <title>drifttool report</title>\n"  # names, not the format
    out.write_text(notes)
    res = invoke(*OUTPUTS[what](a, b, out))
    _one_error(res, "exists and is not")
    assert out.read_text() == notes
    assert not out.with_name("r.html").exists() or what == "report"  # nothing else written either
    out.write_bytes(b"")  # an empty file (a CI script's mktemp): replaced
    assert invoke(*OUTPUTS[what](a, b, out)).exit_code == 0 and out.stat().st_size > 0
    first = out.read_bytes()
    res = invoke(*OUTPUTS[what](a, b, out))  # an earlier output of its kind: replaced
    assert res.exit_code == 0 and out.read_bytes()[:4] == first[:4], res.output


def _matplotlib(path) -> None:
    """A figure as matplotlib saves it by default (no drifttool mark), in the suffix's format."""
    from drifttool.probes.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    fig.savefig(path)
    plt.close(fig)


def _pillow(path) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(path, format="PNG")


def _decoded(path) -> None:
    """The image a prompt run decoded (the chain fixture's expected run, written by
    ``drifttool.chain.write_png``)."""
    from drifttool.fixture import locate

    shutil.copyfile(locate("tiny-t2i-chain") / "expected.png", path)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


MARK = b"drifttool figure"
NOT_OURS = {  # a figure's name → how a file drifttool did not write comes there
    "matplotlib.png": _matplotlib, "matplotlib.pdf": _matplotlib, "matplotlib.svg": _matplotlib,
    "pillow.png": _pillow, "decoded.png": _decoded,
    # the mark's bytes inside the image data, not in a text chunk before it
    "raw.png": lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", bytes(13))
                                       + _chunk(b"IDAT", b"tEXtSoftware\x00" + MARK) + _chunk(b"IEND", b"")),
    # the mark in the first page's stream, not in the Info dictionary at the end
    "raw.pdf": lambda p: p.write_bytes(b"%PDF-1.4\n1 0 obj << /Creator (" + MARK + b") >> stream\n"
                                       + b"0" * 70_000 + b"\nendstream endobj\n<< /Creator (LaTeX) >>\n%%EOF\n"),
    # the mark in a text element, not in the metadata
    "raw.svg": lambda p: p.write_bytes(b'<svg xmlns="http://www.w3.org/2000/svg"><text>' + MARK
                                       + b"</text></svg>\n"),
}


@pytest.mark.parametrize("name", list(NOT_OURS))
def test_overlay_refuses_a_figure_drifttool_did_not_write(strict_run, tmp_path, name):
    """A PNG, PDF or SVG that lacks drifttool's mark (``probes.plots.FIGURE_CREATOR``, where its
    format keeps it) is a user's: refused in one line, left as it was."""
    out = tmp_path / name
    NOT_OURS[name](out)
    before = out.read_bytes()
    res = invoke("overlay", strict_run, strict_run, "-o", out)
    _one_error(res, f"-o {out}: exists and is not an earlier drifttool figure ({out.suffix})")
    assert out.read_bytes() == before


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_overlay_replaces_its_own_earlier_figure(strict_run, tmp_path, suffix):
    from drifttool.probes.plots import FIGURE_CREATOR

    out = tmp_path / f"fig{suffix}"
    res = invoke("overlay", strict_run, strict_run, "-o", out, "--title", "first")
    assert res.exit_code == 0, res.output
    first = out.read_bytes()
    assert FIGURE_CREATOR.encode() in first
    res = invoke("overlay", strict_run, strict_run, "-o", out, "--title", "second")
    assert res.exit_code == 0 and out.read_bytes() != first, res.output


OTHER_JUNIT = {  # another tool's JUnit XML: pytest's, an older pytest's bare suite, a CI merge
    "pytest": '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
              'failures="0" skipped="0" tests="1" time="0.5" hostname="ci"><testcase classname="t" '
              'name="test_x" time="0.001"/></testsuite></testsuites>',
    "bare-suite": '<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="pytest" tests="1">\n'
                  '  <testcase classname="t" name="test_x"/>\n</testsuite>\n',
    "named-otherwise": "<testsuites name='merged' title='drifttool'>\n  <testsuite "
                       "name=\"drifttool diff a b\" tests=\"0\"/>\n</testsuites>\n",
}


@pytest.mark.parametrize("command", ["diff", "report"])
@pytest.mark.parametrize("kind", list(OTHER_JUNIT))
def test_junit_refuses_another_tools_junit_xml(strict_run, tmp_path, command, kind):
    out = tmp_path / "junit.xml"
    out.write_text(OTHER_JUNIT[kind])
    args = ("-o", tmp_path / "r.html") if command == "report" else ()
    res = invoke(command, strict_run, strict_run, *args, "--junit", out)
    _one_error(res, f"--junit {out}: exists and is not an earlier drifttool JUnit report")
    assert out.read_text() == OTHER_JUNIT[kind] and not (tmp_path / "r.html").exists()


def test_junit_replaces_drifttools_own_junit_whichever_command_wrote_it(strict_run, tmp_path):
    """Its root ``<testsuites name="drifttool">``, attributes in any order and either quotes."""
    out = tmp_path / "junit.xml"
    res = invoke("report", strict_run, strict_run, "-o", tmp_path / "r.html", "--junit", out)
    assert res.exit_code == 0 and '<testsuites name="drifttool"' in out.read_text(), res.output
    assert invoke("diff", strict_run, strict_run, "--junit", out).exit_code == 0
    assert "drifttool diff" in out.read_text() and "r.html" not in out.read_text()
    out.write_text("<?xml version='1.0' encoding='utf-8'?>\n<!-- CI -->\n"
                   "<testsuites tests='0' name = 'drifttool'/>\n")
    assert invoke("diff", strict_run, strict_run, "--junit", out).exit_code == 0
    assert "drifttool diff" in out.read_text()


FOLDERS = {  # what writes into a folder: (its arguments, given the runs and the folder)
    "localize-dir": lambda a, b, d: ("diff", a, b, "--localize", "--localize-dir", d),
    "probe": lambda a, b, d: ("probe", "--only", "repeat", "-o", d),
}


@pytest.mark.parametrize("what", [*OUTPUTS, *FOLDERS])
def test_an_output_inside_a_sealed_fixture_is_refused(runs, tmp_path, what):
    a, b = runs
    fixture = tmp_path / "my-fixture"
    (fixture / "sub").mkdir(parents=True)
    (fixture / "seal.json").write_text("{}\n")
    out = fixture / "sub" / NAMES.get(what, "out")
    args = FOLDERS[what](a, b, out) if what in FOLDERS else OUTPUTS[what](a, b, out)
    _one_error(invoke(*args), "inside the sealed fixture")
    if what in FOLDERS:  # the fixture's folder itself
        _one_error(invoke(*FOLDERS[what](a, b, fixture)), "inside the sealed fixture")
    assert sorted(p.name for p in fixture.rglob("*")) == ["seal.json", "sub"]


def test_a_directory_named_like_a_report_is_named_a_directory(runs, tmp_path):
    a, b = runs
    (tmp_path / "r.html").mkdir()
    _one_error(invoke("report", a, b, "-o", tmp_path / "r.html"), "is a directory")


def test_an_unwritable_second_output_is_refused_before_the_first_is_written(runs, tmp_path, monkeypatch):
    """A folder that cannot be written (read only for this user, or on a read-only file system:
    ``os.access`` says which; as root only the latter, so it is simulated here)."""
    a, b = runs
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        False if (mode & os.W_OK and os.path.abspath(p).startswith(str(ro))) else real(p, mode, **kw)))
    res = invoke("report", a, b, "-o", tmp_path / "r.html", "--junit", ro / "j.xml")
    _one_error(res, "cannot be written here")
    assert not (tmp_path / "r.html").exists() and not (ro / "j.xml").exists()
    _one_error(invoke("diff", a, b, "--junit", ro / "deeper" / "j.xml"), "cannot be written here")


def test_a_descriptor_is_written_whatever_it_points_to(runs, tmp_path):
    """``--junit /dev/stdout`` with stdout redirected to a file of the user's: the shell points
    the descriptor there, and the user named the descriptor, not the file."""
    a, b = runs
    log = tmp_path / "ci.log"
    log.write_text("earlier lines of the job's log\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        res = invoke("diff", a, b, "--junit", f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    assert res.exit_code == 0, res.output
    assert "<testsuites" in log.read_text()


def test_the_report_and_its_junit_in_one_file_are_refused(runs, tmp_path):
    a, b = runs
    _one_error(invoke("report", a, b, "-o", tmp_path / "r.html", "--junit", tmp_path / "r.html"),
               "is the -o report file")
    assert not (tmp_path / "r.html").exists()


def test_a_dangling_link_is_refused_before_any_work(runs, tmp_path):
    a, b = runs
    (tmp_path / "r.html").symlink_to(tmp_path / "nowhere" / "r.html")
    _one_error(invoke("report", a, b, "-o", tmp_path / "r.html"), "which does not exist")
