"""A finished artifact opens where users look: plain pyarrow (``pyarrow.parquet``,
``pyarrow.dataset``), Polars (eager and lazy) and DuckDB read its tables, and the DuckDB SQL and
the Polars query of docs/artifacts.md, run exactly as written, name ``drifttool diff``'s first
drifting operator."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as ds
import pytest

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.diff import diff_runs
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.diff.diff_synthetic_runs import build_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "artifacts.md"
COLUMNS = ("phase", "step", "branch", "block", "stream", "op", "call", "index", "role", "sample")


def _block(lang: str, needle: str) -> str:
    """The fenced ``lang`` block of docs/artifacts.md that contains ``needle``."""
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if needle in b]
    return block


SQL = _block("sql", "read_parquet")
POLARS = _block("python", "import polars")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Runs that drift: the embedded default strict vs production (first drift at step 0,
    before the blocks), and a synthetic two-rank run vs a single process with a drift planted
    in block 1 of step 1 on sample 1 (owned by rank 1)."""
    root = tmp_path_factory.mktemp("pairs")
    execute(RunSpec(steps=2), root / "strict")
    execute(RunSpec(steps=2, mode="auto"), root / "auto")
    build_run(root / "one", steps=3)
    build_run(root / "two", steps=3, owners={0: 0, 1: 1},
              plant={"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9,
                     "add": 1e-3})
    return {"strict-auto": (root / "strict", root / "auto"), "two-ranks": (root / "one",
                                                                           root / "two")}


def _answer(a: Path, b: Path) -> tuple:
    fd = diff_runs(open_run(a), open_run(b)).first_drift
    assert fd is not None and fd.kind == "op"
    return tuple(getattr(fd, c) for c in COLUMNS)


def _in_runs_dir(tmp_path: Path, monkeypatch, a: Path, b: Path) -> None:
    """Make ``runs/a`` and ``runs/b`` (the docs' paths) point at the pair, from the cwd."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a").symlink_to(a)
    (tmp_path / "runs" / "b").symlink_to(b)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("pair", ["strict-auto", "two-ranks"])
def test_the_docs_duckdb_sql_names_the_diffs_first_drift(pairs, pair, tmp_path, monkeypatch):
    a, b = pairs[pair]
    _in_runs_dir(tmp_path, monkeypatch, a, b)
    assert duckdb.sql(SQL).fetchall() == [_answer(a, b)]


@pytest.mark.parametrize("pair", ["strict-auto", "two-ranks"])
def test_the_docs_polars_query_names_the_diffs_first_drift(pairs, pair, tmp_path, monkeypatch):
    a, b = pairs[pair]
    _in_runs_dir(tmp_path, monkeypatch, a, b)
    scope: dict = {}
    exec(compile(POLARS, str(DOC), "exec"), scope)
    assert scope["first"].rows() == [_answer(a, b)]


def test_the_first_drifts_are_the_expected_ones(pairs):
    """The pairs test what they mean to: the first drift before the blocks, and deep inside a
    block on the second rank."""
    assert _answer(*pairs["strict-auto"])[:6] == ("rollout", 0, "cond", -1, "none",
                                                   "timestep_embed_mlp")
    assert _answer(*pairs["two-ranks"])[1:6:2] == (1, 1, "joint_attn")


@pytest.mark.parametrize("table", S.RANK_TABLES)
def test_plain_readers_read_a_finished_run(pairs, table):
    """pyarrow.dataset, Polars (read and lazy scan) and DuckDB read every table of a two-rank
    run: the same rows drifttool's reader returns."""
    run_dir = pairs["two-ranks"][1]
    run = open_run(run_dir)
    want = {"ops": lambda: run.ops_table().num_rows, "steps": lambda: run.steps_table().num_rows,
            "trace": lambda: len(run.trace_rows())}[table]()
    files = sorted(str(p) for p in run_dir.glob(f"{table}.rank*.parquet"))
    assert len(files) == 2 and want > 0
    assert ds.dataset(files, format="parquet").count_rows() == want
    assert pl.read_parquet(f"{run_dir}/{table}.rank*.parquet").height == want
    lazy = pl.scan_parquet(f"{run_dir}/{table}.rank*.parquet").select(pl.len()).collect()
    assert lazy.item() == want
    sql = f"SELECT count(*) FROM read_parquet('{run_dir}/{table}.rank*.parquet')"
    assert duckdb.sql(sql).fetchall() == [(want,)]
