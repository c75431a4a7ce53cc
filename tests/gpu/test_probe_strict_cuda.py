"""``drifttool probe --mode strict --device cuda`` on a handful of probes: a variant wrapping its
base (``rope_rotate_half``), a sampler variant (``cfg_renorm_off``), a training control
(``train_recompute``: a LoRA adapter trained, runs at L1), the suspect with a CUDA expectation of
its own (``lora_unmerged``) and two probes the catalog declares pending on CUDA (``gelu_exact``:
a CPU-only variant; ``dp_split_strided``: gloo CPU ranks). No ERROR row; each probe PASS, or
PENDING with the reason the catalog derives for CUDA. Skipped without CUDA; run on the GPU
machine with ``python -m pytest tests/gpu``."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ONLY = ("rope_rotate_half", "cfg_renorm_off", "train_recompute", "lora_unmerged", "gelu_exact",
        "dp_split_strided")


def test_strict_probe_matrix_on_cuda_has_no_error(cli, tmp_path):
    from drifttool.ops.strict_cuda._register import QUALIFIED_CAPABILITIES
    from drifttool.probes.catalog import catalog

    if torch.cuda.get_device_capability() not in QUALIFIED_CAPABILITIES:
        pytest.skip("the strict CUDA family runs on a qualified GPU only")
    code, out = cli("probe", "--mode", "strict", "--device", "cuda", "--only", ",".join(ONLY),
                    "--no-heatmaps", "-o", tmp_path / "m")
    data = json.loads((tmp_path / "m" / "matrix.json").read_text())
    got = {r["name"]: r for r in data["results"]}
    assert "ERROR" not in {r["status"] for r in got.values()}, out
    pending = {p.name: p.pending for p in catalog({"device": "cuda"}, device="cuda") if p.name in ONLY}
    assert {n for n, why in pending.items() if why} == {"gelu_exact", "dp_split_strided"}
    for name in ONLY:
        r = got[name]
        if pending[name]:
            assert r["status"] == "PENDING" and r["reasons"] == [pending[name]], r
        else:
            assert r["status"] == "PASS", (name, r["reasons"])
    assert code == 0, out
