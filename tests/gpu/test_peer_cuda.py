"""The peer probe matrix on CUDA: diffusers' ``QwenImageTransformer2DModel`` at the real width
(3072 = 24 heads x 128, joint_attention_dim 3584, RoPE axes (16, 56, 56)), 2 random bf16 blocks,
a 256² image (16 x 16 patches), prompts padded to 100 / 128 / 160 slots. Asserts the CUDA
expectations of ``drifttool.probes.peer`` (the H200 study's verdicts): padding length and the
SDPA backend (math, efficient) drift; batch position, grad mode, timestep dtype, masked pad
garbage and repetition are identical with every record compared; a planted weight ULP is found
at ``qk_rmsnorm``. Skipped without CUDA; run with ``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

FULL_WIDTH = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                  attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                  axes_dims_rope=(16, 56, 56))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    from drifttool.probes.peer import grid_fixture, peer_baseline, run_peer_matrix
    from drifttool.probes.peer_catalog import peer_catalog

    torch.manual_seed(0)
    with torch.device("cuda"):
        tr = QwenImageTransformer2DModel(**FULL_WIDTH)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
    tr = tr.to(torch.bfloat16).eval()
    root = tmp_path_factory.mktemp("peer_cuda")
    fx = grid_fixture(root / "fixture", (16, 16))
    m = run_peer_matrix(peer_catalog(), root / "out", transformer=tr, device="cuda",
                        base=peer_baseline(fixture=fx, capture="L2"))
    return m, {r.name: r for r in m.results}


def test_every_cuda_expectation_holds(matrix):
    m, res = matrix
    bad = {r.name: (r.status, r.first_drift, r.reasons) for r in m.results if r.status != "PASS"}
    assert not bad and m.exit_code == 0


@pytest.mark.parametrize("name", ["repeat", "batch_order_reversed", "grad_enabled",
                                  "timestep_bf16", "pad_garbage"])
def test_invariants_are_identical_over_every_record(matrix, name):
    _, res = matrix
    r = res[name]
    assert r.verdict == "identical" and r.differing_records == 0 and r.status == "PASS", r


@pytest.mark.parametrize("name", ["pad_100", "pad_160", "sdpa_math", "sdpa_efficient"])
def test_padding_and_sdpa_backend_drift(matrix, name):
    _, res = matrix
    r = res[name]
    assert r.verdict == "drift" and r.status == "PASS" and r.differing_records > 0, r


def test_sdpa_backend_drift_starts_at_attention_and_the_kernel_is_read_back(matrix):
    m, res = matrix
    for name, kernel in (("sdpa_math", "MATH"), ("sdpa_efficient", "EFFICIENT_ATTENTION")):
        r = res[name]
        assert (r.first_op, r.first_block, r.first_step) == ("joint_attention_fused", 0, 0)
        assert m.settings["attention_kernels"][name] == [
            f"diffusers.attention:native/torch.sdpa:{kernel}"]
    assert m.settings["attention_kernels"]["baseline"] != m.settings["attention_kernels"]["sdpa_math"]
    from drifttool.artifact.reader import open_run

    rows = [r for r in open_run(res["sdpa_math"].run_dir).trace_rows()
            if r["op"] == "joint_attention_fused"]
    assert len(rows) == 2 and {r["device"].split(":")[0] for r in rows} == {"cuda"}


def test_planted_ulp_found_at_qk_rmsnorm(matrix):
    _, res = matrix
    r = res["ulp_norm_q_gain"]
    assert (r.first_op, r.first_stream, r.first_block, r.first_step) == ("qk_rmsnorm", "img", 0, 0)
