"""``drifttool run --condition FILE``: an edit run from packed condition latents, end to end
(settings, artifact, replay, diff naming condition rows) and its bad inputs in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.training.replay import replay_run

CP = 64  # the tiny fixture's packed latent channels


def _one_error_line(code: int, out: str, *needles: str) -> None:
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _condition(path, grids, rows=1, seed=0, dtype=torch.bfloat16, **extra):
    g = torch.Generator().manual_seed(seed)
    nc = sum(h * w for h, w in grids)
    t = {"image_latents": torch.randn(rows, nc, CP, generator=g).to(dtype),
         "condition_grids": torch.tensor(grids, dtype=torch.int64), **extra}
    save_file(t, str(path))
    return t


def test_condition_run_stores_replays_and_names_condition_rows(cli, tmp_path):
    grids = [(3, 5), (2, 2)]
    t = _condition(tmp_path / "c.safetensors", grids)
    code, out = cli("run", "-o", tmp_path / "a", "--batch", "2", "--steps", "2", "--capture", "L2",
                    "--condition", tmp_path / "c.safetensors")
    assert code == 0, out
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert sorted(m["settings"]["input_files"]) == ["condition"]
    stored = load_file(str(tmp_path / "a" / "inputs.safetensors"))
    assert stored["cond_grids"].tolist() == [list(g) for g in grids]
    assert torch.equal(stored["cond"], t["image_latents"].float().expand(2, -1, -1))
    replay_run(tmp_path / "a", tmp_path / "replay")
    assert diff_runs(open_run(tmp_path / "a"), open_run(tmp_path / "replay")).verdict.value == "identical"
    code, out = cli("recompute", tmp_path / "a", "-o", tmp_path / "recompute")  # the trainer's side
    assert code == 0, out
    assert diff_runs(open_run(tmp_path / "a"), open_run(tmp_path / "recompute")).verdict.value == "identical"
    # one value of the second condition image changed: the first drift is a condition row
    t2 = dict(t)
    lat = t["image_latents"].clone()
    lat[0, 15 + 3, 7] += 1
    t2["image_latents"] = lat
    save_file(t2, str(tmp_path / "c2.safetensors"))
    code, out = cli("run", "-o", tmp_path / "b", "--batch", "2", "--steps", "2", "--capture", "L2",
                    "--condition", tmp_path / "c2.safetensors")
    assert code == 0, out
    report = diff_runs(open_run(tmp_path / "a"), open_run(tmp_path / "b"))
    fd = report.first_drift
    assert report.verdict.value == "drift" and fd.op == "latent_proj_gemm" and fd.block == -1
    first = fd.rows.first[0]
    assert (first.kind, first.pos) == ("cond", 15 + 3) and str(first) == "cond 18"


def test_edit_presets_from_the_command_line(cli, tmp_path):
    _condition(tmp_path / "one.safetensors", [(5, 3)])
    _condition(tmp_path / "two.safetensors", [(5, 3), (2, 4)])
    code, out = cli("run", "-o", tmp_path / "e", "--preset", "diffusers-edit", "--mode", "auto",
                    "--steps", "2", "--condition", tmp_path / "one.safetensors")
    assert code == 0, out
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["settings"]["preset"] == "diffusers-edit"
    code, out = cli("run", "-o", tmp_path / "p", "--preset", "diffusers-edit-plus", "--mode", "auto",
                    "--steps", "2", "--condition", tmp_path / "two.safetensors")
    assert code == 0, out
    code, out = cli("run", "-o", tmp_path / "x1", "--preset", "diffusers-edit", "--mode", "auto",
                    "--condition", tmp_path / "two.safetensors")
    _one_error_line(code, out, "QwenImageEditPipeline", "exactly 1 condition image (", "has 2")
    code, out = cli("run", "-o", tmp_path / "x2", "--preset", "diffusers-edit-plus", "--mode", "auto")
    _one_error_line(code, out, "QwenImageEditPlusPipeline", "at least 1", "has 0")
    code, out = cli("run", "-o", tmp_path / "x3", "--preset", "diffusers", "--mode", "auto",
                    "--condition", tmp_path / "one.safetensors")
    _one_error_line(code, out, "QwenImagePipeline", "no condition image")


def test_condition_file_rows_set_the_batch_only_without_batch_options(cli, tmp_path):
    """A condition file of B > 1 rows sets the run's batch when neither --batch nor --samples
    is given (as --condition's help says); one row fits any batch; a given batch must match."""
    _condition(tmp_path / "two.safetensors", [(2, 3)], rows=2)
    _condition(tmp_path / "one.safetensors", [(2, 3)])
    code, out = cli("run", "-o", tmp_path / "a", "--steps", "2", "--capture", "L0",
                    "--condition", tmp_path / "two.safetensors")
    assert code == 0, out
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["settings"]["samples"] == [0, 1]
    code, out = cli("run", "-o", tmp_path / "b", "--steps", "2", "--capture", "L0", "--batch", "3",
                    "--condition", tmp_path / "one.safetensors")
    assert code == 0, out
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["settings"]["samples"] == [0, 1, 2]
    code, out = cli("run", "-o", tmp_path / "c", "--samples", "4", "--condition",
                    tmp_path / "two.safetensors")
    _one_error_line(code, out, "holds 2 batch rows, the run has 1 sample (--batch/--samples)")
    import inspect

    from drifttool.cli.run import run

    helps = inspect.signature(run).parameters["condition"].default.help
    assert "set the run's batch when --batch/--samples are absent" in helps


def _bad(tmp_path):
    g = torch.Generator().manual_seed(2)
    cases = []

    def f(name, tensors):
        p = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(p))
        return p

    grids = torch.tensor([[3, 5]])
    lat = torch.randn(1, 15, CP, generator=g)
    cases.append((f("tokens", {"image_latents": lat[:, :14].contiguous(), "condition_grids": grids}), [],
                  ["holds 14 tokens", "give 15"]))
    cases.append((f("nogrid", {"image_latents": lat}), [], ["no tensor 'condition_grids'"]))
    cases.append((f("gridshape", {"image_latents": lat, "condition_grids": torch.tensor([[3, 5, 1]])}), [],
                  ["'condition_grids' must be [K, 2] positive integers"]))
    cases.append((f("gridneg", {"image_latents": lat, "condition_grids": torch.tensor([[-3, -5]])}), [],
                  ["positive integers"]))
    cases.append((f("gridfloat", {"image_latents": lat, "condition_grids": grids.float()}), [],
                  ["positive integers", "float32"]))
    cases.append((f("channels", {"image_latents": lat[..., :16].contiguous(), "condition_grids": grids}), [],
                  ["16 packed channels"]))
    cases.append((f("extra", {"image_latents": lat, "condition_grids": grids, "latents": lat.clone()}), [],
                  ["unexpected key(s) ['latents']"]))
    cases.append((f("batch", {"image_latents": torch.randn(3, 15, CP, generator=g), "condition_grids": grids}),
                  ["--batch", "2"], ["holds 3 batch rows,", "the run has 2 samples (--batch/--samples)"]))
    nan = lat.clone()
    nan[0, 4, 1] = float("nan")
    cases.append((f("nan", {"image_latents": nan, "condition_grids": grids}), [], ["non-finite"]))
    return cases


def test_bad_condition_files_one_line(cli, tmp_path):
    for path, extra, needles in _bad(tmp_path):
        code, out = cli("run", "-o", tmp_path / "out", "--condition", path, *extra)
        _one_error_line(code, out, str(path.name), *needles)


def test_condition_with_sp_refused_before_any_rank_starts(cli, tmp_path):
    _condition(tmp_path / "c.safetensors", [(2, 3)])
    code, out = cli("run", "-o", tmp_path / "sp", "--sp", "2", "--condition", tmp_path / "c.safetensors")
    _one_error_line(code, out, "--sp 2 with --condition", "sequence parallelism")
    assert not (tmp_path / "sp").exists()


def test_condition_under_sequence_parallelism_refused():
    from types import SimpleNamespace

    from drifttool.errors import UnsupportedConfigError
    from drifttool.runtime import Runtime
    from drifttool.sampling.config import SamplerConfig
    from drifttool.sampling.inputs import RolloutInputs
    from drifttool.sampling.step import _velocities

    rt = Runtime(mode="strict")
    rt.plan = SimpleNamespace(dims=SimpleNamespace(sp=2, cfg=1))
    inputs = RolloutInputs(sample_ids=[0], x0=torch.zeros(1, 6, CP), txt=torch.zeros(1, 3, 32),
                           img_grid=(2, 3), cond=torch.zeros(1, 4, CP), cond_grids=((2, 2),))
    with pytest.raises(UnsupportedConfigError, match="sequence parallelism"):
        _velocities(None, rt, inputs.x0, torch.zeros(1), inputs, SamplerConfig(num_steps=2), False,
                    dict(phase="rollout", step=0, sigma=1.0, img_grid=(2, 3)))
