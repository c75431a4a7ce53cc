"""The writer's rank contract in one process (rank 0 of world 1): records and layouts of another
rank or world size are refused before anything is written."""

from __future__ import annotations

import pytest

from drifttool.artifact import ArtifactWriter, open_run
from drifttool.artifact import schema as S


def _steps(rank: int) -> dict:
    return {"seq": [0], "rank": [rank], "component": ["mmdit"], "phase": ["rollout"], "step": [0], "sigma": [1.0],
            "sigma_next": [0.5], "sample": [0], "branch": ["cond"], "quantity": ["x_t"],
            "dtype": ["float32"], "shape": [[1]], "digest": [1], "nonfinite": [0], "l2": [0.0],
            "maxabs": [0.0], "data": [b"\0\0\0\0"]}


def test_layout_states_the_real_world_size(tmp_path):
    with pytest.raises(ValueError, match="layout.world_size is 2 but 1 rank"):
        ArtifactWriter(tmp_path / "a", {"layout": {"world_size": 2}})
    with pytest.raises(ValueError, match="layout.samples has ranks"):
        ArtifactWriter(tmp_path / "a", layout={"kind": "sample_parallel",
                                                "samples": {"0": [0], "1": [1]}})
    assert not (tmp_path / "a").exists()
    w = ArtifactWriter(tmp_path / "a", {"fingerprint": {}, "layout": {"cfg_layout": "batched"}},
                       layout={"kind": "single"})
    assert (w.rank, w.world_size) == (0, 1)
    with pytest.raises(ValueError, match="world_size is 3"):
        w.update_manifest(layout={"world_size": 3})
    w.close(complete=True)
    run = open_run(tmp_path / "a")
    assert run.manifest["layout"] == {"world_size": 1, "kind": "single", "cfg_layout": "batched"}
    assert run.manifest["files"]["steps"] == [S.steps_file(0)] and run.steps_table().num_rows == 0


def test_records_of_another_rank_are_refused(tmp_path):
    w = ArtifactWriter(tmp_path / "a", {"fingerprint": {}})
    with pytest.raises(ValueError, match=r"step records of rank\(s\) \[1\]"):
        w.write_steps(_steps(1))
    with pytest.raises(ValueError, match="op records of rank 1 given to the writer of rank 0"):
        w.write_ops({}, rank=1)
    w.write_steps(_steps(0))
    w.close(complete=True)
    assert open_run(tmp_path / "a").steps_table()["rank"].to_pylist() == [0]


def test_trace_rows_read_back_can_be_written_by_their_rank(tmp_path):
    row = {"device": "cpu", "component": "mmdit", "op": "img_mlp", "block": 0, "stream": "img", "call": 0, "contract": "m.v1",
           "requested": "strict", "actual": "strict", "kernel": "cpu", "fallback": False,
           "reason": "", "declared": False, "calls": 2}
    w = ArtifactWriter(tmp_path / "a", {"fingerprint": {}})
    with pytest.raises(ValueError, match=r"trace records of rank\(s\) \[1\]"):
        w.write_trace([{**row, "rank": 1}])
    w.write_trace([{**row, "rank": 0}])
    w.close(complete=True)
    assert open_run(tmp_path / "a").trace_rows() == [{**row, "rank": 0}]


def test_layout_must_be_an_object(tmp_path):
    with pytest.raises(ValueError, match="layout must be a JSON object"):
        ArtifactWriter(tmp_path / "a", {"fingerprint": {}, "layout": None})
    with pytest.raises(ValueError, match="layout must be a JSON object"):
        ArtifactWriter(tmp_path / "a", {"fingerprint": {}}, layout=[1])
    assert not (tmp_path / "a").exists()
