"""The vllm-omni capture adapter on the CPU: loaded from a diffusers checkpoint, neutral hooks,
drifttool's identities and digests, the first drift against diffusers, the declared fused path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm_omni")
pytest.importorskip("diffusers")

import torch  # noqa: E402

from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.capture.recorder import Recorder
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import Verdict
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec

pytestmark = pytest.mark.vllm_omni
GRID = (3, 5)  # 15 image tokens: an awkward shape


def _inputs(seed: int, batch: int = 3, L: int = 7, lens=(7, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, GRID[0] * GRID[1], 64, generator=g)
    txt = torch.randn(batch, L, 32, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
    tau = torch.rand(batch, generator=g)
    return x, txt, mask, tau


def _scope(batch, lens):
    return dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=list(range(batch)),
                txt_lens=list(lens), img_grid=GRID)


def _plain(model, x, txt, mask, tau):
    from drifttool.adapters.vllm_omni_cpu import forward_context

    tr = model.transformer
    with forward_context(model.od_config), torch.no_grad():
        out = tr(hidden_states=x.to(model.dtype), encoder_hidden_states=txt.to(model.dtype),
                 encoder_hidden_states_mask=mask, timestep=tau, img_shapes=[[(1, *GRID)]] * x.shape[0],
                 txt_seq_lens=[txt.shape[1]] * x.shape[0], return_dict=False)
    return out[0] if isinstance(out, tuple) else out.sample


def _hooked(model, x, txt, mask, tau, rt):
    with rt.scope(**_scope(x.shape[0], mask.sum(1).tolist())), torch.no_grad():
        return model(x.to(model.dtype), txt.to(model.dtype), mask, tau, GRID, rt)


def test_loads_every_parameter_from_a_diffusers_checkpoint(load, model_folder):
    from safetensors.torch import load_file

    from drifttool.model.checkpoint_files import weight_files

    model = load(torch.float32)
    stored = {}
    for f in weight_files(model_folder):
        stored.update(load_file(str(f)))
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(stored)  # the fused QKV split back under diffusers' names
    for name, t in stored.items():
        assert torch.equal(got[name].view(torch.int32), t.float().view(torch.int32)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hooks_change_no_output_bytes(load, dtype):
    from drifttool.adapters import vllm_omni_glue as G

    model = load(dtype)
    mod = G.transformer_module()
    func = mod._qwen_image_qk_norm_rope
    x, txt, mask, tau = _inputs(3)
    plain = _plain(model, x, txt, mask, tau)
    rt = Runtime(mode="auto", recorder=Recorder("L2"))
    hooked = _hooked(model, x, txt, mask, tau, rt)
    after = _plain(model, x, txt, mask, tau)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for out in (hooked, after):
        assert torch.equal(out.view(bits), plain.view(bits))
    assert mod._qwen_image_qk_norm_rope is func  # the wrapper is removed
    assert not [n for n, m in model.transformer.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    rt.recorder.flush()
    ops = rt.recorder.ops_table().column("op").to_pylist()
    per_block = {op: ops.count(op) for op in set(ops)}
    assert per_block["multi_axis_rope"] == per_block["qk_rmsnorm"] > 0


@pytest.fixture(scope="module")
def runs(load, model_folder, tmp_path_factory):
    from drifttool.adapters.diffusers_qwenimage import load_transformer, run_diffusers
    from drifttool.adapters.vllm_omni_qwenimage import run_vllm_omni

    out = tmp_path_factory.mktemp("vllm_omni")
    fp32 = RunSpec(dtype="float32")
    run_vllm_omni(fp32, out / "omni32", transformer=load(torch.float32))
    execute(RunSpec(dtype="float32", mode="auto"), out / "auto32")
    run_vllm_omni(RunSpec(), out / "omni16", transformer=load(torch.bfloat16))
    run_diffusers(RunSpec(), out / "diffusers16",
                  transformer=load_transformer(model_folder, torch.bfloat16))
    return out


def test_fp32_digests_equal_the_production_backend(runs):
    rep = diff_runs(open_run(runs / "auto32"), open_run(runs / "omni32"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].matched > 1000 and rep.counts["ops"].only_a == rep.counts["ops"].only_b == 0
    run = open_run(runs / "omni32")
    assert run.manifest["model_source"]["implementation"] == "vllm_omni.QwenImageTransformer2DModel"
    assert run.manifest["fingerprint"] == open_run(runs / "auto32").manifest["fingerprint"]
    attn = [r for r in run.trace_rows() if r["op"] == "joint_attention_fused"]
    assert attn and all("TORCH_SDPA_CPU/CpuSDPAImpl/NoParallelAttention" in r["kernel"] for r in attn)


def test_bf16_diff_against_diffusers_names_the_rmsnorm_then_rope(runs):
    """vllm-omni's RMSNorms are ``torch.nn.RMSNorm`` (diffusers': normalise in fp32, round, times
    the gain): in bf16 the text input norm is the first drift, and on the image stream the Q/K
    RMSNorm of block 0, then RoPE; everything before each matched."""
    a, b = open_run(runs / "diffusers16"), open_run(runs / "omni16")
    rep = diff_runs(a, b)
    assert rep.verdict is Verdict.DRIFT
    fd = rep.first_drift
    assert (fd.kind, fd.op, fd.step, fd.block, fd.stream, fd.origin) == \
        ("op", "txt_in_rmsnorm_linear", 0, -1, "txt", True)
    cli = subprocess.run([sys.executable, "-m", "drifttool", "diff", str(runs / "diffusers16"),
                          str(runs / "omni16")], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    assert cli.returncode == 1, cli.stderr
    assert "first drift at rollout step 0 cond before block 0 txt txt_in_rmsnorm_linear#0" in cli.stdout

    def image_stream(run):
        rows = [r for r in run.ops_table().to_pylist() if r["step"] == 0 and r["branch"] == "cond"
                and r["stream"] == "img" and r["sample"] == 0 and r["block"] in (-1, 0)]
        rows.sort(key=lambda r: (r["block"], r["op"] != "timestep_embed_mlp", r["op_pos"],
                                 r["index"]))
        return {(r["block"], r["op"], r["call"], r["index"]): r["digest"] for r in rows}

    da, db = image_stream(a), image_stream(b)
    assert da.keys() == db.keys()
    differing = [k for k in sorted(da, key=list(da).index) if da[k] != db[k]]
    assert differing[0][:2] == (0, "qk_rmsnorm"), differing[:3]
    assert [k for k in list(da)[:list(da).index(differing[0])] if da[k] != db[k]] == []
    assert any(k[1] == "multi_axis_rope" for k in differing)


def test_fused_qk_norm_rope_threshold_is_a_declared_batch_dependent_path(load, monkeypatch):
    model = load(torch.bfloat16)
    x, txt, mask, tau = _inputs(4, batch=2, lens=(7, 5))
    for threshold in ("16", None):
        if threshold is None:
            monkeypatch.delenv("VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS", raising=False)
        else:
            monkeypatch.setenv("VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS", threshold)
        rt = Runtime(mode="auto", recorder=Recorder("L1"))
        _hooked(model, x, txt, mask, tau, rt)
        rope = [e for e in rt.trace.entries() if e.op == "multi_axis_rope"]
        assert len(rope) == 4 * 2  # 2 blocks, img and txt, q and k
        want = threshold or "2048"
        for e in rope:
            assert e.declared and "batch-dependent" in e.reason, e
            assert f">= {want} tokens" in e.reason and "VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS" in e.reason
            tokens = 2 * (GRID[0] * GRID[1] if e.stream == "img" else 7)
            assert e.reason.endswith(f"B*S = {tokens}: eager") and e.kernel.endswith("[eager]")
        # the RMSNorm ran as its own modules (the eager path): recorded, not declared
        norms = [e for e in rt.trace.entries() if e.op == "qk_rmsnorm"]
        assert len(norms) == 8 and not any(e.declared for e in norms)


def test_a_capture_point_that_never_fires_is_an_error(load):
    from drifttool.adapters.vllm_omni_qwenimage import instrument
    from drifttool.adapters.vllm_omni_cpu import forward_context

    model = load(torch.float32)
    tr = model.transformer
    x, txt, mask, tau = _inputs(5)
    blk = tr.transformer_blocks[1]
    original = blk.txt_mlp.net[2]
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with pytest.raises(DriftToolError, match="transformer_blocks.1.txt_mlp.net.2 .* never ran"):
        with forward_context(model.od_config), rt.scope(**_scope(3, (7, 4, 2))), torch.no_grad():
            with instrument(tr, rt):
                # a runtime that computes the MLP down projection elsewhere (a new module)
                blk.txt_mlp.net[2] = torch.nn.Linear(original.input_size, original.output_size)
                try:
                    tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                       timestep=tau, img_shapes=[[(1, *GRID)]] * 3, txt_seq_lens=[7] * 3)
                finally:
                    blk.txt_mlp.net[2] = original


def test_refuses_unsupported_configurations(load, monkeypatch):
    import importlib.metadata

    from drifttool.adapters.vllm_omni_qwenimage import instrument

    model = load(torch.float32)
    rt = Runtime(mode="auto")
    with pytest.raises(DriftToolError, match="expected a vllm-omni"):
        with instrument(torch.nn.Linear(2, 2), rt):
            pass
    monkeypatch.setattr(model.transformer, "zero_cond_t", True)
    with pytest.raises(UnsupportedConfigError, match="zero_cond_t"):
        with instrument(model.transformer, rt):
            pass
    monkeypatch.setattr(model.transformer, "zero_cond_t", False)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.31.0" if name == "vllm-omni" else real(name))
    with pytest.raises(DriftToolError, match=r"vllm-omni 0.31.0 is not supported .*0.30.x"):
        with instrument(model.transformer, rt):
            pass


def test_a_compiled_run_is_refused_naming_enforce_eager(load, omni, model_folder):
    """vllm-omni compiles when ``enforce_eager`` is False: its own regional compilation (the
    default) and full compilation (``Module.compile()``) of the transformer, and an engine
    config that asks for either, are refused in one line naming the setting."""
    from vllm_omni.diffusion.compile import regionally_compile
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    from drifttool.adapters.vllm_omni_qwenimage import (VllmOmniQwenImage, instrument,
                                                        load_transformer)

    assert omni.enforce_eager is True  # the CPU runtime runs eager
    rt = Runtime(mode="auto")
    regional = load_transformer(model_folder, torch.float32).transformer
    regionally_compile(regional, dynamic=True)
    full = load_transformer(model_folder, torch.float32).transformer
    full.compile(dynamic=True)
    for tr, where in ((regional, "transformer_blocks.0.forward is a torch.compile'd function"),
                      (full, "the transformer is compiled in place")):
        with pytest.raises(UnsupportedConfigError, match="enforce_eager=False") as e:
            with instrument(tr, rt):
                pass
        assert where in str(e.value), e.value
    compiling = OmniDiffusionConfig(model_class_name="QwenImagePipeline", enforce_eager=False)
    with pytest.raises(UnsupportedConfigError, match="has enforce_eager=False"):
        VllmOmniQwenImage(load(torch.float32).transformer, compiling, {})


def test_a_step_cache_backend_is_refused_in_one_line(load):
    """TeaCache / cache-dit skip or reuse block outputs between steps: refused by the capture."""
    import copy

    from drifttool.adapters.vllm_omni_qwenimage import VllmOmniQwenImage

    model = load(torch.float32)
    od = copy.copy(model.od_config)
    od.cache_backend = "tea_cache"
    with pytest.raises(UnsupportedConfigError, match="cache backend 'tea_cache' is not supported") as e:
        VllmOmniQwenImage(model.transformer, od, {})
    assert "\n" not in str(e.value)


def _cpu_fused_qk_norm_rope(q, k, wq, wk, table, eps, interleaved=True):
    """A CPU stand-in for vllm-omni's Triton QK-RMSNorm+RoPE kernel (the norm modules do not run):
    only the adapter's path bookkeeping is under test, not the kernel's bytes."""
    half = table.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]

    def one(x, w):
        x = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float(), eps)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(q.dtype)

    return one(q, wq), one(k, wk)


def test_the_fused_path_is_read_back_and_depends_on_the_batch(load, monkeypatch):
    """Above the token threshold vllm-omni bypasses the norm modules; the trace says so per call,
    the bypassed norms are traced with the fused kernel (no digest) and nothing reads as silent."""
    from drifttool.adapters import vllm_omni_glue as G

    mod = G.transformer_module()
    monkeypatch.setattr(mod, "_fused_cuda_supported", lambda *a, **k: True)
    monkeypatch.setattr(mod, "fused_qk_norm_rope", _cpu_fused_qk_norm_rope)
    monkeypatch.setenv("VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS", "40")
    model = load(torch.bfloat16)
    paths = {}
    for batch in (2, 3):  # image tokens 30 (eager) and 45 (fused); text 14 and 21 (eager)
        x, txt, mask, tau = _inputs(7, batch=batch, lens=(7, 6, 5)[:batch])
        rt = Runtime(mode="auto", recorder=Recorder("L1"))
        _hooked(model, x, txt, mask, tau, rt)
        rt.recorder.flush()
        entries = rt.trace.entries()
        rope = {(e.block, e.stream, e.call): e for e in entries if e.op == "multi_axis_rope"}
        paths[batch] = {s: {e.kernel.rsplit("[", 1)[1][:-1] for k, e in rope.items() if k[1] == s}
                        for s in ("img", "txt")}
        norms = [e for e in entries if e.op == "qk_rmsnorm" and e.stream == "img"]
        recorded = [r for r in rt.recorder.ops_table().to_pylist()
                    if r["op"] == "qk_rmsnorm" and r["stream"] == "img"]
        if batch == 3:
            assert len(norms) == 4 and all(e.declared and "fused_qk_norm_rope" in e.kernel
                                           and e.reason.endswith("B*S = 45: fused") for e in norms)
            assert recorded == []  # no tensor to digest
        else:
            assert len(norms) == 4 and not any(e.declared for e in norms) and recorded
    assert paths == {2: {"img": {"eager"}, "txt": {"eager"}}, 3: {"img": {"fused"}, "txt": {"eager"}}}


@pytest.mark.parametrize("field", ["sequence_parallel_size", "tensor_parallel_size",
                                   "cfg_parallel_size", "pipeline_parallel_size",
                                   "data_parallel_size"])
def test_any_parallel_degree_above_one_is_refused_in_one_line(load, monkeypatch, field):
    """On one of several ranks the taps would record a shard as the whole tensor: the capture
    (the transformer's parallel config) and the wrapper (the engine config's) refuse it, naming
    the setting, before anything is hooked."""
    import copy

    from drifttool.adapters.vllm_omni_qwenimage import VllmOmniQwenImage, instrument

    model = load(torch.float32)
    pc = copy.copy(model.transformer.parallel_config)
    setattr(pc, field, 2)
    od = copy.copy(model.od_config)
    od.parallel_config = pc
    with pytest.raises(UnsupportedConfigError, match=f"{field}=2") as e:
        VllmOmniQwenImage(model.transformer, od, {})
    assert "\n" not in str(e.value)
    monkeypatch.setattr(model.transformer, "parallel_config", pc)
    with pytest.raises(UnsupportedConfigError, match=rf"\({field}=2\) is not supported") as e:
        with instrument(model.transformer, Runtime(mode="auto")):
            pass
    assert "\n" not in str(e.value)
    assert not [n for n, m in model.transformer.named_modules()
                if m._forward_hooks or m._forward_pre_hooks]


def test_condition_images_are_refused_in_one_line(load, tmp_path):
    """An edit run (packed condition latents) through the vllm-omni wrapper: refused, not a
    TypeError from the model call."""
    from safetensors.torch import save_file

    from drifttool.adapters.vllm_omni_qwenimage import run_vllm_omni

    g = torch.Generator().manual_seed(13)
    cond = tmp_path / "cond.safetensors"
    save_file({"image_latents": torch.randn(1, 5 * 3, 64, generator=g),
               "condition_grids": torch.tensor([[5, 3]])}, str(cond))
    execute(RunSpec(condition=str(cond), mode="auto"), tmp_path / "drifttool")  # a valid input
    with pytest.raises(UnsupportedConfigError, match="condition images") as e:
        run_vllm_omni(RunSpec(condition=str(cond)), tmp_path / "omni",
                      transformer=load(torch.bfloat16))
    assert "\n" not in str(e.value)


def test_a_second_capture_and_rope_outside_the_wrapped_function_are_errors(load):
    """A capture inside a capture is refused; a forward whose QK-norm+RoPE does not go through
    ``_qwen_image_qk_norm_rope`` (a runtime that moved it) is an error, not a trace without RoPE."""
    from drifttool.adapters import vllm_omni_glue as G
    from drifttool.adapters.vllm_omni_cpu import forward_context
    from drifttool.adapters.vllm_omni_qwenimage import instrument

    model = load(torch.float32)
    tr = model.transformer
    mod = G.transformer_module()
    original = mod._qwen_image_qk_norm_rope
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with instrument(tr, rt):
        with pytest.raises(DriftToolError, match="another capture is active") as e:
            with instrument(tr, Runtime(mode="auto")):
                pass
        assert "\n" not in str(e.value)
    assert mod._qwen_image_qk_norm_rope is original
    x, txt, mask, tau = _inputs(17)
    with pytest.raises(DriftToolError, match="_qwen_image_qk_norm_rope never ran") as e:
        with forward_context(model.od_config), rt.scope(**_scope(3, (7, 4, 2))), torch.no_grad():
            with instrument(tr, rt):
                mod._qwen_image_qk_norm_rope = lambda *a, **k: original(*a, **k)  # not the wrapper
                tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                   timestep=tau, img_shapes=[[(1, *GRID)]] * 3, txt_seq_lens=[7] * 3)
    assert "\n" not in str(e.value)
    assert mod._qwen_image_qk_norm_rope is original
