"""The declared matrix: every RFC factor has a mismatch probe, every expectation is complete."""

from __future__ import annotations

import pytest

from drifttool.ops.registry import specs
from drifttool.probes.catalog import RFC_FACTORS, catalog, probe
from drifttool.probes.spec import Expectation, Probe


def test_every_rfc_factor_has_a_runnable_mismatch_probe():
    mism = [p for p in catalog() if p.kind == "mismatch" and not p.pending]
    missing = [f for f in RFC_FACTORS if f not in {p.factor for p in mism}]
    assert not missing


def test_every_mismatch_probe_declares_a_real_operator():
    import drifttool.ops  # noqa: F401

    ops = set(specs())
    for p in catalog():
        if p.kind != "invariant":
            assert p.expect.op in ops, p.name
        for op in p.variants:
            assert op in ops, (p.name, op)


def test_invariant_controls_cover_the_rfc_list():
    inv = {p.name: p for p in catalog() if p.kind == "invariant"}
    for name in ("repeat", "batch_order_reversed", "batch_single", "batch_three_shifted",
                 "prompt_padding", "cfg_sequential", "replay", "train_recompute",
                 "gradient_checkpointing"):
        assert name in inv


def test_names_are_unique_and_lookup_works():
    names = [p.name for p in catalog()]
    assert len(names) == len(set(names))
    assert probe("gelu_exact").expect.op == "mlp_up_gemm_gelu"
    with pytest.raises(KeyError, match="known"):
        probe("no_such_probe")


def test_fp32_adds_the_sinusoid_order_probe():
    assert "timestep_scale_first" not in {p.name for p in catalog()}
    assert "timestep_scale_first" in {p.name for p in catalog({"dtype": "float32"})}


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="expects 'identical'"):
        Probe(name="x", factor="f", kind="invariant", change="c",
              expect=Expectation(verdict="drift", op="qk_rmsnorm"))
    with pytest.raises(ValueError, match="must declare its operator"):
        Probe(name="x", factor="f", kind="mismatch", change="c", expect=Expectation(verdict="drift"))
    with pytest.raises(ValueError, match="must declare its row"):
        Probe(name="x", factor="f", kind="sensitivity", change="c",
              expect=Expectation(verdict="drift", op="qk_rmsnorm"))
