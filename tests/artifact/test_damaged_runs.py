"""Damaged run directories (issue #8 item 3): ``drifttool diff GOOD BAD``, ``diff BAD GOOD`` and
``diff --json`` each exit 2 with exactly one line, no traceback, write nothing and leave both
runs unchanged — never a crash, never "identical". The corpus is ``damaged_runs.DAMAGES``.

Byte-level damage to a record batch (corrupt lengths or string offsets) crashed the process with
SIGSEGV before the reader validated batches, so those cases run in a subprocess."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from damaged_runs import DAMAGES

IN_SUBPROCESS = {"ops string offsets", "steps string offsets", "ops batch length",
                 "steps batch length"}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A small strict run of the embedded default (2 steps, L2), shared read-only."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("good") / "good"
    execute(RunSpec(steps=2), out)
    return out


def tree(path: Path) -> dict[str, str]:
    """Every entry under ``path``: kind and, for files, a SHA-256 of the bytes (never opens a
    FIFO, never follows a symlink)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(root, name)
            mode = p.lstat().st_mode
            rel = p.relative_to(path).as_posix()
            if stat.S_ISLNK(mode):
                out[rel] = "link " + os.readlink(p)
            elif stat.S_ISREG(mode):
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = f"mode {stat.S_IFMT(mode):o}"
    return out


def damaged(good: Path, tmp_path: Path, name: str) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    DAMAGES[name](bad)
    return bad


def assert_one_clean_line(code: int, out: str) -> None:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 2, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert len(lines) == 1 and lines[0].startswith("error:"), out


@pytest.mark.parametrize("name", sorted(set(DAMAGES) - IN_SUBPROCESS))
def test_damaged_run_is_refused(cli, good, tmp_path, name):
    bad = damaged(good, tmp_path, name)
    before, before_good = tree(tmp_path), tree(good)
    for args in ((good, bad), (bad, good), (good, bad, "--json"), (bad, good, "--json")):
        assert_one_clean_line(*cli("diff", *args))
    assert tree(tmp_path) == before, "diff wrote or changed something"
    assert tree(good) == before_good


@pytest.mark.parametrize("name", sorted(IN_SUBPROCESS))
def test_corrupt_record_batch_is_refused_not_a_crash(good, tmp_path, name):
    bad = damaged(good, tmp_path, name)
    before, before_good = tree(tmp_path), tree(good)
    cmd = [sys.executable, "-m", "drifttool.cli.app", "diff"]
    for args in ((good, bad), (bad, good, "--json")):
        res = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "COLUMNS": "400"})
        assert res.returncode != -11, f"SIGSEGV: {res.stderr[-2000:]}"
        assert_one_clean_line(res.returncode, res.stdout + res.stderr)
    assert tree(tmp_path) == before and tree(good) == before_good


def test_good_runs_are_identical(cli, good, tmp_path):
    """The control: an undamaged copy diffs identical (every check passes on good runs)."""
    copy = tmp_path / "copy"
    shutil.copytree(good, copy)
    code, out = cli("diff", good, copy)
    assert code == 0 and "IDENTICAL" in out, out


def test_damage_in_records_the_common_level_leaves_out_is_not_ignored(cli, good, tmp_path):
    """An L0 run against a damaged L2 run: the op records are not compared (the common level is
    L0), but the damaged file is still read and refused — never "identical"."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    l0 = tmp_path / "l0"
    execute(RunSpec(steps=2, capture="L0"), l0)
    bad = damaged(good, tmp_path, "null in ops op")
    for args in ((l0, bad), (bad, l0, "--json")):
        assert_one_clean_line(*cli("diff", *args))


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_runs_drifttool_writes_pass_every_manifest_check(tmp_path, level):
    """The control for the manifest schema and its consistency checks: a rollout at every
    capture level and its training recompute are read and checked without complaint."""
    from drifttool.artifact.reader import open_run
    from drifttool.runner import execute
    from drifttool.settings import RunSpec
    from drifttool.training.recompute import recompute_run

    execute(RunSpec(steps=2, capture=level), tmp_path / "roll")
    recompute_run(tmp_path / "roll", tmp_path / "train")
    for name in ("roll", "train"):
        run = open_run(tmp_path / name)
        assert run.check() == [] and run.capture_level == level


def test_manifest_enumerations_are_the_runtime_ones():
    """``manifest_schema`` keeps torch-free copies of the values the runtime accepts; they must
    agree."""
    from drifttool.artifact import manifest_schema as MS
    from drifttool.ops.scheduler import TIMESTEP_POLICIES
    from drifttool.runtime import Mode
    from drifttool.sampling.config import CFG_LAYOUTS
    from drifttool.setting_checks import DTYPES

    assert MS.MODES == tuple(m.value for m in Mode)
    assert MS.MODEL_DTYPES == tuple(DTYPES)
    assert MS.CFG_LAYOUTS == CFG_LAYOUTS
    assert MS.TIMESTEP_POLICIES == TIMESTEP_POLICIES
