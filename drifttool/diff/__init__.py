"""Diff two trajectory artifacts: align by identity, first drift, per-step drift, report.

``align`` (identity -> index pairs) -> ``compare.diff_runs`` (verdict, per step; the first
drift and its origin: ``first_drift``) ->
``values`` (value drift and SDE KL from stored bytes) -> ``report`` (typed result, JSON, exit
codes) -> ``render`` (rich tables). Source: design.md, "Diff".
"""

from drifttool.diff.compare import diff_runs
from drifttool.diff.render import render
from drifttool.diff.report import DiffReport, Verdict, exit_code

__all__ = ["DiffReport", "Verdict", "diff_runs", "exit_code", "render"]
