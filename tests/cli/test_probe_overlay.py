"""``drifttool probe`` (selection, listing, bad input) and ``drifttool overlay``.

The whole tiny matrix through the CLI is ``tests/probes`` (one session run).
"""

from __future__ import annotations

import json

import pytest

from drifttool.probes.spec import Expectation
from drifttool.probes.variants import GeluExact
from drifttool.runner import execute
from drifttool.settings import RunSpec


@pytest.mark.slow  # a baseline and three probes through the CLI (30 s): .ci/run's slow step
def test_probe_list_selection_and_a_finding(cli, tmp_path, monkeypatch):
    code, out = cli("probe", "--list")  # listing needs no output directory
    assert code == 0 and "rope_rotate_half" in out and "gradient_checkpointing" in out
    code, out = cli("probe", "--only", "repeat")
    assert code == 2 and "give -o/--out" in out
    # plant a wrong expectation: the matrix must report it as a finding and exit 1
    import drifttool.probes.catalog as C

    real = C.catalog

    def wrong(settings=None, num_layers=2, **kw):
        return [p.with_(expect=Expectation(verdict="drift", op="final_adaln_out"))
                if p.name == "gelu_exact" else p for p in real(settings, num_layers, **kw)]

    monkeypatch.setattr(C, "catalog", wrong)
    code, out = cli("probe", "--only", "repeat,gelu_exact,ulp_txt_qk_rmsnorm", "-o", tmp_path / "m")
    assert code == 1, out
    assert "FINDING gelu_exact" in out and "expected final_adaln_out" in out
    rows = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines() if ln.split()[:1] in (["repeat"], ["gelu_exact"])}
    assert rows == {"repeat": "PASS", "gelu_exact": "FINDING"}, out  # styled, not markup text ("[/]")
    assert "first drift at mlp_up_gemm_gelu, expected final_adaln_out" in out
    data = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert [(r["name"], r["status"]) for r in data["results"]] == [
        ("gelu_exact", "FINDING"), ("repeat", "PASS"), ("ulp_txt_qk_rmsnorm", "PASS")]
    assert data["exit_code"] == 1
    assert (tmp_path / "m" / "matrix.arrow").is_file()
    assert (tmp_path / "m" / "heatmaps" / "ulp_txt_qk_rmsnorm.png").is_file()


def test_probe_bad_input_exits_2(cli, tmp_path):
    code, out = cli("probe", "--only", "no_such_probe", "-o", tmp_path / "m")
    assert code == 2 and "unknown probe no_such_probe; known: " in out and "[" not in out, out
    code, out = cli("probe", "--only", "repeat,", "-o", tmp_path / "m")  # as run --samples 0,
    assert code == 2 and "an empty entry in 'repeat,'" in out and not (tmp_path / "m").exists(), out
    for empty in ("", " , "):  # a CI gate that selects nothing must not pass
        code, out = cli("probe", "--only", empty, "-o", tmp_path / "m")
        assert code == 2 and "names no probe" in out and not (tmp_path / "m").exists(), out
        code, out = cli("probe", "--peer", "diffusers", "--only", empty, "-o", tmp_path / "m")
        assert code == 2 and "names no peer probe" in out, out
    code, out = cli("probe", "--preset", "huge", "-o", tmp_path / "m")
    assert code == 2 and "unknown preset" in out
    code, out = cli("probe", "--checkpoint", tmp_path / "missing", "-o", tmp_path / "m")
    assert code == 2


@pytest.mark.slow  # matplotlib renders the figure (about 8 s)
def test_overlay_draws_one_figure(cli, tmp_path, strict_run):
    v = GeluExact()
    execute(RunSpec(variants={v.op: v.entry()}), tmp_path / "gelu")
    execute(RunSpec(mode="auto"), tmp_path / "auto")
    code, out = cli("overlay", strict_run, tmp_path / "gelu", tmp_path / "auto", strict_run,
                    "-o", tmp_path / "fig" / "overlay.png")
    assert code == 0, out
    assert (tmp_path / "fig" / "overlay.png").read_bytes()[:4] == b"\x89PNG"
    assert "gelu: DRIFT — first drift at rollout step 0 cond block 0 img mlp_up_gemm_gelu" in out
    assert "strict: IDENTICAL — identical at L2: step records, operator outputs" in out
    # a run of one common sample says which samples the verdict covers, and at which level
    execute(RunSpec(samples=[1], capture="L0"), tmp_path / "s1")
    code, out = cli("overlay", strict_run, tmp_path / "s1", "-o", tmp_path / "fig" / "s1.png")
    assert code == 0, out
    assert "s1: IDENTICAL — identical at L0: step boundaries only; all" in out
    assert "records of the common samples [1] are bitwise identical" in out


def test_overlay_needs_two_runs_and_readable_artifacts(cli, tmp_path, strict_run):
    assert cli("overlay", strict_run, "-o", tmp_path / "f.png")[0] == 2
    assert cli("overlay", strict_run, tmp_path / "nope", "-o", tmp_path / "f.png")[0] == 2


def _incomparable_copy(run, dst):
    """A copy of ``run`` whose fingerprint names another depth: ``diff`` cannot align it."""
    import shutil

    shutil.copytree(run, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["fingerprint"]["arch"]["num_layers"] += 1
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_overlay_never_draws_an_incomparable_run_as_identical(cli, tmp_path, strict_run):
    from drifttool.probes import plots

    other = _incomparable_copy(strict_run, tmp_path / "other")
    code, out = cli("overlay", strict_run, strict_run, other, "-o", tmp_path / "ov.png")
    assert code == 3, out  # as `drifttool diff` exits for an incomparable pair
    assert "other: INCOMPARABLE" in out and (tmp_path / "ov.png").is_file()
    fig, reports = plots.overlay_figure(strict_run, [strict_run, other], labels=["same", "other"])
    try:
        texts = ["\n".join(t.get_text() for t in ax.texts) for ax in fig.axes[:len(plots.QUANTITIES)]]
        curves = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert [r.verdict.value for r in reports] == ["identical", "incomparable"]
    for text in texts:  # every panel: the identical run as identical, the other as incomparable
        assert "identical: same" in text and "other" not in text.split("incomparable:")[0], text
        assert "incomparable: other (cannot align: fingerprint.arch.num_layers" in text, text
    assert not any("other" in c for c in curves)


def test_overlay_panel_notes_name_each_verdict():
    from drifttool.diff.report import DiffReport, Verdict
    from drifttool.probes.plots import QUANTITIES, panel_notes

    reports = [DiffReport(verdict=Verdict.IDENTICAL, reason="", run_a="a", run_b="b"),
               DiffReport(verdict=Verdict.INCONCLUSIVE, reason="run B is incomplete", run_a="a",
                          run_b="c"),
               DiffReport(verdict=Verdict.INCOMPARABLE, reason="cannot align: x", run_a="a",
                          run_b="d")]
    notes = panel_notes(["b", "c", "d"], reports)
    for q, _ in QUANTITIES:  # no step values at all: "not compared", never "identical"
        assert notes[q] == ["not compared: b", "inconclusive: c (run B is incomplete)",
                            "incomparable: d (cannot align: x)"]
