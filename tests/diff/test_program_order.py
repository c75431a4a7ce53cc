"""Program order (``drifttool.diff.order``): the rank-independent position that decides "first".

It follows the program (blocks −1, 0..depth−1, depth, then the sampler; ``op_pos``; index;
branch; sample; ops before step records before gradients), ignores ``rank`` and ``seq``, and
the model's real records carry the same ``op_pos`` under batched and sequential CFG."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from drifttool.artifact import schema as S
from drifttool.artifact.reader import open_run
from drifttool.capture.recorder import Recorder
from drifttool.diff.compare import diff_runs
from drifttool.diff.order import program_order
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.inputs import RolloutInputs
from drifttool.sampling.rollout import rollout
from drifttool.settings import RunSpec

_OP_COLS = {"rank": pa.int32(), "seq": pa.int64(), "component": pa.utf8(), "phase": pa.utf8(),
            "step": pa.int32(), "branch": pa.utf8(), "block": pa.int32(), "op_pos": pa.int32(),
            "stream": pa.utf8(), "op": pa.utf8(), "call": pa.int32(), "index": pa.int32(),
            "role": pa.utf8(), "sample": pa.int32()}


def _ops(rows: list[dict]) -> pa.Table:
    base = {"rank": 0, "seq": 0, "component": "mmdit", "phase": "rollout", "step": 0,
            "branch": "cond", "block": 0, "op_pos": 0, "stream": "img", "op": "x", "call": 0,
            "index": 0, "role": "output", "sample": 0}
    full = [{**base, **r} for r in rows]
    return pa.table({k: pa.array([r[k] for r in full], t) for k, t in _OP_COLS.items()})


def _steps(rows: list[dict]) -> pa.Table:
    base = {"rank": 0, "seq": 0, "component": "mmdit", "phase": "rollout", "step": 0,
            "sample": 0, "branch": "cfg", "quantity": "x_t"}
    full = [{**base, **r} for r in rows]
    return pa.table({k: [r[k] for r in full] for k in base})


# in program order
EXPECTED = [
    {"phase": "rollout", "step": -1, "block": S.SAMPLER_BLOCK, "op": "flow_sigma_table",
     "branch": "none", "sample": -1},
    {"block": -1, "op_pos": 0, "sample": 0},
    {"block": -1, "op_pos": 0, "sample": 1},
    {"block": -1, "op_pos": 0, "branch": "uncond", "sample": 0},
    {"block": -1, "op_pos": 1, "sample": 0},
    {"block": 0, "op_pos": 0, "sample": 1},
    {"block": 0, "op_pos": 3, "index": 0, "sample": 0},
    {"block": 0, "op_pos": 3, "index": 1, "sample": 0},
    {"block": 1, "op_pos": 0, "sample": 0},
    {"block": 2, "op_pos": 0, "sample": 0},  # depth 2: the part after the blocks
    {"block": S.SAMPLER_BLOCK, "op_pos": 0, "branch": "cfg", "sample": 0},
    {"block": S.SAMPLER_BLOCK, "op_pos": 1, "branch": "cfg", "sample": 0},
]


def test_op_records_follow_the_program_not_rank_or_seq():
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(EXPECTED))
    rows = [dict(EXPECTED[i]) for i in perm]
    for r in rows:  # owning ranks and per-rank counters that contradict the program
        r["rank"], r["seq"] = int(rng.integers(0, 4)), int(rng.integers(0, 5))
    (pos,) = program_order([_ops(rows)])
    assert [int(perm[k]) for k in np.argsort(pos)] == list(range(len(EXPECTED)))
    assert len(set(pos.tolist())) == len(EXPECTED)
    # the same rows with other ranks and seqs get the same positions
    other = [{**r, "rank": 7 - r["rank"], "seq": 100 - r["seq"]} for r in rows]
    (pos2,) = program_order([_ops(other)])
    assert np.array_equal(pos, pos2)


def test_steps_sit_between_outputs_and_gradients_and_compare_across_tables():
    ops = _ops([{"step": 0, "block": S.SAMPLER_BLOCK, "op_pos": 5},
                {"step": 0, "block": 0, "role": "grad_weight", "branch": "none", "sample": -1},
                {"step": 1, "block": -1}])
    steps = _steps([{"step": 0, "quantity": "logp_t"}, {"step": 0, "quantity": "x_t", "sample": 1},
                    {"step": 0, "quantity": "x_t", "sample": 0, "branch": "uncond"},
                    {"step": 0, "quantity": "x_t", "sample": 0, "branch": "cfg"},
                    {"step": 0, "quantity": "v_t"}])
    po, ps = program_order([ops, steps])
    # step 0: sampler output < x_t(s0 uncond) < x_t(s0 cfg) < x_t(s1) < v_t < logp_t < grad;
    # then step 1 (branches in program order: cond, uncond, then the CFG combination)
    order = [("o", 0), ("s", 2), ("s", 3), ("s", 1), ("s", 4), ("s", 0), ("o", 1), ("o", 2)]
    got = sorted(order, key=lambda t: (po if t[0] == "o" else ps)[t[1]])
    assert got == order
    # positions of a second run compare with the first's (one dense rank over all tables)
    po_a, po_b = program_order([ops, ops.slice(1)])
    assert np.array_equal(po_a[1:], po_b)


def test_unknown_strings_order_after_known_ones_by_name():
    t = _ops([{"branch": "zeta"}, {"branch": "cond+uncond"}, {"branch": "none"},
              {"branch": "cond"}])
    (pos,) = program_order([t])
    assert np.argsort(pos).tolist() == [3, 2, 1, 0]


def _model_run(layout: str) -> pa.Table:
    g = torch.Generator().manual_seed(0)
    inputs = RolloutInputs(sample_ids=[3, 5, 8], x0=torch.randn(3, 4, 64, generator=g),
                           txt=torch.randn(3, 3, 32, generator=g), img_grid=(2, 2),
                           neg_txt=torch.randn(3, 3, 32, generator=g),
                           noise=torch.randn(2, 3, 4, 64, generator=g))
    rec = Recorder("L1")
    rt = Runtime(recorder=rec)
    rollout(random_init_(MMDiT(tiny()), seed=0), inputs,
            SamplerConfig(num_steps=2, cfg_layout=layout), rt, max_steps=1)
    rec.flush()
    return rec.ops_table()


def test_model_op_pos_is_the_same_for_batched_and_sequential_cfg():
    a, b = _model_run("batched"), _model_run("sequential")
    key = [*S.OPS_KEY]

    def positions(t: pa.Table) -> dict[tuple, int]:
        rows = t.select([*key, "op_pos"]).to_pylist()
        return {tuple(r[k] for k in key): r["op_pos"] for r in rows}

    pa_, pb = positions(a), positions(b)
    assert len(pa_) == a.num_rows and set(pa_) == set(pb)  # one record per identity
    assert pa_ == pb
    # op_pos counts every call of the block: more positions than any single op's calls
    block0 = [r for r in a.select(["block", "op_pos", "call"]).to_pylist() if r["block"] == 0]
    assert max(r["op_pos"] for r in block0) > max(r["call"] for r in block0) > 0
    # and the two runs' records order identically although they were executed differently
    pos_a, pos_b = program_order([a, b])
    ka = [tuple(r.values()) for r in a.select(key).to_pylist()]
    kb = [tuple(r.values()) for r in b.select(key).to_pylist()]
    assert [ka[i] for i in np.argsort(pos_a, kind="stable")] == \
        [kb[i] for i in np.argsort(pos_b, kind="stable")]
    assert ka != kb  # executed in different orders: batched runs cond and uncond rows together


def test_strict_l1_run_is_identical_to_the_l2_run_at_l1(tmp_path):
    """At L2 the strict fused attention runs as its decomposition (internal records) and keeps its
    own record, so an L1 run's records are a subset: the two diff identical at L1, and the L2 run
    holds the internals."""
    execute(RunSpec(capture="L1"), tmp_path / "l1")
    execute(RunSpec(capture="L2"), tmp_path / "l2")
    a, b = open_run(tmp_path / "l1"), open_run(tmp_path / "l2")
    report = diff_runs(a, b)
    assert report.verdict.value == "identical" and report.level == "L1", report.reason
    assert report.counts["ops"].only_b == 0 and report.counts["ops"].only_a == 0
    ops_b = b.ops_table()
    internal = [op for op, r in zip(ops_b["op"].to_pylist(), ops_b["role"].to_pylist())
                if r == "internal"]
    fused = ops_b["op"].to_pylist().count("joint_attention_fused")
    assert fused > 0 and len(internal) == 3 * fused
    assert set(internal) == {"joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm"}
    assert "internal" not in a.ops_table()["role"].to_pylist()
