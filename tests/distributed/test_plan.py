"""The parallel plan's contract outside any collective: degrees it accepts and refuses, the mesh
it needs, who owns which record, the manifest layout, and the CLI's one-line refusals; and the
CLI under torchrun (``slow``): ``drifttool run --cfg-parallel 2`` diffs identical to one process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from drifttool.distributed import DistContext
from drifttool.distributed.plan import MESH_DIMS, SAMPLER_BLOCK, ParallelDims, ParallelPlan
from drifttool.errors import UnsupportedConfigError
from drifttool.model.config import tiny
from tests.harness import torchrun_env


@pytest.mark.parametrize("kw, needle", [
    (dict(tp=3), "--tp 3"), (dict(sp=16), "--sp 16"), (dict(tp=0), "--tp 0"),
    (dict(cfg=4), "--cfg-parallel 4"), (dict(sp_attention="star"), "'star'"),
    (dict(tp_row="split"), "'split'"),
])
def test_unsupported_degrees_are_refused_by_name(kw, needle):
    with pytest.raises(UnsupportedConfigError, match="parallel layout: unsupported") as e:
        ParallelDims(**kw)
    assert needle in str(e.value)


def test_degrees_layout_and_mesh_shape():
    d = ParallelDims(tp=2, sp=4, cfg=2, sp_attention="ulysses")
    assert d.world_size == 16 and d.parallel and d.mesh_shape() == (2, 4, 2)
    assert d.layout() == {"kind": "parallel", "tp": 2, "sp": 4, "cfg_parallel": 2, "sp_attention": "ulysses"}
    assert "sp_attention" not in ParallelDims(tp=2).layout()
    assert not ParallelDims().parallel and MESH_DIMS == ("cfg", "sp", "tp")


def test_build_refuses_a_launch_of_another_size_and_production_tp():
    with pytest.raises(UnsupportedConfigError, match="needs|ranks"):
        ParallelPlan.build(DistContext(), ParallelDims(tp=2), tiny())
    ctx2 = DistContext(rank=0, world_size=2)
    with pytest.raises(UnsupportedConfigError, match="strict family only"):
        ParallelPlan.build(ctx2, ParallelDims(tp=2), tiny(), family="production")


def test_strict_on_cuda_refuses_layouts_that_split_a_reduction_axis():
    import torch

    ctx = DistContext(rank=0, world_size=2, device=torch.device("cuda", 0))  # no GPU touched
    with pytest.raises(UnsupportedConfigError, match="never splits a reduction axis.*ring"):
        ParallelPlan.build(ctx, ParallelDims(sp=2, sp_attention="ring"), tiny())
    with pytest.raises(UnsupportedConfigError, match="row-parallel partials"):
        ParallelPlan.build(ctx, ParallelDims(tp=2, tp_row="partials"), tiny())


def test_tp_row_resolves_by_device():
    import torch

    ctx = DistContext(rank=0, world_size=2)
    assert ParallelPlan.build(ctx, ParallelDims(tp=2), tiny()).tp_row == "partials"
    assert ParallelPlan.build(ctx, ParallelDims(tp=2, tp_row="gather"), tiny()).tp_row == "gather"
    cuda = DistContext(rank=0, world_size=2, device=torch.device("cuda", 0))
    assert ParallelPlan.build(cuda, ParallelDims(tp=2), tiny()).tp_row == "gather"


def test_owning_rank_per_coordinate():
    plan = ParallelPlan(dims=ParallelDims(tp=2, cfg=2))
    assert plan.is_root and plan.owns(0) and plan.owns(SAMPLER_BLOCK)
    plan.coords.update(cfg=1)  # the uncond rank: its model calls, not the repeated sampler's
    assert not plan.is_root and plan.owns(3) and plan.owns(-1) and not plan.owns(SAMPLER_BLOCK)
    plan.coords.update(cfg=0, tp=1)  # a TP shard's records are the gathered ones of TP rank 0
    assert not plan.owns(0) and not plan.owns(SAMPLER_BLOCK)


@pytest.mark.parametrize("args, needle", [
    (["--tp", "2"], "needs 2 ranks: launch with torchrun --nproc-per-node 2"),
    (["--cfg-parallel", "3"], "--cfg-parallel 3 (1 or 2"),
    (["--sp", "2", "--sp-attention", "nope"], "--sp-attention 'nope'"),
])
def test_cli_refuses_in_one_line(cli, tmp_path, args, needle):
    code, out = cli("run", "-o", tmp_path / "r", *args)
    assert code != 0 and needle in out and "Traceback" not in out, out
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_cli_cfg_parallel_under_torchrun_is_identical(cli, tmp_path):
    code, out = cli("run", "-o", tmp_path / "one")
    assert code == 0, out
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        "2", "-m", "drifttool", "run", "--cfg-parallel", "2", "-o", tmp_path / "cfg2"],
                       cwd=tmp_path, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 (tp 1 × sp 1 × cfg 2)" in p.stdout, p.stdout
    code, out = cli("diff", tmp_path / "one", tmp_path / "cfg2")
    assert code == 0 and "IDENTICAL" in out and "B parallel over 2 ranks" in out, out


def test_unknown_faults_and_ring_at_l2_are_refused_before_anything_runs():
    ctx2 = DistContext(rank=0, world_size=2)
    with pytest.raises(UnsupportedConfigError, match="unknown parallel fault.*nope.*known: tp_allreduce"):
        ParallelPlan.build(ctx2, ParallelDims(tp=2), tiny(), faults=("nope",))
    with pytest.raises(UnsupportedConfigError, match="ring cannot capture L2: a ring rank never holds"):
        ParallelPlan.build(ctx2, ParallelDims(sp=2, sp_attention="ring"), tiny(), capture_level="L2")
    ParallelPlan.build(ctx2, ParallelDims(sp=2, sp_attention="ring"), tiny(), capture_level="L1")


def test_ring_at_l2_leaves_no_artifact(tmp_path):
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    with pytest.raises(UnsupportedConfigError, match="ring cannot capture L2"):
        execute(RunSpec(capture="L2"), tmp_path / "r", dist=DistContext(rank=0, world_size=2),
                parallel=ParallelDims(sp=2, sp_attention="ring"))
    assert not (tmp_path / "r").exists()


def test_ring_refuses_variants_of_the_attention_internals():
    """Ring runs its own kernel: a probe's variant of the fused attention or of an internal
    operator would be dropped silently, so it is refused (before any collective)."""
    from types import SimpleNamespace

    import torch

    from drifttool.distributed import sp

    plan = ParallelPlan(dims=ParallelDims(sp=2, sp_attention="ring"))
    plan.state["n_img"] = 4
    q = torch.zeros(1, 6, 2, 4)
    for op in ("joint_attention_fused", "joint_attn_softmax"):
        rt = SimpleNamespace(wants_internals=lambda: False, variants={op: ("planted", None)})
        with pytest.raises(UnsupportedConfigError, match=f"a variant of {op} cannot apply"):
            sp.attention(plan, rt, "joint", None, (q, q, q, None), {"text_len": 2})


def test_one_parallel_rule_per_rfc_operator_on_its_declared_axes():
    """``rules.RULES`` has one rule per row of ``specs.OPERATORS``, in its order, and the axes a
    rule shards are the declared layout's: ``rows`` an ``S`` axis, ``heads`` a ``.`` axis."""
    from drifttool.distributed.rules import RULES
    from drifttool.ops.specs import OPERATORS

    assert tuple(RULES) == tuple(OPERATORS)
    for op, r in RULES.items():
        layout = OPERATORS[op].layout
        layouts = (layout,) if isinstance(layout, str) else layout or ()
        for lay in layouts:
            if r.rows is not None:
                assert lay[r.rows] == "S", (op, lay, r.rows)
            if r.heads is not None:
                assert lay[r.heads] == ".", (op, lay, r.heads)


def test_cuda_rule_is_declared_by_the_rules():
    """The CUDA rule: TP row-parallel GEMMs gather on CUDA (``auto``), and the layouts that would
    split a reduction axis across ranks are named by the rules that would split it."""
    from drifttool.distributed.rules import reduction_splits, tp_row_for

    assert tp_row_for(ParallelDims(tp=2), on_cuda=True) == "gather"
    assert tp_row_for(ParallelDims(tp=2), on_cuda=False) == "partials"
    assert tp_row_for(ParallelDims(tp=2, tp_row="partials"), on_cuda=True) == "partials"
    assert reduction_splits(ParallelDims(tp=2), "gather") == []
    assert reduction_splits(ParallelDims(tp=2, sp=2, sp_attention="ring"), "partials") == [
        "--sp-attention ring (each rank reduces its own keys)",
        "TP row-parallel partials (each rank reduces its K shard)"]
