"""A probe whose change moves no byte on the baseline's weights and inputs is NOT APPLICABLE,
with the reason: neither a pass nor a finding (table, matrix.json, matrix.arrow, exit code)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from drifttool.probes import noop
from drifttool.probes.catalog import probe
from drifttool.probes.matrix import read_matrix
from drifttool.probes.runner import NOT_APPLICABLE, PASS, baseline_settings, run_matrix, run_probe
from drifttool.probes.weights import load_state, swap_stream_qkv, write_checkpoint
from drifttool.settings import RunSpec, resolve

_QK_GAIN = re.compile(r"\.attn\.norm_(added_)?[qk]\.weight$")


@pytest.fixture(scope="module")
def unit_gains(tmp_path_factory):
    """The tiny fixture's transformer with every Q/K RMSNorm gain exactly 1.0, as diffusers
    initialises a fresh model (the fixture's gains are not 1)."""
    fx, _ = resolve(RunSpec())
    state = load_state(fx.model_dir)
    gains = [k for k in state if _QK_GAIN.search(k)]
    assert gains and any(bool((state[k] != 1).any()) for k in gains)
    state = {k: torch.ones_like(v) if k in gains else v for k, v in state.items()}
    config = json.loads((fx.model_dir / "config.json").read_text())
    return write_checkpoint(state, config, tmp_path_factory.mktemp("ckpt") / "transformer")


@pytest.fixture(scope="module")
def unit_gain_matrix(unit_gains, tmp_path_factory):
    """``drifttool probe --checkpoint <unit gains> --only qk_norm_no_gain`` (exit code, output, OUT)."""
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    out = tmp_path_factory.mktemp("matrix") / "m"
    res = CliRunner().invoke(app, ["probe", "--checkpoint", str(unit_gains), "--only",
                                   "qk_norm_no_gain", "-o", str(out)], catch_exceptions=False)
    return res.exit_code, res.output, out


def test_a_variant_that_changes_nothing_is_not_applicable(unit_gain_matrix):
    code, output, out = unit_gain_matrix
    assert code == 0, output  # neither a finding ...
    data = json.loads((out / "matrix.json").read_text())
    (r,) = data["results"]
    assert r["status"] == NOT_APPLICABLE and r["verdict"] == "identical"  # ... nor a pass
    assert r["reasons"] == [f"no-op on these weights and inputs: qk_norm_no_gain gives "
                            f"qk_rmsnorm's own output bytes at all {r['reasons'][0].split()[-3]} "
                            "call sites"]
    assert int(r["reasons"][0].split()[-3]) > 0
    assert data["counts"][NOT_APPLICABLE] == 1 and data["counts"][PASS] == 0
    assert data["exit_code"] == 0 and data["matrix_version"] == 3
    table = read_matrix(out / "matrix.arrow")
    assert table.column("status").to_pylist() == [NOT_APPLICABLE]
    assert "NOT APPLICABLE" in output and "qk_norm_no_gain (Q/K preprocessing): no-op" in output
    assert "1 not applicable" in output


def test_the_same_probe_on_the_shipped_fixture_is_applicable(tmp_path):
    """The fixture's gains are not 1: the variant changes bytes and the probe passes."""
    base = RunSpec(fixture="tiny-t2i", mode="strict")
    settings, depth, _ = baseline_settings(base)
    m = run_matrix([probe("qk_norm_no_gain", settings, depth)], tmp_path / "m", base=base)
    (r,) = m.results
    assert r.status == PASS and r.verdict == "drift", r.reasons


def test_a_checkpoint_transform_that_changes_nothing_is_not_applicable(unit_gain_matrix, unit_gains):
    """Proven on the weights' bytes, without a probe run; a real transform is applicable."""
    _, _, out = unit_gain_matrix
    base = RunSpec(fixture="tiny-t2i", checkpoint=unit_gains, mode="strict")
    p = probe("stream_weights_swapped").with_(weights=lambda state: dict(state))
    r = run_probe(p, base, out / "runs" / "baseline", out / "identity", unit_gains)
    assert r.status == NOT_APPLICABLE and r.run_dir is None, r
    assert r.reasons == ["no-op on these weights: the transformed checkpoint holds the same "
                         f"{len(load_state(unit_gains))} tensors, byte for byte"]
    assert noop.weights_unchanged(unit_gains, swap_stream_qkv) is None


def test_same_bytes_sees_signed_zero_and_nan_payloads():
    z = torch.zeros(3)
    assert noop.same_bytes((z, [z]), (z.clone(), [z.clone()]))
    assert not noop.same_bytes(z, -z)  # equal values, other bytes
    nan = torch.tensor([float("nan")])
    other = nan.view(torch.int32).bitwise_or(1).view(torch.float32)
    assert noop.same_bytes(nan, nan.clone()) and not noop.same_bytes(nan, other)
    assert not noop.same_bytes(z, z.to(torch.float64)) and not noop.same_bytes(z, z[:2])


def test_one_differing_call_makes_the_variant_applicable():
    calls = []

    class Variant:
        base = staticmethod(lambda x: x)

        def __call__(self, x):
            calls.append(x)
            return x if len(calls) < 2 else x + 1  # a no-op at the first call site only

    w = noop.NoOpWitness("op", "v", Variant())
    for _ in range(3):
        w(torch.ones(2))
    assert w.changed and w.checked == 2 and noop.variants_noop([w]) is None
    fresh = noop.NoOpWitness("op", "v", Variant.base)  # no base, never bound: cannot be proven
    fresh(torch.ones(2))
    assert fresh.unchecked == 1 and noop.variants_noop([fresh]) is None
