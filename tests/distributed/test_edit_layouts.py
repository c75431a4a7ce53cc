"""Edit runs (``--condition``) in the parallel layouts: ``drifttool run --batch 2 --condition FILE``
under torchrun (gloo, 2 ranks) sample-parallel, ``--tp 2`` and ``--cfg-parallel 2`` diffs
IDENTICAL at L2 to the one-process run (condition rows in every image-stream record); ``slow``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from drifttool.artifact import open_run
from drifttool.diff import diff_runs
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.harness import torchrun_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edit_reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("edit")
    g = torch.Generator().manual_seed(12)
    save_file({"image_latents": torch.randn(2, 35 + 6, 64, generator=g),
               "condition_grids": torch.tensor([[5, 7], [2, 3]])}, str(work / "c.safetensors"))
    execute(RunSpec(batch=2, steps=2, capture="L2", condition=work / "c.safetensors"), work / "one")
    return work


@pytest.mark.parametrize("layout", [[], ["--tp", "2"], ["--cfg-parallel", "2", "--mode", "auto",
                                                        "--cfg-layout", "sequential"]],
                         ids=["sample_parallel", "tp2", "cfg_parallel2"])
def test_edit_run_in_parallel_layouts_is_identical(edit_reference, layout, tmp_path):
    work = edit_reference
    ref = work / "one"
    if "--mode" in layout:  # CFG-parallel runs production with sequential CFG: its own reference
        ref = tmp_path / "auto"
        execute(RunSpec(batch=2, steps=2, capture="L2", mode="auto", cfg_layout="sequential",
                        condition=work / "c.safetensors"), ref)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "drifttool", "run", "--batch", "2", "--steps", "2", "--capture", "L2",
                        "--condition", str(work / "c.safetensors"), *layout, "-o", str(tmp_path / "run")],
                       cwd=tmp_path, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    report = diff_runs(open_run(ref), open_run(tmp_path / "run"))
    assert report.verdict.value == "identical", report.reason
    assert report.counts["ops"].matched > 500 and report.counts["ops"].only_b == 0
