"""JUnit XML for CI (GitLab, Jenkins, GitHub render it as tests): a diff or a probe matrix.

    <testsuites name="drifttool" tests="5" failures="1" errors="0" skipped="0">
      <testsuite name="drifttool diff runs/a runs/b" tests="5" failures="1" ...>
        <properties><property name="verdict" value="drift"/>...</properties>
        <testcase classname="drifttool.diff.rollout" name="step 0" time="0"/>
        <testcase classname="drifttool.diff.rollout" name="step 1" time="0">
          <failure type="drift" message="drift at rollout step 1 cond block 0 img ...">...</failure>
        </testcase>
      </testsuite>
    </testsuites>

A diff has a test case for the semantic pre-check (``same program``: fails on a semantic
mismatch) and one test case per compared (phase, step): it fails when the step's records differ
(the first drift's step carries the first drift as its message), is skipped when the step has
records only one run holds and none that differ, and passes otherwise; with a tolerance profile a
differing step within it passes, and a pair it cannot judge (records in one run only, differing
replay inputs, an incomplete run) adds a failing test case ``tolerance profile P`` saying why (the
diff exits non-zero). An incomparable pair is one test case in error; an inconclusive diff adds a
test case in error saying why. A probe matrix has one test case per probe: FINDING
fails (its reasons as the message), ERROR is an error, PENDING and NOT APPLICABLE are skipped,
PASS and OBSERVED pass.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from drifttool.errors import writing


@dataclass(kw_only=True)
class Case:
    """One ``<testcase>``: ``outcome`` is ``"pass"``, ``"failure"``, ``"error"`` or ``"skipped"``."""

    classname: str
    name: str
    outcome: str = "pass"
    message: str = ""
    detail: str = ""
    kind: str = ""
    seconds: float = 0.0


@dataclass(kw_only=True)
class Suite:
    """One ``<testsuite>``: its cases and ``properties`` (name → value)."""

    name: str
    cases: list[Case] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)


def diff_suite(report: Any) -> Suite:
    """The test suite of a ``DiffReport`` (module docstring)."""
    suite = Suite(name=f"drifttool diff {report.run_a} {report.run_b}",
                  properties={"verdict": report.verdict.value, "reason": report.reason,
                              "run_a": report.run_a, "run_b": report.run_b,
                              "level": report.level or "", "exit_code": str(report.exit_code)})
    verdict = report.verdict.value
    semantic = getattr(report, "semantic", None)
    if semantic is not None:  # the semantic pre-check: the runs are the same program
        suite.cases.append(Case(classname="drifttool.diff", name="same program",
                                outcome="failure" if semantic.mismatch else "pass",
                                kind="semantic_mismatch" if semantic.mismatch else "",
                                message=semantic.words() if semantic.mismatch else ""))
    if verdict == "incomparable":
        suite.cases.append(Case(classname="drifttool.diff", name="runs align", outcome="error",
                                kind="incomparable", message=report.reason,
                                detail="\n".join(report.incomparable)))
        return suite
    within = report.tolerance is not None and report.tolerance.ok
    fd = report.first_drift
    for s in report.steps:
        case = Case(classname=f"drifttool.diff.{s.phase}", name=f"step {s.step}")
        differs = not s.identical and (s.ops_differ > 0 or any(
            q.identical is False for q in s.quantities) or s.carried_in)
        if fd is not None and (fd.phase, fd.step) == (s.phase, s.step):
            differs = True
            case.message = f"drift at {fd.where()}; {fd.origin_words()}"
        elif differs:
            first = f" first differing op {s.first_op}" if s.first_op is not None else ""
            case.message = f"{s.phase} step {s.step}: {s.ops_differ} differing op records;{first}"
        if differs and within:
            case.detail = f"within {report.tolerance.words()}"
        elif differs:
            case.outcome, case.kind = "failure", "drift"
            case.detail = _step_detail(s)
        elif not s.identical:
            case.outcome, case.kind = "skipped", "missing"
            case.message = f"{s.missing} records of this step are in one run only"
        suite.cases.append(case)
    tol = report.tolerance
    if tol is not None and tol.blocked:  # the pair is not one the profile can judge: the exit is 1
        suite.cases.append(Case(classname="drifttool.diff", name=f"tolerance profile {tol.profile}",
                                outcome="failure", kind="not_judged", message=tol.words()))
    if verdict == "inconclusive":
        suite.cases.append(Case(classname="drifttool.diff", name="every record compared",
                                outcome="error", kind="inconclusive", message=report.reason,
                                detail="\n".join(report.notes)))
    return suite


def _step_detail(s: Any) -> str:
    """The step's differing quantities, one per line (worst max |Δ| each)."""
    lines = []
    for name in sorted({q.quantity for q in s.quantities if q.identical is False}):
        q = s.worst(name)
        lines.append(f"{name}: max|Δ| {q.max_abs} rel_l2 {q.rel_l2} (sample {q.sample} {q.branch})")
    return "\n".join(lines)


_PROBE_OUTCOMES = {"PASS": "pass", "OBSERVED": "pass", "FINDING": "failure", "ERROR": "error",
                   "PENDING": "skipped", "NOT APPLICABLE": "skipped"}


def probe_suite(matrix: Any, name: str = "drifttool probe") -> Suite:
    """The test suite of a probe ``Matrix`` (module docstring)."""
    suite = Suite(name=name, properties={"baseline": str(matrix.baseline), "out": str(matrix.out),
                                         "exit_code": str(matrix.exit_code)})
    for r in matrix.results:
        outcome = _PROBE_OUTCOMES.get(r.status, "error")
        message = "; ".join(r.reasons) or r.status
        if outcome == "failure" and r.first_drift:
            message = f"{message}; first drift: {r.first_drift}"
        suite.cases.append(Case(
            classname=f"drifttool.probe.{r.kind}", name=r.name, outcome=outcome,
            kind=r.status.lower().replace(" ", "_"), message="" if outcome == "pass" else message,
            detail=f"expected: {r.expected}\nverdict: {r.verdict}\nfirst drift: {r.first_drift}",
            seconds=r.seconds or 0.0))
    return suite


ROOT_NAME = "drifttool"
"""The root ``<testsuites name=...>`` of every JUnit file drifttool writes: what lets a later
``--junit`` replace it (and no other tool's)."""


def to_xml(suites: Iterable[Suite]) -> ET.Element:
    """``<testsuites>`` holding every suite (module docstring)."""
    suites = list(suites)
    root = ET.Element("testsuites", name=ROOT_NAME)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    seconds = 0.0
    for suite in suites:
        counts = {"tests": len(suite.cases), "failures": suite.count("failure"),
                  "errors": suite.count("error"), "skipped": suite.count("skipped")}
        took = sum(c.seconds for c in suite.cases)
        el = ET.SubElement(root, "testsuite", name=suite.name, time=f"{took:.3f}",
                           **{k: str(v) for k, v in counts.items()})
        if suite.properties:
            props = ET.SubElement(el, "properties")
            for k, v in suite.properties.items():
                ET.SubElement(props, "property", name=k, value=v)
        for c in suite.cases:
            case = ET.SubElement(el, "testcase", classname=c.classname, name=c.name,
                                 time=f"{c.seconds:.3f}")
            if c.outcome == "skipped":
                ET.SubElement(case, "skipped", message=c.message)
            elif c.outcome in ("failure", "error"):
                ET.SubElement(case, c.outcome, message=c.message, type=c.kind).text = c.detail
            elif c.detail:
                ET.SubElement(case, "system-out").text = c.detail
        for k in totals:
            totals[k] += counts[k]
        seconds += took
    root.attrib.update({k: str(v) for k, v in totals.items()}, time=f"{seconds:.3f}")
    return root


def write_junit(suites: Iterable[Suite], path: str | Path) -> Path:
    """Write ``to_xml(suites)`` to ``path`` (UTF-8, with an XML declaration); returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    tree = ET.ElementTree(to_xml(suites))
    ET.indent(tree)
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path):
        tree.write(path, encoding="utf-8", xml_declaration=True)
    return path
