"""``drifttool run`` device, image size and input-file options: every bad value is one line and
exit 2; the default grid given in pixels, and a run's own inputs given back as files, reproduce
the run byte for byte; non-square grids and file prompts of odd lengths at batch 1 and 3 run.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.runner import execute
from drifttool.training.replay import replay_run
from drifttool.setting_checks import check_mode_device, device_operators
from drifttool.settings import RunSpec, resolve
from drifttool.ops.registry import impls
from drifttool.runtime import Mode
from drifttool.errors import UnsupportedConfigError
from tests.conftest import assert_same_bytes

D = 32  # the tiny fixture's joint_attention_dim
CP = 64  # its packed latent channels (in_channels)


def _one_error_line(code: int, out: str, *needles: str) -> None:
    assert code == 2, out
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA reported present (one device): enough for settings checks that refuse before any
    tensor would go there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("args, needles", [
    (["--device", "gpu"], ["unknown device 'gpu'", "cpu, cuda or cuda:N"]),
    (["--device", "cuda:x"], ["unknown device 'cuda:x'"]),
    (["--device", "cuda"], ["device 'cuda'", "CUDA is not available", "--device cpu"]),
    (["--device", "cuda:3", "--mode", "auto"], ["CUDA is not available"]),
    (["--height", "60"], ["height must be a multiple of 16", "got 60"]),
    (["--width", "0"], ["width must be a multiple of 16", "got 0"]),
    (["--height", "-32"], ["height", "got -32"]),
    (["--width", "1000000"], ["width", "16384"]),
])
def test_bad_device_and_size_one_line(cli, tmp_path, no_cuda, args, needles):
    code, out = cli("run", "-o", tmp_path / "r", *args)
    _one_error_line(code, out, *needles)
    assert "None" not in out  # a CPU-only torch's CUDA version is said in words
    assert not (tmp_path / "r").exists()


@pytest.fixture
def strict_cuda_incomplete(monkeypatch):
    """The strict CUDA family without one operator (mlp_down_gemm): strict on CUDA is refused."""
    from drifttool.ops import registry

    table = dict(registry._IMPLS)
    table.pop(("mlp_down_gemm", "strict", "cuda"), None)
    monkeypatch.setattr(registry, "_IMPLS", table)


def test_strict_on_cuda_refused_from_the_registry(cli, tmp_path, fake_cuda, strict_cuda_incomplete):
    code, out = cli("run", "-o", tmp_path / "r", "--device", "cuda")
    _one_error_line(code, out, "--mode strict on cuda", "strict family has no CUDA implementation yet",
                    "--mode auto", "1 operator(s) lack one (mlp_down_gemm)")
    assert not (tmp_path / "r").exists()
    code, out = cli("run", "-o", tmp_path / "r", "--device", "cuda:0", "--mode", "strict")
    _one_error_line(code, out, "on cuda:0")


def test_mode_device_check_reads_the_registry():
    ops = device_operators("cuda")
    assert "qkv_bias_gemm" in ops and "flow_sde_step_logp" in ops
    assert "flow_sigma_table" not in ops  # takes no tensors: it runs on the CPU
    from drifttool.ops.lora import PRODUCTION_ONLY  # LoRA modes strict refuses: never dispatched there

    missing = [op for op in ops if not impls(op, "strict", "cuda") and op not in PRODUCTION_ONLY]
    if missing:
        with pytest.raises(UnsupportedConfigError, match=rf"{len(missing)} operator\(s\)"):
            check_mode_device(Mode.STRICT, "cuda")
    else:  # the whole family registered: strict on CUDA passes the check
        check_mode_device(Mode.STRICT, "cuda")
    for mode in (Mode.AUTO, Mode.OFF, Mode.AUDIT):  # production on CUDA; audit falls back
        check_mode_device(mode, "cuda")
    for mode in Mode:
        check_mode_device(mode, "cpu")


def test_a_registered_strict_cuda_family_passes_the_check(monkeypatch):
    """The refusal is read from the registry: once every operator has a strict CUDA
    implementation (a stand-in here), strict on CUDA is accepted without another edit."""
    import dataclasses

    from drifttool.ops import registry

    impls = dict(registry._IMPLS)
    for op in device_operators("cuda"):
        impls[(op, "strict", "cuda")] = [dataclasses.replace(i, family="strict")
                                         for i in impls[(op, "production", "cuda")]]
    monkeypatch.setattr(registry, "_IMPLS", impls)
    check_mode_device(Mode.STRICT, "cuda")
    del impls[("mlp_down_gemm", "strict", "cuda")]
    with pytest.raises(UnsupportedConfigError, match=r"1 operator\(s\) lack one \(mlp_down_gemm\)"):
        check_mode_device(Mode.STRICT, "cuda")


def test_replay_and_experiment_device_options(cli, tmp_path, strict_run, no_cuda):
    code, out = cli("replay", strict_run, "-o", tmp_path / "r", "--device", "tpu")
    _one_error_line(code, out, "unknown device 'tpu'")
    code, out = cli("recompute", strict_run, "-o", tmp_path / "r", "--device", "cuda")
    _one_error_line(code, out, "CUDA is not available")
    code, out = cli("experiment", "train-rollout", "-o", tmp_path / "e", "--device", "gpu")
    _one_error_line(code, out, "unknown device 'gpu'")
    code, out = cli("experiment", "grpo", "-o", tmp_path / "g", "--height", "50")
    _one_error_line(code, out, "height must be a multiple of 16")
    code, out = cli("probe", "-o", tmp_path / "p", "--width", "8")
    _one_error_line(code, out, "width must be a multiple of 16")


def test_replay_of_strict_run_on_cuda_refused(cli, tmp_path, strict_run, fake_cuda, strict_cuda_incomplete):
    code, out = cli("replay", strict_run, "-o", tmp_path / "r", "--device", "cuda")
    _one_error_line(code, out, "strict family has no CUDA implementation", "--mode auto")
    code, out = cli("recompute", strict_run, "-o", tmp_path / "r", "--device", "cuda")
    _one_error_line(code, out, "strict family has no CUDA implementation")
    code, out = cli("probe", "-o", tmp_path / "p", "--device", "cuda")
    _one_error_line(code, out, "strict family has no CUDA implementation")


def test_default_grid_in_pixels_is_the_default_run(cli, tmp_path, strict_run):
    code, out = cli("run", "-o", tmp_path / "px", "--height", "64", "--width", "96")
    assert code == 0, out
    code, out = cli("diff", strict_run, tmp_path / "px")
    assert code == 0 and "IDENTICAL" in out, out
    a = json.loads((strict_run / "manifest.json").read_text())
    b = json.loads((tmp_path / "px" / "manifest.json").read_text())
    for m in (a, b):
        m.pop("files")
    assert a == b  # settings record img_grid only, no height/width/device keys


# ---------------------------------------------------------------------------------------------
# input files


def _embeds(path, txt, mask=None, **extra):
    t = {"prompt_embeds": txt, **extra}
    if mask is not None:
        t["prompt_embeds_mask"] = mask
    save_file(t, str(path))
    return path


def _right_padded(lens, L, gen):
    """Random [B, L, D] fp32 embeddings (zeros past each length, as encode_prompt pads) and the
    [B, L] int64 0/1 mask."""
    B = len(lens)
    mask = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None]).to(torch.int64)
    txt = torch.randn(B, L, D, generator=gen) * mask[..., None]
    return txt, mask


def test_run_inputs_as_files_reproduce_the_run(cli, tmp_path, strict_run):
    t = load_file(str(strict_run / "inputs.safetensors"))
    assert "txt_mask" in t  # the fixture's prompts have odd, different lengths
    pe = _embeds(tmp_path / "pe.safetensors", t["txt"], t["txt_mask"].to(torch.int64))
    ne = _embeds(tmp_path / "ne.safetensors", t["neg_txt"],
                 t["neg_mask"].to(torch.int64) if "neg_mask" in t else None)
    save_file({"latents": t["x0"]}, str(tmp_path / "x0.safetensors"))
    code, out = cli("run", "-o", tmp_path / "f", "--prompt-embeds", pe, "--negative-prompt-embeds", ne,
                    "--latents", tmp_path / "x0.safetensors")
    assert code == 0, out
    code, out = cli("diff", strict_run, tmp_path / "f")
    assert code == 0 and "IDENTICAL" in out, out
    m = json.loads((tmp_path / "f" / "manifest.json").read_text())
    src = json.loads((strict_run / "manifest.json").read_text())
    assert m["replay"] == src["replay"]  # the same replay inputs, digest for digest
    files = m["settings"]["input_files"]
    assert sorted(files) == ["latents", "negative_prompt_embeds", "prompt_embeds"]
    import hashlib
    assert files["prompt_embeds"]["sha256"] == hashlib.sha256(pe.read_bytes()).hexdigest()
    # the replay needs no file: the inputs are in the artifact
    pe.unlink()
    code, out = cli("replay", tmp_path / "f", "-o", tmp_path / "f-replay")
    assert code == 0, out
    code, out = cli("diff", tmp_path / "f", tmp_path / "f-replay")
    assert code == 0 and "IDENTICAL" in out, out


def test_bf16_file_values_upcast_exactly(tmp_path, strict_run):
    """A bf16 embeddings file gives the run of its values in fp32: the upcast is exact, and the
    bf16 model casts at its input either way."""
    t = load_file(str(strict_run / "inputs.safetensors"))
    txt16 = t["txt"].to(torch.bfloat16)
    mask = t["txt_mask"].to(torch.int64)
    a = _embeds(tmp_path / "a.safetensors", txt16, mask)
    b = _embeds(tmp_path / "b.safetensors", txt16.to(torch.float32), mask)
    runs = []
    for f in (a, b):
        out = tmp_path / f.stem
        execute(RunSpec(prompt_embeds=f, capture="L1"), out)
        runs.append(out)
    ia, ib = (load_file(str(r / "inputs.safetensors")) for r in runs)
    assert_same_bytes(ia["txt"], ib["txt"], "txt")
    assert diff_runs(open_run(runs[0]), open_run(runs[1])).verdict.value == "identical"


@pytest.mark.parametrize("lens, L", [([7], 9), ([5, 13, 1], 16)])
def test_file_prompts_odd_lengths_batch_1_and_3(tmp_path, lens, L):
    gen = torch.Generator().manual_seed(len(lens) * 100 + L)
    txt, mask = _right_padded(lens, L, gen)
    neg, neg_mask = _right_padded([3] * len(lens), 5, gen)
    pe = _embeds(tmp_path / "pe.safetensors", txt, mask)
    ne = _embeds(tmp_path / "ne.safetensors", neg, neg_mask)
    # batch taken from the files when no --batch/--samples is given
    fx, s = resolve(RunSpec(prompt_embeds=pe, negative_prompt_embeds=ne, capture="L1"))
    assert s.samples == tuple(range(len(lens))) and s.cfg_branches == 2
    out = tmp_path / "run"
    summary = execute(RunSpec(prompt_embeds=pe, negative_prompt_embeds=ne, capture="L1"), out)
    assert summary["complete"] and summary["samples"] == list(range(len(lens)))
    stored = load_file(str(out / "inputs.safetensors"))
    assert_same_bytes(stored["txt"], txt, "txt")
    assert_same_bytes(stored["txt_mask"].to(torch.int64), mask, "txt_mask")
    assert_same_bytes(stored["neg_txt"], neg, "neg_txt")
    m = json.loads((out / "manifest.json").read_text())
    assert m["replay"]["prompt_lengths"] == lens


def test_prompt_file_without_negative_runs_without_cfg(tmp_path):
    gen = torch.Generator().manual_seed(3)
    txt, mask = _right_padded([4, 6], 6, gen)
    pe = _embeds(tmp_path / "pe.safetensors", txt, mask)
    _, s = resolve(RunSpec(prompt_embeds=pe))
    assert s.cfg_branches == 1
    out = tmp_path / "run"
    execute(RunSpec(prompt_embeds=pe, capture="L0"), out)
    assert "neg_txt" not in load_file(str(out / "inputs.safetensors"))
    branches = set(open_run(out).steps_table()["branch"].to_pylist())
    assert branches == {"cond"}


def test_all_valid_mask_is_dropped_and_absent_mask_is_all_valid(tmp_path):
    gen = torch.Generator().manual_seed(4)
    txt = torch.randn(2, 5, D, generator=gen)
    ones = _embeds(tmp_path / "ones.safetensors", txt, torch.ones(2, 5, dtype=torch.int64))
    none = _embeds(tmp_path / "none.safetensors", txt)
    for f in (ones, none):
        _, s = resolve(RunSpec(prompt_embeds=f))
        assert s.external.txt_mask is None


@pytest.mark.parametrize("h, w, batch", [(48, 80, 3), (80, 48, 1), (16, 112, 1)])
def test_non_square_grids(tmp_path, h, w, batch):
    """1664x928-style grids (here small multiples of 16) on the tiny model, batch 1 and 3."""
    out = tmp_path / "run"
    summary = execute(RunSpec(height=h, width=w, batch=batch, steps=2, capture="L1"), out)
    assert summary["complete"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["settings"]["img_grid"] == [h // 16, w // 16]
    assert m["fingerprint"]["arch"]["img_grid"] == [h // 16, w // 16]
    x0 = load_file(str(out / "inputs.safetensors"))["x0"]
    assert tuple(x0.shape) == (batch, (h // 16) * (w // 16), CP)
    replay_run(out, tmp_path / "replay")  # shapes from the artifact, not the fixture's grid
    r = json.loads((tmp_path / "replay" / "manifest.json").read_text())
    assert r["settings"]["img_grid"] == [h // 16, w // 16]
    assert diff_runs(open_run(out), open_run(tmp_path / "replay")).verdict.value == "identical"


def test_latents_file_on_a_non_square_grid(tmp_path, cli):
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(1, 3 * 7, CP, generator=gen).to(torch.bfloat16)
    save_file({"latents": x0}, str(tmp_path / "x0.safetensors"))
    code, out = cli("run", "-o", tmp_path / "r", "--height", "48", "--width", "112", "--batch", "1",
                    "--latents", tmp_path / "x0.safetensors", "--capture", "L0")
    assert code == 0, out
    stored = load_file(str(tmp_path / "r" / "inputs.safetensors"))["x0"]
    assert_same_bytes(stored, x0.to(torch.float32), "x0")
    code, out = cli("run", "-o", tmp_path / "r2", "--batch", "1", "--latents", tmp_path / "x0.safetensors")
    _one_error_line(code, out, "holds 21 image tokens", "4x6 patch grid", "--height/--width")


def _bad_files(tmp_path):
    """(name, {option: file}, extra args, needles): every way a file can be wrong."""
    gen = torch.Generator().manual_seed(11)
    txt, mask = _right_padded([3, 5], 7, gen)
    cases = []

    def f(name, tensors):
        p = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(p))
        return p

    good = f("good", {"prompt_embeds": txt, "prompt_embeds_mask": mask})
    cases.append(("missing key", {"--prompt-embeds": f("nokey", {"embeds": txt})}, [],
                  ["nokey.safetensors", "no tensor 'prompt_embeds'", "embeds"]))
    cases.append(("extra key", {"--prompt-embeds": f("extra", {"prompt_embeds": txt, "prompt_embeds_mask": mask,
                                                              "negative_prompt_embeds": txt.clone()})}, [],
                  ["extra.safetensors", "unexpected key(s) ['negative_prompt_embeds']", "--negative-prompt-embeds"]))
    cases.append(("latents extra", {"--latents": f("lextra", {"latents": torch.zeros(2, 24, CP),
                                                            "x0": torch.zeros(1)})}, [],
                  ["lextra.safetensors", "unexpected key(s) ['x0']"]))
    cases.append(("rank", {"--prompt-embeds": f("rank", {"prompt_embeds": txt[0]})}, [],
                  ["rank.safetensors", "'prompt_embeds' has shape [7, 32]", "[B, L, joint_attention_dim=32]"]))
    cases.append(("width", {"--prompt-embeds": f("width", {"prompt_embeds": torch.zeros(2, 7, 48)})}, [],
                  ["width.safetensors", "width 48", "joint_attention_dim is 32"]))
    cases.append(("dtype", {"--prompt-embeds": f("dtype", {"prompt_embeds": txt.to(torch.float64)})}, [],
                  ["dtype.safetensors", "float64", "float32, bfloat16 or float16"]))
    nan = txt.clone()
    nan[1, 2, 3] = float("nan")
    cases.append(("non-finite", {"--prompt-embeds": f("nan", {"prompt_embeds": nan})}, [],
                  ["nan.safetensors", "1 non-finite value(s)", "(1, 2, 3)"]))
    cases.append(("batch", {"--prompt-embeds": good}, ["--batch", "3"],
                  ["good.safetensors", "holds 2 batch rows,", "the run has 3 samples"]))
    cases.append(("samples", {"--prompt-embeds": good}, ["--samples", "4"],
                  ["holds 2 batch rows,", "the run has 1 sample (--batch/--samples)"]))
    m2 = mask.clone()
    m2[0, 1] = 2
    cases.append(("mask values", {"--prompt-embeds": f("m01", {"prompt_embeds": txt, "prompt_embeds_mask": m2})},
                  [], ["m01.safetensors", "'prompt_embeds_mask' must hold 0 or 1", "found 2"]))
    left = mask.flip(1)
    cases.append(("left padded", {"--prompt-embeds": f("left", {"prompt_embeds": txt, "prompt_embeds_mask": left})},
                  [], ["left.safetensors", "row 0", "not a prefix", "right-padded"]))
    cases.append(("mask shape", {"--prompt-embeds": f("mshape", {"prompt_embeds": txt,
                                                                "prompt_embeds_mask": mask[:, :6].contiguous()})},
                  [], ["mshape.safetensors", "'prompt_embeds_mask' has shape [2, 6]", "[B, L] = [2, 7]"]))
    cases.append(("mask float", {"--prompt-embeds": f("mfloat", {"prompt_embeds": txt,
                                                                "prompt_embeds_mask": mask.float()})},
                  [], ["mfloat.safetensors", "float32", "0/1 mask"]))
    neg3 = f("neg3", {"prompt_embeds": torch.zeros(3, 4, D)})
    cases.append(("neg batch", {"--prompt-embeds": good, "--negative-prompt-embeds": neg3}, [],
                  ["neg3.safetensors", "holds 3 batch rows,", "holds 2"]))
    cases.append(("neg alone", {"--negative-prompt-embeds": neg3}, [],
                  ["--negative-prompt-embeds goes with --prompt-embeds"]))
    cases.append(("latents key", {"--latents": f("lkey", {"x0": torch.zeros(2, 24, CP)})}, [],
                  ["lkey.safetensors", "no tensor 'latents'"]))
    cases.append(("latents tokens", {"--latents": f("ltok", {"latents": torch.zeros(2, 25, CP)})}, [],
                  ["ltok.safetensors", "25 image tokens", "has 24"]))
    cases.append(("latents channels", {"--latents": f("lch", {"latents": torch.zeros(2, 24, 16)})}, [],
                  ["lch.safetensors", "16 packed channels", "in_channels is 64"]))
    cases.append(("latents unpacked", {"--latents": f("l4d", {"latents": torch.zeros(2, 16, 8, 12)})}, [],
                  ["l4d.safetensors", "'latents' has shape [2, 16, 8, 12]", "packed [B, N=24, in_channels=64]"]))
    inf = torch.zeros(2, 24, CP)
    inf[0, 5, 1] = float("inf")
    cases.append(("latents inf", {"--latents": f("linf", {"latents": inf})}, [],
                  ["linf.safetensors", "non-finite", "(0, 5, 1)"]))
    cases.append(("latents batch", {"--prompt-embeds": good,
                                    "--latents": f("lb", {"latents": torch.zeros(1, 24, CP)})}, [],
                  ["lb.safetensors", "holds 1 batch row,", "holds 2"]))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    cases.append(("not safetensors", {"--prompt-embeds": junk}, [], ["junk.safetensors", "not a readable safetensors"]))
    cases.append(("missing file", {"--latents": tmp_path / "absent.safetensors"}, [],
                  ["absent.safetensors", "cannot read"]))
    return cases


def test_every_bad_input_file_is_one_line(cli, tmp_path):
    for name, files, extra, needles in _bad_files(tmp_path):
        args = [a for opt, p in files.items() for a in (opt, p)]
        code, out = cli("run", "-o", tmp_path / "r", *args, *extra)
        try:
            _one_error_line(code, out, *needles)
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None
        assert not (tmp_path / "r").exists(), name
