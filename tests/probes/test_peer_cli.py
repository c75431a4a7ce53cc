"""``drifttool probe --peer diffusers``: listing, the documented exit codes (0 expectations hold,
1 a finding, 2 a usage error), rendering and the written matrix."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

from drifttool.probes import peer_catalog as PC  # noqa: E402


def test_list_needs_no_output(cli):
    code, out = cli("probe", "--peer", "diffusers", "--list")
    assert code == 0
    for p in PC.peer_catalog():
        assert p.name in out
    head = out.splitlines()[0].split()
    assert head == ["probe", "kind", "factor", "cuda", "cpu"], out  # an expectation per device type
    assert "drift at" in out and "observed" in out and "pending (torch has no" in out


@pytest.mark.parametrize("args,words", [
    (("--peer", "nope", "-o", "{tmp}"), "unknown peer 'nope' (one of diffusers)"),
    (("--peer", "diffusers", "--only", "repeat,nope", "-o", "{tmp}"), "unknown peer probe"),
    (("--peer", "diffusers", "--only", "repeat"), "give -o/--out"),
    (("--peer", "diffusers", "--device", "tpu", "-o", "{tmp}"), "device"),
    (("--peer", "diffusers", "--height", "1000", "--width", "1024", "-o", "{tmp}"), "multiple of 16"),
    (("--peer", "diffusers", "--height", "1024", "-o", "{tmp}"), "--height and --width together"),
    (("--peer", "diffusers", "--preset", "tiny", "--checkpoint", "{model}", "-o", "{tmp}"), "--peer runs"),
    (("--device", "tpu", "-o", "{tmp}"), "device"),  # the strict matrix checks it too
])
def test_usage_errors_exit_2(cli, tmp_path, args, words):
    from drifttool.fixture import load_fixture

    model = load_fixture("tiny-t2i").model_dir  # a real checkpoint folder: the conflict, not the path, is refused
    code, out = cli("probe", *[a.format(tmp=tmp_path / "m", model=model) for a in args])
    assert code == 2 and words in out, out
    assert not (tmp_path / "m").exists()  # refused before anything is written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_cuda_without_a_gpu_exits_2(cli, tmp_path):
    code, out = cli("probe", "--peer", "diffusers", "--device", "cuda", "-o", tmp_path / "m")
    assert code == 2 and "CUDA is not available" in out


def test_runs_renders_writes_and_overwrites(cli, tmp_path):
    out = tmp_path / "m"
    code, text = cli("probe", "--peer", "diffusers", "--only", "repeat,ulp_norm_q_gain,sdpa_efficient",
                     "-o", out)
    assert code == 0, text
    assert "repeat" in text and "PASS" in text and "PENDING" in text and "qk_rmsnorm" in text
    data = json.loads((out / "matrix.json").read_text())
    assert [(r["name"], r["status"]) for r in data["results"]] == [
        ("repeat", "PASS"), ("sdpa_efficient", "PENDING"), ("ulp_norm_q_gain", "PASS")]
    assert data["exit_code"] == 0 and data["settings"]["peer"]["device"] == "cpu"
    assert (out / "matrix.arrow").is_file() and (out / "heatmaps" / "ulp_norm_q_gain.png").is_file()
    assert (out / "diffs" / "repeat.json").is_file()
    code, text = cli("probe", "--peer", "diffusers", "--only", "repeat", "-o", out)
    assert code == 2 and "--overwrite" in text
    code, text = cli("probe", "--peer", "diffusers", "--only", "repeat", "-o", out, "--overwrite")
    assert code == 0, text
    assert not (out / "runs" / "ulp_norm_q_gain").exists() and not (out / "heatmaps").exists()


def test_a_failed_expectation_exits_1(cli, tmp_path, monkeypatch):
    real = PC.peer_catalog

    def wrong(*a, **k):  # declare the planted ULP probe at the wrong operator
        return [PC.PeerProbe(**{**p.__dict__, "expect": {"cpu": PC.PeerExpect(
                    verdict="drift", op="mlp_down_gemm")}}) if p.name == "ulp_norm_q_gain" else p
                for p in real(*a, **k)]

    monkeypatch.setattr(PC, "peer_catalog", wrong)
    code, text = cli("probe", "--peer", "diffusers", "--only", "ulp_norm_q_gain", "-o", tmp_path / "m")
    assert code == 1, text
    assert "FINDING ulp_norm_q_gain" in text and "first drift at qk_rmsnorm, expected mlp_down_gemm" in text
    assert json.loads((tmp_path / "m" / "matrix.json").read_text())["exit_code"] == 1
