"""An L2 capture without the fused attention's internals (``--no-internals``): what it leaves out
and keeps, and how diff, replay, recompute, ``diff --localize``, the memory estimate and the Ring
layout treat it."""

from __future__ import annotations

import json

import pytest

from drifttool.artifact import open_run
from drifttool.artifact import schema as S

WITHOUT = "without the fused attention's internals"


def _manifest(run) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _rows(out: str) -> list[list[str]]:
    """The cells of a summary table's rows (``│ key │ value │``)."""
    return [ln.strip("│ ").replace("│", " ").split() for ln in out.splitlines()]


def _records(run) -> dict[tuple, tuple]:
    """Op records by identity: (digest, row digests)."""
    t = open_run(run).ops_table()
    keys = list(zip(*(t.column(k).to_pylist() for k in S.OPS_KEY)))
    return dict(zip(keys, zip(t.column("digest").to_pylist(), t.column("row_digests").to_pylist())))


def test_l2_without_internals_keeps_every_other_record_byte_for_byte(cli, tmp_path, strict_run):
    code, out = cli("run", "-o", tmp_path / "n", "--no-internals")  # the fixture's level: L2
    assert code == 0 and ["internals", "no"] in _rows(out), out
    m = _manifest(tmp_path / "n")
    assert m["capture_level"] == "L2" and m["settings"]["internals"] is False
    assert _manifest(strict_run)["capture_level"] == "L2" and "internals" not in _manifest(strict_run)["settings"]
    full, kept = _records(strict_run), _records(tmp_path / "n")
    role = S.OPS_KEY.index("role")
    internal = {k for k in full if k[role] == "internal"}
    assert {k[S.OPS_KEY.index("op")] for k in internal} == {
        "joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm"}
    assert set(kept) == set(full) - internal  # everything else, row digests included
    assert all(kept[k] == full[k] for k in kept) and sum(bool(v[1]) for v in kept.values()) > len(kept) // 2
    code, out = cli("diff", strict_run, tmp_path / "n")
    flat = " ".join(out.split())
    assert code == 0 and flat.startswith(f"IDENTICAL identical at L2: step records, operator outputs "
                                         f"and their row digests, {WITHOUT}"), out
    assert (f"internals not compared: run B captured L2 without them (--no-internals); run A's "
            f"{len(internal)} internal records left out of the counts") in flat


def test_below_l2_the_option_changes_nothing_and_says_so(cli, tmp_path):
    code, out = cli("run", "-o", tmp_path / "l1", "--capture", "L1", "--steps", "2", "--no-internals")
    assert code == 0 and "--no-internals changes nothing at capture L1" in " ".join(out.split()), out
    assert "internals" not in _manifest(tmp_path / "l1")["settings"]
    code, out = cli("run", "-o", tmp_path / "l1b", "--capture", "L1", "--steps", "2", "--internals")
    assert code == 0 and "--internals changes nothing at capture L1" in " ".join(out.split()), out
    code, out = cli("run", "-o", tmp_path / "l1c", "--capture", "L1", "--steps", "2")  # not given: no note
    assert code == 0 and "changes nothing" not in " ".join(out.split()), out


@pytest.mark.parametrize("cmd", ["replay", "recompute"])
def test_a_rerun_below_l2_or_in_production_says_the_option_changes_nothing(cli, tmp_path, strict_run, cmd):
    """As ``run`` does: given below L2 or in a production mode, either flag is noted; at L2 in
    strict mode (where it applies) and when not given, nothing is said."""
    for i, (extra, words) in enumerate((
            (["--capture", "L1", "--internals"], "--internals changes nothing at capture L1"),
            (["--mode", "auto", "--no-internals"], "--no-internals changes nothing in mode auto"),
            (["--no-internals"], None), ([], None))):
        code, out = cli(cmd, strict_run, "-o", tmp_path / f"{cmd}{i}", *extra)
        flat = " ".join(out.split())
        assert code == 0 and (words in flat if words else "changes nothing" not in flat), (extra, out)


def test_in_a_production_mode_the_option_changes_nothing_and_says_so(cli, tmp_path):
    """Production attention (one fused SDPA call) exposes no internals: ``--no-internals`` in
    mode auto leaves the manifest as it is, and the run says so."""
    code, out = cli("run", "-o", tmp_path / "auto", "--mode", "auto", "--steps", "2", "--no-internals")
    assert code == 0 and ("--no-internals changes nothing in mode auto: production attention exposes "
                          "no internals") in " ".join(out.split()), out
    assert "internals" not in _manifest(tmp_path / "auto")["settings"]
    assert cli("run", "-o", tmp_path / "auto2", "--mode", "auto", "--steps", "2")[0] == 0
    code, out = cli("diff", tmp_path / "auto", tmp_path / "auto2")
    assert code == 0 and WITHOUT not in " ".join(out.split()), out


def test_replay_and_recompute_keep_the_runs_choice_unless_told(cli, tmp_path):
    run = tmp_path / "n"
    assert cli("run", "-o", run, "--steps", "2", "--no-internals")[0] == 0
    code, out = cli("replay", run, "-o", tmp_path / "r")
    assert code == 0 and ["internals", "no"] in _rows(out), out
    assert _manifest(tmp_path / "r")["settings"]["internals"] is False
    assert set(_records(tmp_path / "r")) == set(_records(run))
    code, out = cli("diff", run, tmp_path / "r")
    assert code == 0 and WITHOUT in " ".join(out.split()), out
    code, out = cli("replay", run, "-o", tmp_path / "ri", "--internals")
    assert code == 0, out
    assert "internals" not in _manifest(tmp_path / "ri")["settings"]
    assert len(_records(tmp_path / "ri")) > len(_records(run))
    code, out = cli("recompute", run, "-o", tmp_path / "t")
    assert code == 0, out
    assert _manifest(tmp_path / "t")["settings"]["internals"] is False
    roles = open_run(tmp_path / "t").ops_table().column("role").to_pylist()
    assert "internal" not in roles and "output" in roles


def test_localize_captures_the_internals_the_runs_left_out(cli, tmp_path):
    for name, mode in (("a", "strict"), ("b", "auto")):
        assert cli("run", "-o", tmp_path / name, "--steps", "2", "--mode", mode, "--no-internals")[0] == 0
    code, out = cli("diff", tmp_path / "a", tmp_path / "b", "--localize-dir", tmp_path / "loc")
    assert code == 1 and "localized" in out, out
    for side in ("a", "b"):
        assert "internals" not in _manifest(tmp_path / "loc" / side)["settings"]
    # the strict run's attention is unfused there (production's SDPA has no internals to capture)
    assert "internal" in open_run(tmp_path / "loc" / "a").ops_table().column("role").to_pylist()


def test_the_setting_is_recorded_only_where_it_leaves_something_out():
    from drifttool.memory import unfused_attention
    from drifttool.settings import RunSpec, resolve

    for spec, want in ((RunSpec(), None), (RunSpec(internals=True), None),
                       (RunSpec(internals=False), False), (RunSpec(internals=False, capture="L1"), None)):
        _, s = resolve(spec)
        assert s.record().get("internals") is want, spec
        assert unfused_attention(s) is (s.capture == "L2" and spec.internals is not False)


def test_ring_attention_at_l2_needs_the_internals_left_out():
    from drifttool.distributed import DistContext
    from drifttool.distributed.plan import ParallelDims, ParallelPlan
    from drifttool.errors import UnsupportedConfigError
    from drifttool.fixture import load_fixture
    from drifttool.model.checkpoint import read_config

    config = read_config(load_fixture("tiny-t2i").model_dir)
    dims = ParallelDims(sp=2, sp_attention="ring")
    ctx = DistContext(rank=0, world_size=2)
    with pytest.raises(UnsupportedConfigError, match="--no-internals"):
        ParallelPlan.build(ctx, dims, config, capture_level="L2")
    assert ParallelPlan.build(ctx, dims, config, capture_level="L2", internals=False).dims == dims


def test_production_attention_exposes_none_so_strict_internals_are_left_aside(cli, tmp_path, strict_run):
    """Strict against production at L2: production's SDPA is one fused call with no internal
    records, so strict's are left out of the comparison (not "only A"), and a note counts them;
    two production runs have nothing to leave aside."""
    for name in ("auto", "auto2"):
        assert cli("run", "-o", tmp_path / name, "--mode", "auto")[0] == 0
    internal = sum(k[S.OPS_KEY.index("role")] == "internal" for k in _records(strict_run))
    assert internal > 0 and "internals" not in _manifest(tmp_path / "auto")["settings"]
    code, out = cli("diff", strict_run, tmp_path / "auto", "--json")
    report = json.loads(out)
    assert code == 1 and report["verdict"] == "drift" and report["covers"].endswith(WITHOUT), out
    assert report["counts"]["ops"]["only_a"] == 0 and report["counts"]["ops"]["only_b"] == 0, report["counts"]
    assert (f"run B's attention exposes none (production attention); run A's {internal} internal "
            "records left out of the counts and the trace context") in " ".join(report["notes"])
    internal_ops = ("joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm")
    assert not [c for c in report["context"] if any(op in c for op in internal_ops)], report["context"]
    assert any(c.startswith("trace ") and "joint_attention_fused" in c for c in report["context"])
    code, out = cli("diff", tmp_path / "auto", tmp_path / "auto2", "--json")
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "identical" and WITHOUT not in report["covers"], out
    assert not any("internals" in n for n in report["notes"]), report["notes"]
