"""The docs speak to users: README.md, docs/ and references/ link and refer only to files inside
the repository, and neither they nor the shipped code's messages cite tracker issues; the
README's Python API example runs and prints what the README says it prints."""

from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(["README.md", *(str(p.relative_to(ROOT)) for d in ("docs", "references")
                              for p in (ROOT / d).rglob("*.md"))])
SOURCES = sorted(str(p.relative_to(ROOT)) for d in ("drifttool", "cli", "probes", "references")
                 for p in (ROOT / d).rglob("*.py"))
"""The shipped code: its help texts, messages and docstrings reach users."""

TOP = r"(?:drifttool|docs|tests|cli|probes|references|fixtures|benchmarks|tools|\.ci)"
PATH_REF = re.compile(r"(?<![\w./-])(" + TOP + r"/[\w.*<>/-]*)")
"""A file reference: a path from a top-level folder of the repository (``<r>``: any part)."""
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./|(?<!\w)/work/|\b(?:https?|file)://(?!download\.pytorch\.org/whl/cpu\s)")
"""A reference outside the repository; the one address allowed is PyTorch's CPU wheel index, as
``pip install --index-url`` takes it (a command the README gives, not a link to read)."""
TRACKER = re.compile(r"\b(?:issues?|PR|pull request|ticket)\s*#?\d+|\(#\d+\)|#\d+ item\b|"
                     r"\b(?:this|the|that) issue\b|\bbefore this (?:issue|change)\b|\btracker\b",
                     re.I)
"""Tracker references: "issue 10", "(#11)", "the issue asks", "before this change". The RFC,
the public specification, is cited by its number ("RFC #386")."""


def _hits(path: str, pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    """``("path:line", match)`` of every match of ``pattern`` in the file ``path``."""
    text = (ROOT / path).read_text(encoding="utf-8")
    return [(f"{path}:{text.count(chr(10), 0, m.start()) + 1}", m) for m in pattern.finditer(text)]


def _exists(pattern: str) -> bool:
    return bool(glob.glob(str(ROOT / re.sub(r"<[^>]*>", "*", pattern))))


def test_the_scan_sees_the_docs_and_the_code():
    assert {"README.md", "docs/benchmarks.md", "docs/operators/README.md"} <= set(DOCS)
    assert {"drifttool/__init__.py", "cli/app.py"} <= set(SOURCES)


@pytest.mark.parametrize("doc", DOCS)
def test_links_and_file_references_stay_inside_the_repository(doc):
    bad = [f"{at}: {m.group(0)!r}" for at, m in _hits(doc, OUTSIDE)]
    for at, m in _hits(doc, LINK):
        target = m.group(1).split("#", 1)[0]
        path = ((ROOT / doc).parent / target).resolve()
        if target and (not path.exists() or not path.is_relative_to(ROOT)):
            bad.append(f"{at}: link {m.group(1)!r} (no such file in the repository)")
    bad += [f"{at}: {m.group(1)!r} (no such file in the repository)"
            for at, m in _hits(doc, PATH_REF) if not _exists(m.group(1).rstrip(".,;:"))]
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS)
def test_docs_cite_no_tracker_issue(doc):
    found = [f"{at}: {m.group(0)!r}" for at, m in _hits(doc, TRACKER)]
    assert not found, "tracker references (say what the tool does instead):\n" + "\n".join(found)


def test_shipped_code_cites_no_tracker_issue_and_no_file_outside_the_repository():
    found = [f"{at}: {m.group(0)!r}" for src in SOURCES
             for pat in (TRACKER, re.compile(r"\.\./shared|/work/shared")) for at, m in _hits(src, pat)]
    assert not found, "\n".join(found)


def test_the_scan_catches_what_it_forbids():
    for text in ("see issue #11", "(issue 10)", "the issue asks for", "Before this change", "(#12)",
                 "a tracker entry", "PR 7", "#12 item 4"):
        assert TRACKER.search(text), text
    for text in ("RFC #386", "timestep_embed_mlp#0", "adaln_modulation #1", "kernels issue many matmuls"):
        assert not TRACKER.search(text), text
    for text in ("`../shared/design.md`", "[spec](https://example.org)", "/work/shared/spec"):
        assert OUTSIDE.search(text), text
    assert not OUTSIDE.search("under `DIR/work/references/`, profile: strict")
    assert not OUTSIDE.search("pip install torch --index-url https://download.pytorch.org/whl/cpu && …")
    for text in ("https://download.pytorch.org/whl/cu128 ", "https://download.pytorch.org/whl/cpu/x"):
        assert OUTSIDE.search(text), text


def _readme_example() -> tuple[str, str]:
    """The Python API section's example and the output block that follows it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M)
    k = [lang for lang, _ in blocks].index("python")
    assert blocks[k + 1][0] == "", "the example's output block must follow it"
    return blocks[k][1], blocks[k + 1][1]


def test_readme_python_api_example_runs_and_prints_what_the_readme_says(tmp_path):
    code, expected = _readme_example()
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout == expected, r.stdout
