"""Output on a pipe (``drifttool diff … | cat``, CI logs): through the installed console script
with stdout a pipe and ``COLUMNS=80`` (as CI runners set it), no line of plain text is wrapped
or cut (a long path, the verdict line, a kernel string), a table's title is a line of its own
with no padding, and no line ends in spaces. On a terminal, a title wider than its table is not
wrapped to the table's width."""

from __future__ import annotations

import io
import os
import subprocess

import pytest

from drifttool.artifact import open_run
from drifttool.cli._console import _Console
from drifttool.diff import diff_runs, render
from tests.cli.scripting import console_script

ENV = {**os.environ, "COLUMNS": "80"}
_KERNEL = "strict_linear.v2[seg8.k64.seq|exact if N*K<=65536 else mm16x128]"
"""A strict kernel's identity, wider than 80 columns with its line of ``diff``'s trace context."""


def _piped(*args) -> subprocess.CompletedProcess:
    return subprocess.run([console_script(), *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=ENV, timeout=300)


def _assert_clean_lines(out: str) -> None:
    for line in out.splitlines():
        assert line == line.rstrip(), f"trailing spaces: {line!r}"


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """(run directory at a path of over 170 characters, the piped output of ``drifttool run``
    that wrote it): a production run, so that it drifts from the strict one."""
    out = (tmp_path_factory.mktemp("pipe") / ("runs-" + "p" * 60) / ("b-" + "q" * 60)
           / "production")
    assert len(str(out)) > 170
    res = _piped("run", "--mode", "auto", "-o", out)
    assert res.returncode == 0, res.stderr
    return out, res.stdout


def test_run_summary_names_its_long_output_path_on_one_line(long_run):
    out, stdout = long_run
    assert stdout.splitlines()[0] == f"drifttool run → {out}", stdout[:400]
    _assert_clean_lines(stdout)


def test_piped_diff_wraps_no_line(strict_run, long_run):
    out, _ = long_run
    res = _piped("diff", strict_run, out)
    assert res.returncode == 1, res.stderr
    lines = res.stdout.splitlines()
    report = diff_runs(open_run(strict_run), open_run(out))
    assert lines[0] == f"DRIFT  {report.reason}"  # `| head -1` gives the whole verdict
    assert len(lines[0]) > 160
    assert f"A: {strict_run}" in lines and f"B: {out}" in lines
    context = [ln for ln in lines if ln.startswith("  - trace ") and " latent_proj_gemm#0:" in ln]
    assert len(context) == 1 and _KERNEL in context[0], res.stdout[:3000]
    assert "per step (worst sample and branch; '=' bitwise identical; x_t is the input)" in lines
    _assert_clean_lines(res.stdout)


def test_piped_trace_title_is_one_unpadded_line(strict_run):
    res = _piped("trace", strict_run)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"operator trace — {strict_run} (mode strict)"
    for name in ("latent_proj_gemm", "txt_in_rmsnorm_linear", "timestep_embed_mlp"):
        assert any(f" {name} " in ln for ln in lines), name
    _assert_clean_lines(res.stdout)


def test_piped_report_names_its_long_output_path_on_one_line(strict_run, long_run, tmp_path):
    out, _ = long_run
    page = out.parent / ("report-" + "r" * 40) / "report.html"
    res = _piped("report", strict_run, out, "-o", page)
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines() == [f"DRIFT  {diff_runs(open_run(strict_run), open_run(out)).reason}",
                                       f"wrote {page}"]


def test_a_title_wider_than_its_table_is_one_line_on_a_terminal(strict_run):
    buf = io.StringIO()
    render(diff_runs(open_run(strict_run), open_run(strict_run)),
           _Console(file=buf, force_terminal=True, width=200, color_system=None))
    title = "per step (worst sample and branch; '=' bitwise identical; x_t is the input)"
    assert title in buf.getvalue().splitlines(), buf.getvalue()


@pytest.mark.parametrize("width", [80, 60, 44])
def test_diff_on_a_narrow_terminal_cuts_no_value(strict_run, long_run, width):
    """On a terminal too narrow for a table every value prints whole (a table whose columns
    would shrink cut ``1.19e-07`` to ``1.19e-…`` and ``timestep_embed_mlp#0`` to
    ``timestep_embed_m…``): such a table is a listing, a row's first cell on a line and each
    other cell under it, ``  header: value``. Every line fits the terminal and every number and
    name of the wide report is there."""
    import re

    report = diff_runs(open_run(strict_run), open_run(long_run[0]))

    def shown(columns: int) -> str:
        buf = io.StringIO()
        render(report, _Console(file=buf, force_terminal=True, width=columns, color_system=None))
        return buf.getvalue()

    narrow, wide = shown(width), shown(400)
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= width, narrow
    values = lambda out: set(re.findall(r"[0-9][0-9.e+-]*[0-9]|[a-z_]+#[0-9]+", out))  # noqa: E731
    assert values(wide) <= values(narrow), sorted(values(wide) - values(narrow))
    assert re.search(r"^  logp_t max\|Δ\|: [0-9.e-]+$", narrow, re.M), narrow  # the listing's form
    assert "per step (worst sample" in wide and "  logp_t max|Δ|:" not in wide  # a table there


@pytest.mark.parametrize("command", [["--help"], ["probe", "--help"], ["run", "--help"], ["fixture"],
                                     ["experiment"]], ids=lambda c: " ".join(c))
def test_help_on_a_pipe_has_no_padded_lines(command):
    """Also a bare command group's (``drifttool fixture``), which prints its help."""
    res = _piped(*command)
    assert res.returncode in (0, 2), res.stderr
    _assert_clean_lines(res.stdout)
    assert "Usage: drifttool" in res.stdout and res.stdout.rstrip().endswith("(SIGTERM).")


def test_brackets_in_kernel_strings_and_paths_show_as_written(strict_run, tmp_path):
    """rich reads ``[…]`` as markup: a trace cell's kernel string, a run folder named with
    brackets, must print as written (they lost their bracketed part)."""
    import shutil

    marked = tmp_path / "[red]runs" / "[bold]a"
    shutil.copytree(strict_run, marked)
    res = _piped("trace", marked)
    assert res.returncode == 0, res.stderr
    assert str(marked) in res.stdout.splitlines()[0] and f" {_KERNEL} " in res.stdout, res.stdout[:600]
    res = _piped("diff", marked, strict_run)
    assert res.returncode == 0 and f"A: {marked}" in res.stdout, res.stdout + res.stderr


def test_trace_on_a_narrow_terminal_cuts_no_identifier(strict_run, monkeypatch):
    """On a 100-column terminal the trace fits: what every call site shares (rank, device, …) is
    one line under the table, reasons are listed under it, operator names print whole and a
    kernel string folds onto lines of its own (it was cut to ``str…`` in 14 columns of 4)."""
    from drifttool.cli import trace as trace_command

    buf = io.StringIO()
    monkeypatch.setattr(trace_command, "console",
                        _Console(file=buf, force_terminal=True, width=100, color_system=None))
    trace_command.trace(strict_run, fallbacks_only=False, as_json=False)
    lines = buf.getvalue().splitlines()
    assert max(map(len, lines)) <= 100, buf.getvalue()
    assert "every call site: rank 0, device cpu, component mmdit, requested strict, actual strict, " \
           "fallback no" in lines
    sites = open_run(strict_run).trace_rows()
    reasons = {r["reason"] for r in sites if r["reason"]}
    assert reasons and all(any(reason.split()[0] in ln for ln in lines if ln.startswith("reason, ")) for reason in reasons)
    header = next(ln for ln in lines if ln.startswith("┃"))
    names = [c.strip() for c in header.strip("┃").split("┃")]
    rows, kernel = [], names.index("kernel")
    for ln in lines:
        if ln.startswith("│"):
            cells = [c.strip() for c in ln.strip("│").split("│")]
            if cells[0] or not rows:
                rows.append(cells)
            else:  # a folded cell's next line
                rows[-1][kernel] += cells[kernel]
    assert len(rows) == len(sites)
    assert {r[names.index("op")] for r in rows} == {s["op"] for s in sites}
    assert sorted(r[kernel].replace(" ", "") for r in rows) == sorted(s["kernel"].replace(" ", "") for s in sites)


@pytest.mark.parametrize("width", [72, 80])
def test_trace_on_a_narrow_terminal_folds_no_word(strict_run, monkeypatch, width):
    """On a 72- or 80-column terminal every line fits, every operator name prints whole on one
    line, and a line under the table folds only after a space or punctuation: the output holds
    the same words as on a wide terminal (a kernel folded as ``tree_rm`` / ``snorm``, a column
    cut to ``contrac`` or dropped, gave words of its own or lost some)."""
    import re

    from drifttool.cli import trace as trace_command

    def shown(columns: int) -> list[str]:
        buf = io.StringIO()
        monkeypatch.setattr(trace_command, "console",
                            _Console(file=buf, force_terminal=True, width=columns, color_system=None))
        trace_command.trace(strict_run, fallbacks_only=False, as_json=False)
        out = buf.getvalue().splitlines()
        return out[next(i for i, ln in enumerate(out) if ln.startswith("┏")):]  # from the table on

    lines = shown(width)
    assert max(map(len, lines)) <= width, "\n".join(lines)
    words = lambda ls: sorted(set(re.findall(r"[A-Za-z0-9]+", "\n".join(ls))))  # noqa: E731
    assert words(lines) == words(shown(400)), "\n".join(lines)
    ops = {c.strip() for ln in lines if ln.startswith("│") for c in ln.strip("│").split("│")}
    assert {s["op"] for s in open_run(strict_run).trace_rows()} <= ops, "\n".join(lines)


@pytest.mark.parametrize("width", [30, 40, 57, 65])
def test_trace_on_a_terminal_too_narrow_for_its_table_lists_its_sites(strict_run, monkeypatch, width):
    """Below the narrowest table whose cells fit whole (about 71 columns here) each call site is
    listed (its site on a line, its other columns under it) instead of a table whose headers and
    cells rich cut (``bloc``, ``str``) or fold (``latent_proj_`` / ``gemm``): every line fits,
    every operator name prints whole, and no word is one the wide trace lacks."""
    import re

    from drifttool.cli import trace as trace_command

    def shown(columns: int) -> list[str]:
        buf = io.StringIO()
        monkeypatch.setattr(trace_command, "console",
                            _Console(file=buf, force_terminal=True, width=columns, color_system=None))
        trace_command.trace(strict_run, fallbacks_only=False, as_json=False)
        return buf.getvalue().splitlines()

    lines = shown(width)
    assert max(map(len, lines)) <= width, "\n".join(lines)
    words = lambda ls: set(re.findall(r"[A-Za-z0-9]+", "\n".join(ls)))  # noqa: E731
    assert words(lines) <= words(shown(400)) | {"b0", "b1", "b2"}, "\n".join(lines)
    sites = open_run(strict_run).trace_rows()
    for s in sites:
        assert any(re.search(rf"(^| ){s['op']}#{s['call']}$", ln) for ln in lines), s["op"]
    assert sum(ln.startswith("  contract ") for ln in lines) == len(sites), "\n".join(lines)
    assert lines[-1] == f"{len(sites)} call sites, 0 with fallback"


def test_trace_sites_leave_out_a_stream_of_none(strict_run, monkeypatch):
    """A call site of no stream (the timestep embedding, the sigma table) is ``before b0
    timestep_embed_mlp#0``, as diff's trace context names it, not ``before b0 none …``."""
    from drifttool.cli import trace as trace_command

    buf = io.StringIO()
    monkeypatch.setattr(trace_command, "console",
                        _Console(file=buf, force_terminal=True, width=40, color_system=None))
    trace_command.trace(strict_run, fallbacks_only=False, as_json=False)
    lines = buf.getvalue().splitlines()
    assert "before b0 timestep_embed_mlp#0" in lines and "sampler flow_sigma_table#0" in lines, lines
    assert "after b1 img final_adaln_out#0" in lines, lines  # the final norm, after the last block
    assert not any(" none " in f" {ln} " for ln in lines), "\n".join(lines)


@pytest.mark.parametrize("args", [(), ("--peer", "diffusers"), ("--distributed",)], ids=["matrix", "peer", "distributed"])
def test_probe_list_on_a_narrow_terminal_cuts_no_name(cli, monkeypatch, args):
    """``probe --list`` is a table: on a terminal too narrow for its expectations whole (60
    columns) each probe is listed (``probe NAME`` on a line, its kind, factor and expectations
    under it), every name whole; on a wide one, a probe a row."""
    from drifttool.cli import probe as probe_command

    def shown(columns: int) -> list[str]:
        buf = io.StringIO()
        monkeypatch.setattr(probe_command, "console",
                            _Console(file=buf, force_terminal=True, width=columns, color_system=None))
        code, out = cli("probe", *args, "--list")
        assert code == 0, out
        return buf.getvalue().splitlines()

    wide, narrow = shown(400), shown(60)
    names = [ln.split()[0] for ln in wide[2:]]
    assert names and wide[0].split()[0] == "probe" and len(wide) == len(names) + 2, "\n".join(wide)
    assert [ln.split(" ", 1)[1] for ln in narrow if ln.startswith("probe ")] == names, "\n".join(narrow)
    assert sum(ln.startswith("  kind: ") for ln in narrow) == len(names), "\n".join(narrow)
