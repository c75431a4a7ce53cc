"""CI and people reports: ``diff --junit``, ``probe --junit`` (JUnit XML, read back with
junitparser and checked against the JUnit schema's shape) and ``drifttool report`` (one
self-contained HTML page, parsed with html5lib and opened in a headless Chromium)."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.cli.scripting import invoke

junitparser = pytest.importorskip("junitparser")


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("runs") / "auto"
    execute(RunSpec(mode="auto"), out)
    return out


def _check_shape(path: Path) -> ET.Element:
    """The JUnit XSD's shape: testsuites > testsuite (name, tests, failures, errors, skipped,
    time) > testcase (classname, name, time) with at most one failure/error/skipped child, and
    counts that add up."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    for suite in root.findall("testsuite"):
        assert {"name", "tests", "failures", "errors", "skipped", "time"} <= set(suite.attrib)
        cases = suite.findall("testcase")
        assert int(suite.get("tests")) == len(cases)
        for key in ("failure", "error", "skipped"):
            assert int(suite.get(key + ("s" if key != "skipped" else ""))) == \
                sum(c.find(key) is not None for c in cases)
        for c in cases:
            assert {"classname", "name", "time"} <= set(c.attrib)
            assert len([x for x in c if x.tag in ("failure", "error", "skipped")]) <= 1
            float(c.get("time"))
    return root


def test_diff_junit_one_case_per_step_first_drift_as_failure(strict_run, auto_run, tmp_path):
    res = invoke("diff", strict_run, auto_run, "--junit", tmp_path / "diff.xml")
    assert res.exit_code == 1
    _check_shape(tmp_path / "diff.xml")
    xml = junitparser.JUnitXml.fromfile(str(tmp_path / "diff.xml"))
    suite = next(iter(xml))
    cases = list(suite)
    assert [c.name for c in cases] == ["same program", "step -1", "step 0", "step 1", "step 2",
                                       "step 3"]
    steps = cases[1:]
    assert steps[0].is_passed and not steps[1].is_passed
    failure = steps[1].result[0]
    assert isinstance(failure, junitparser.Failure)
    assert failure.message.startswith("drift at rollout step 0 cond before block 0 timestep_embed_mlp#0")
    assert sum(not c.is_passed for c in steps) == 4 and suite.tests == 6


def test_identical_and_incomparable_diffs_in_junit(strict_run, tmp_path):
    res = invoke("diff", strict_run, strict_run, "--junit", tmp_path / "same.xml")
    assert res.exit_code == 0
    suite = next(iter(junitparser.JUnitXml.fromfile(str(tmp_path / "same.xml"))))
    assert suite.failures == 0 and suite.errors == 0 and suite.tests == 6
    other = tmp_path / "other"
    shutil.copytree(strict_run, other)
    import json

    m = json.loads((other / "manifest.json").read_text())
    m["fingerprint"]["arch"]["num_layers"] = 7
    (other / "manifest.json").write_text(json.dumps(m))
    res = invoke("diff", strict_run, other, "--junit", tmp_path / "inc.xml")
    assert res.exit_code == 3, res.output
    _check_shape(tmp_path / "inc.xml")
    suite = next(iter(junitparser.JUnitXml.fromfile(str(tmp_path / "inc.xml"))))
    assert suite.errors == 1 and isinstance(next(iter(suite)).result[0], junitparser.Error)


def test_a_pair_the_tolerance_profile_cannot_judge_fails_in_junit(tmp_path):
    """Common records identical, a sample in run B only: the diff exits 1 with a profile (NOT
    JUDGED), so the JUnit file has a failing case saying why, not only passed and skipped steps."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    for name, batch in (("one", 1), ("two", 2)):
        execute(RunSpec(steps=2, capture="L0", batch=batch), tmp_path / name)
    res = invoke("diff", tmp_path / "one", tmp_path / "two", "--tolerance", "strict-cuda1-vs-cpu",
                 "--junit", tmp_path / "t.xml")
    assert res.exit_code == 1, res.output
    _check_shape(tmp_path / "t.xml")
    suite = next(iter(junitparser.JUnitXml.fromfile(str(tmp_path / "t.xml"))))
    failed = [c for c in suite if c.result and isinstance(c.result[0], junitparser.Failure)]
    assert [c.name for c in failed] == ["tolerance profile strict-cuda1-vs-cpu"], [c.name for c in suite]
    assert "records are in one run only" in failed[0].result[0].message
    # report says on the console why it exits 1 (the page says it too)
    res = invoke("report", tmp_path / "one", tmp_path / "two", "--tolerance", "strict-cuda1-vs-cpu",
                 "-o", tmp_path / "r.html")
    assert res.exit_code == 1 and "NOT JUDGED  tolerance profile strict-cuda1-vs-cpu:" in res.output, res.output


def test_probe_junit_one_case_per_probe(tmp_path, monkeypatch, fake_matrix):
    monkeypatch.setattr("drifttool.probes.runner.run_matrix", lambda *a, **k: fake_matrix)
    monkeypatch.setattr("drifttool.cli.probe._heatmaps", lambda m, out: [])
    res = invoke("probe", "-o", tmp_path / "m", "--junit", tmp_path / "probe.xml")
    assert res.exit_code == 1
    _check_shape(tmp_path / "probe.xml")
    suite = next(iter(junitparser.JUnitXml.fromfile(str(tmp_path / "probe.xml"))))
    outcome = {c.name: type(c.result[0]).__name__ if c.result else "pass" for c in suite}
    assert outcome == {"repeat": "pass", "gelu_exact": "Failure", "fp8": "Skipped", "broken": "Error"}
    finding = next(c for c in suite if c.name == "gelu_exact").result[0]
    assert "expected final_adaln_out" in finding.message and "first drift: rollout step 0" in finding.message


@pytest.fixture(scope="module")
def html_report(strict_run, auto_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    res = invoke("report", strict_run, auto_run, "-o", out)
    assert res.exit_code == 1, res.output
    return out


def test_report_is_one_self_contained_page(html_report):
    html5lib = pytest.importorskip("html5lib")
    text = html_report.read_text()
    parser = html5lib.HTMLParser(strict=True, namespaceHTMLElements=False)
    doc = parser.parse(text)  # raises on any parse error
    assert doc.find(".//title").text == "drifttool report: drift"
    body = ET.tostring(doc, encoding="unicode")
    assert "DRIFT" in body and "timestep_embed_mlp" in body and "Per step" in body
    cells = {td.text for td in doc.iter("td")}
    assert not {"True", "False", "None"} & cells and {"yes", "no"} <= cells  # in words
    # the records made before the first step (the sigma table): a step in words, no sigma
    assert "before 0" in cells and not {"-1", "nan"} & cells
    imgs = doc.findall(".//img")
    assert len(imgs) == 2 and all(i.get("src").startswith("data:image/png;base64,") for i in imgs)
    for el in doc.iter():  # nothing is fetched: no script, stylesheet link or remote URL
        assert el.tag not in ("script", "link", "iframe", "object")
        for attr in ("src", "href"):
            value = el.get(attr) or ""
            assert not value or value.startswith("data:"), (el.tag, value[:60])
    assert "url(" not in text and "@import" not in text


def _chromium() -> str | None:
    for name in ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def test_report_renders_in_a_headless_browser(html_report, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium-headless-shell)")
    problems, requests = [], []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(html_report.as_uri())
        images = page.evaluate("Array.from(document.images).map(i => i.complete && i.naturalWidth)")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        browser.close()
    assert problems == [] and requests == [html_report.as_uri()]
    assert len(images) == 2 and all(w and w > 100 for w in images)
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_a_report_of_l0_runs_says_why_it_has_no_heatmap(html_report, tmp_path):
    """An L0 pair has no operator records to count per step and block: where the heatmap would
    be, one sentence says so and how to get one (it was left out without a word)."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    execute(RunSpec(capture="L0"), tmp_path / "a")
    execute(RunSpec(capture="L0", eta=1.1), tmp_path / "b")
    res = invoke("report", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "r.html")
    assert res.exit_code == 1, res.output
    figures = tmp_path.joinpath("r.html").read_text().split("<h2>Figures</h2>\n", 1)[1]
    note = figures.split("\n", 1)[0]
    assert note.startswith("<p>No drift heatmap: ") and "captured at L0" in note, figures[:600]
    assert "--capture L1" in note and note.endswith("</p>") and "<figure>" in figures, note
    assert "No drift heatmap" not in html_report.read_text()  # an L2 pair has its heatmap


def test_report_names_every_file_it_wrote(strict_run, tmp_path):
    """With ``--junit`` the JUnit file is named beside the page (it went unmentioned)."""
    page, junit = tmp_path / "r.html", tmp_path / "j.xml"
    res = invoke("report", strict_run, strict_run, "-o", page, "--junit", junit)
    assert res.exit_code == 0 and f"wrote {page} and {junit}" in " ".join(res.output.split()), res.output
    assert page.is_file() and junit.is_file()


def test_report_refuses_a_non_html_name(strict_run, tmp_path):
    res = invoke("report", strict_run, strict_run, "-o", tmp_path / "r.png")
    assert res.exit_code == 2 and "ending in .html" in res.output


def test_the_heatmap_says_the_records_before_the_first_step_in_words(strict_run, auto_run):
    """Its rows: ``before 0`` for the records made before the first step (step −1 as stored),
    the steps' numbers after; no axis says ``-1``."""
    from drifttool.artifact.reader import open_run
    from drifttool.probes.plots import _pyplot, drift_grid, heatmap_figure

    fig = heatmap_figure(drift_grid(open_run(strict_run), open_run(auto_run)))
    try:
        ax = fig.axes[0]
        rows = [t.get_text() for t in ax.get_yticklabels()]
        words = " ".join([*rows, ax.get_xlabel(), ax.get_ylabel()])
    finally:
        _pyplot().close(fig)
    assert rows[0] == "before 0" and rows[1:] == [str(s) for s in range(len(rows) - 1)], rows
    assert "-1" not in words, words
