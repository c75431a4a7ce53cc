"""The main job on a GPU: ``drifttool run --device cuda --mode auto`` on the tiny fixture, its
replay on the GPU (identical), file inputs and a non-square
grid there, and a checkpoint loaded straight onto the GPU equal to CPU loading. Skipped without
CUDA; run on the GPU machine with ``python -m pytest tests/gpu``.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.artifact.reader import open_run
from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint, save_checkpoint
from drifttool.model.config import MMDiTConfig
from drifttool.model.mmdit import MMDiT, random_init_
from tests.conftest import assert_same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory):
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    out = tmp_path_factory.mktemp("cuda") / "auto"
    res = CliRunner().invoke(app, ["run", "-o", str(out), "--device", "cuda", "--mode", "auto",
                                   "--batch", "3"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return out


def test_run_on_cuda_completes_and_records_the_device(cuda_run):
    run = open_run(cuda_run)
    m = run.manifest
    assert m["complete"] and m["settings"]["device"] == "cuda" and m["settings"]["mode"] == "auto"
    by_op = {}
    for r in run.trace_rows():
        by_op.setdefault(r["op"], set()).add(r["device"])
    assert by_op.pop("flow_sigma_table") == {"cpu"}  # no tensors: it runs on the CPU
    assert by_op and all(d == {"cuda:0"} for d in by_op.values()), by_op
    assert m["environment"]["gpu"]


def test_replay_on_cuda_is_identical(cli, cuda_run, tmp_path):
    code, out = cli("replay", cuda_run, "-o", tmp_path / "replay")  # device: the run's
    assert code == 0, out
    assert json.loads((tmp_path / "replay" / "manifest.json").read_text())["settings"]["device"] == "cuda"
    code, out = cli("diff", cuda_run, tmp_path / "replay")
    assert code == 0 and "IDENTICAL" in out, out


def test_recompute_on_cuda_completes(cli, cuda_run, tmp_path):
    code, out = cli("recompute", cuda_run, "-o", tmp_path / "train")
    assert code == 0, out


def test_files_and_non_square_grid_on_cuda(cli, tmp_path):
    gen = torch.Generator().manual_seed(9)
    lens, L = [5, 11, 2], 13
    mask = (torch.arange(L)[None] < torch.tensor(lens)[:, None]).to(torch.int64)
    save_file({"prompt_embeds": torch.randn(3, L, 32, generator=gen) * mask[..., None],
               "prompt_embeds_mask": mask}, str(tmp_path / "pe.safetensors"))
    save_file({"prompt_embeds": torch.randn(3, 4, 32, generator=gen)}, str(tmp_path / "ne.safetensors"))
    save_file({"latents": torch.randn(3, 3 * 7, 64, generator=gen).to(torch.bfloat16)},
              str(tmp_path / "x0.safetensors"))
    code, out = cli("run", "-o", tmp_path / "r", "--device", "cuda", "--mode", "auto",
                    "--height", "48", "--width", "112", "--prompt-embeds", tmp_path / "pe.safetensors",
                    "--negative-prompt-embeds", tmp_path / "ne.safetensors",
                    "--latents", tmp_path / "x0.safetensors")
    assert code == 0, out
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["settings"]["img_grid"] == [3, 7] and m["replay"]["prompt_lengths"] == lens
    code, out = cli("replay", tmp_path / "r", "-o", tmp_path / "r2")
    assert code == 0, out
    code, out = cli("diff", tmp_path / "r", tmp_path / "r2")
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checkpoint_loads_onto_cuda_equal_to_cpu(tmp_path, dtype):
    cfg = MMDiTConfig(num_layers=3, attention_head_dim=16, num_attention_heads=3,
                      joint_attention_dim=40, axes_dims_rope=(4, 6, 6))
    folder = save_checkpoint(random_init_(MMDiT(cfg, dtype=torch.bfloat16), seed=2), tmp_path / "ck",
                             max_shard_bytes=50_000)
    cpu = dict(load_checkpoint(folder, dtype=dtype).named_parameters())
    gpu = dict(load_checkpoint(folder, dtype=dtype, device="cuda").named_parameters())
    assert set(cpu) == set(gpu)
    for n, p in gpu.items():
        assert p.device.type == "cuda" and p.dtype == dtype
        assert_same_bytes(p.detach().cpu(), cpu[n].detach(), n)
    fx = load_fixture("tiny-t2i")
    m = load_checkpoint(fx.model_dir, device="cuda:0")
    assert {p.device for p in m.parameters()} == {torch.device("cuda", 0)}
