"""The xfuser capture adapter on the CPU: neutral hooks, records identical to diffusers' without a
text mask, and xfuser 0.7.0's dropped text mask found at the attention of block 0."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

# not importorskip: importing xfuser on a CPU build of torch needs the adapter's import shim
if importlib.util.find_spec("xfuser") is None:
    pytest.skip("xfuser is not installed (tests/adapters_xfuser/build_env.sh)", allow_module_level=True)
pytest.importorskip("diffusers")

import torch  # noqa: E402

from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.capture.recorder import Recorder  # noqa: E402
from drifttool.diff.compare import diff_runs  # noqa: E402
from drifttool.diff.report import Verdict  # noqa: E402
from drifttool.errors import DriftToolError, UnsupportedConfigError  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.settings import RunSpec, resolve  # noqa: E402

pytestmark = pytest.mark.xfuser
GRID = (3, 5)  # 15 image tokens: an awkward shape


def _inputs(seed: int, batch: int = 3, L: int = 7, lens=(7, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, GRID[0] * GRID[1], 64, generator=g)
    txt = torch.randn(batch, L, 32, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]  # [B, L] right padding
    tau = torch.rand(batch, generator=g)
    return x, txt, mask, tau


def _forward(tr, x, txt, mask, tau, grid=GRID):
    with torch.no_grad():
        return tr(hidden_states=x.to(tr.dtype), encoder_hidden_states=txt.to(tr.dtype),
                  encoder_hidden_states_mask=mask, timestep=tau,
                  img_shapes=[(1, *grid)] * x.shape[0], return_dict=False)[0]


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def test_the_import_shim_is_undone_and_xfuser_runs_on_the_cpu(load):
    import xfuser.envs as envs

    from drifttool.adapters.xfuser_cpu import world_sizes

    load("xfuser", torch.float32)
    assert torch.version.cuda is None and not torch.cuda.is_available()
    assert envs.get_device_name() == "cpu"
    assert set(world_sizes().values()) == {1}
    assert torch.distributed.get_backend() == "gloo"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hooks_change_no_output_bytes(load, dtype):
    import xfuser.core.distributed.attention_backend as ab

    from drifttool.adapters.xfuser_qwenimage import instrument

    tr = load("xfuser", dtype)
    registry = dict(ab.ATTENTION_FUNCTION_REGISTRY)
    x, txt, mask, tau = _inputs(1)
    plain = _forward(tr, x, txt, mask, tau)
    rt = Runtime(mode="auto", recorder=Recorder("L2"))
    scope = dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=[0, 1, 2],
                 txt_lens=[7, 4, 2], img_grid=GRID)
    with instrument(tr, rt), rt.scope(**scope):
        hooked = _forward(tr, x, txt, mask, tau)
    after = _forward(tr, x, txt, mask, tau)
    for out in (hooked, after):
        assert torch.equal(_bits(out), _bits(plain))
    assert ab.ATTENTION_FUNCTION_REGISTRY == registry  # the capture entry is removed
    assert not [n for n, m in tr.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    rt.recorder.flush()
    ops = rt.recorder.ops_table().column("op").to_pylist()
    assert ops.count("joint_attention_fused") > 0 and ops.count("multi_axis_rope") > 0
    attn = [e for e in rt.trace.entries() if e.op == "joint_attention_fused"]
    assert len(attn) == 2 and all(e.actual == "xfuser" for e in attn)
    # read back: the module was handed a text mask, the kernel received none
    assert all(e.kernel.startswith("xfuser.attention:SDPA/torch.sdpa:")
               and e.kernel.endswith(", attn_mask=none") for e in attn), attn[0].kernel


def test_without_a_mask_the_kernel_reads_back_no_dropped_mask(load):
    from drifttool.adapters.xfuser_qwenimage import instrument

    tr = load("xfuser", torch.float32)
    x, txt, _, tau = _inputs(2, batch=2, lens=(7, 7))
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with instrument(tr, rt), rt.scope(phase="rollout", step=0, sigma=1.0, branch="cond",
                                      samples=[0, 1], txt_lens=[7, 7], img_grid=GRID):
        _forward(tr, x, txt, None, tau)
    attn = [e.kernel for e in rt.trace.entries() if e.op == "joint_attention_fused"]
    assert attn and not any("attn_mask=none" in k for k in attn)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def runs(load, tmp_path_factory):
    """Rollouts of the tiny fixture through diffusers and xfuser in fp32 and bf16, with
    sequential CFG: one sample (no prompt is padded: no text mask) and two samples of different
    prompt lengths (the shorter prompt padded and masked)."""
    from drifttool.adapters.diffusers_qwenimage import run_diffusers
    from drifttool.adapters.xfuser_qwenimage import run_xfuser

    out = tmp_path_factory.mktemp("xfuser")
    for dtype, torch_dtype in DTYPES.items():
        for name, samples in (("one", [0]), ("two", [0, 1])):
            spec = RunSpec(dtype=dtype, cfg_layout="sequential", samples=samples)
            run_diffusers(spec, out / f"diffusers-{name}-{dtype}",
                          transformer=load("diffusers", torch_dtype))
            run_xfuser(spec, out / f"xfuser-{name}-{dtype}", transformer=load("xfuser", torch_dtype))
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_without_a_text_mask_xfuser_records_are_identical_to_diffusers(runs, dtype):
    a, b = open_run(runs / f"diffusers-one-{dtype}"), open_run(runs / f"xfuser-one-{dtype}")
    rep = diff_runs(a, b)
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].matched > 500 and rep.counts["ops"].only_a == rep.counts["ops"].only_b == 0
    assert b.manifest["model_source"]["implementation"] == "xfuser.xFuserQwenImageTransformerWrapper"
    assert b.manifest["fingerprint"] == a.manifest["fingerprint"]
    attn = [r for r in b.trace_rows() if r["op"] == "joint_attention_fused"]
    assert attn and all(r["actual"] == "xfuser" and "torch.sdpa:" in r["kernel"] for r in attn)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_with_padded_prompts_the_first_drift_is_the_attention_of_block_0(runs, dtype):
    a, b = runs / f"diffusers-two-{dtype}", runs / f"xfuser-two-{dtype}"
    rep = diff_runs(open_run(a), open_run(b))
    assert rep.verdict is Verdict.DRIFT
    fd = rep.first_drift
    assert (fd.kind, fd.op, fd.step, fd.block, fd.branch, fd.origin) == \
        ("op", "joint_attention_fused", 0, 0, "cond", True), fd
    if dtype == "bfloat16":
        return
    cli = subprocess.run([sys.executable, "-m", "drifttool", "diff", str(a), str(b)],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert cli.returncode == 1, cli.stderr
    assert "first drift at rollout step 0 cond block 0 joint joint_attention_fused" in cli.stdout


def test_handing_the_mask_to_usp_removes_the_drift(load, monkeypatch, tmp_path):
    """The counterfactual: xfuser's processor patched to hand the joint mask it is given on to
    ``USP`` (as the SDPA backend's ``attn_mask``) makes the padded rollout identical to diffusers':
    the dropped mask is the whole difference."""
    from drifttool.adapters.diffusers_qwenimage import run_diffusers
    from drifttool.adapters.xfuser_cpu import transformer_module
    from drifttool.adapters.xfuser_qwenimage import run_xfuser

    mod = transformer_module()
    usp, call = mod.USP, mod.xFuserQwenDoubleStreamAttnProcessor.__call__

    def with_mask(self, attn, hidden_states, encoder_hidden_states=None,
                  encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        def masked_usp(*args, **kwargs):
            if attention_mask is not None:
                kwargs["attention_kwargs"] = {"attn_mask": attention_mask[:, None, None, :]}
            return usp(*args, **kwargs)

        monkeypatch.setattr(mod, "USP", masked_usp)
        try:
            return call(self, attn, hidden_states, encoder_hidden_states,
                        encoder_hidden_states_mask, attention_mask, image_rotary_emb)
        finally:
            monkeypatch.setattr(mod, "USP", usp)

    monkeypatch.setattr(mod.xFuserQwenDoubleStreamAttnProcessor, "__call__", with_mask)
    spec = RunSpec(dtype="float32", cfg_layout="sequential", samples=[0, 1])
    run_diffusers(spec, tmp_path / "d", transformer=load("diffusers", torch.float32))
    run_xfuser(spec, tmp_path / "x", transformer=load("xfuser", torch.float32))
    rep = diff_runs(open_run(tmp_path / "d"), open_run(tmp_path / "x"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].matched > 1000 and rep.counts["ops"].only_a == rep.counts["ops"].only_b == 0


def test_the_padded_prompt_is_attended_and_the_output_moves_far(load):
    """On the fixture's own padded prompts: the sample with the longest prompt (no padding) is
    bitwise equal; the padded one moves far beyond rounding, exactly as diffusers moves when it
    is not given the mask (the padded text tokens are attended)."""
    dt, xt = load("diffusers", torch.float32), load("xfuser", torch.float32)
    fx, s = resolve(RunSpec(dtype="float32", samples=[0, 1]))
    from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage

    inputs, _ = s.inputs(fx, DiffusersQwenImage(dt).config)
    mask = inputs.txt_mask
    assert mask is not None and not bool(mask.all())
    full = int(mask.all(dim=1).nonzero()[0])  # the row with the longest prompt
    padded = 1 - full
    tau = torch.tensor([1.0, 1.0])
    args = (inputs.x0, inputs.txt, mask, tau, tuple(inputs.img_grid))
    v_d, v_x = _forward(dt, *args), _forward(xt, *args)
    v_unmasked = _forward(dt, inputs.x0, inputs.txt, None, tau, tuple(inputs.img_grid))
    assert torch.equal(_bits(v_x[full]), _bits(v_d[full]))
    delta = (v_x[padded] - v_d[padded]).abs().max().item()
    scale = v_d[padded].abs().max().item()
    assert delta > 1e-2 * scale, (delta, scale)  # fp32 rounding: ~1e-7 of the scale
    assert torch.equal(_bits(v_x), _bits(v_unmasked))


def test_garbage_in_the_masked_prompt_rows_moves_xfuser_only(load):
    """The peer matrix's ``pad_garbage`` invariant (finite garbage in the masked prompt rows):
    diffusers' output bytes do not move (masked keys get weight exactly 0); xfuser's do, in the
    padded sample only."""
    dt, xt = load("diffusers", torch.float32), load("xfuser", torch.float32)
    x, txt, mask, tau = _inputs(8, batch=2, L=9, lens=(9, 5))
    g = torch.Generator().manual_seed(10_386)
    garbage = txt.clone()
    garbage[~mask] = 100 * torch.randn(int((~mask).sum()), txt.shape[-1], generator=g)
    d0, d1 = _forward(dt, x, txt, mask, tau), _forward(dt, x, garbage, mask, tau)
    x0, x1 = _forward(xt, x, txt, mask, tau), _forward(xt, x, garbage, mask, tau)
    assert torch.equal(_bits(d0), _bits(d1))
    assert torch.equal(_bits(x0[0]), _bits(x1[0]))  # the unpadded prompt
    assert (x0[1] - x1[1]).abs().max() > 1e-2 * x0[1].abs().max()


def test_refuses_other_versions_models_and_parallel_degrees(load, monkeypatch):
    import importlib.metadata

    from drifttool.adapters import xfuser_cpu
    from drifttool.adapters.xfuser_qwenimage import instrument

    tr = load("xfuser", torch.float32)
    rt = Runtime(mode="auto")
    with pytest.raises(DriftToolError, match="expected xfuser's"):
        with instrument(load("diffusers", torch.float32), rt):
            pass
    with instrument(tr, rt):
        with pytest.raises(DriftToolError, match="another capture of xfuser's attention"):
            with instrument(tr, rt):
                pass
    with pytest.raises(UnsupportedConfigError, match="ulysses_degree=2 is not supported"):
        xfuser_cpu.cpu_runtime(ulysses_degree=2)
    with pytest.raises(UnsupportedConfigError, match="classifier_free_guidance_degree=2"):
        xfuser_cpu.refuse_parallel(classifier_free_guidance_degree=2)
    monkeypatch.setattr(xfuser_cpu, "world_sizes", lambda: {"sequence": 2, "cfg": 1})
    import drifttool.adapters.xfuser_qwenimage as XQ

    monkeypatch.setattr(XQ, "world_sizes", xfuser_cpu.world_sizes)
    with pytest.raises(UnsupportedConfigError, match=r"sequence parallelism \(world size 2\)"):
        with instrument(tr, rt):
            pass
    monkeypatch.undo()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.7.1" if name == "xfuser" else real(name))
    with pytest.raises(DriftToolError) as e:
        with instrument(tr, rt):
            pass
    assert str(e.value) == "xfuser 0.7.1 is not supported by the capture adapter (supported: 0.7.0)"
    monkeypatch.undo()
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.40.0")  # one the diffusers adapter takes
    with pytest.raises(DriftToolError, match="runs with diffusers 0.42.x, not 0.40.0"):
        with instrument(tr, rt):
            pass


def test_an_attention_that_bypasses_the_registry_is_an_error(load, monkeypatch):
    """A processor that dispatches attention elsewhere must not read as silence."""
    import torch.nn.functional as F

    from drifttool.adapters.xfuser_cpu import transformer_module
    from drifttool.adapters.xfuser_qwenimage import instrument

    mod = transformer_module()

    def usp_elsewhere(q, k, v, dropout_p=0.0, is_causal=False, **kwargs):
        return F.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(mod, "USP", usp_elsewhere)
    tr = load("xfuser", torch.float32)
    x, txt, mask, tau = _inputs(3)
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with pytest.raises(DriftToolError, match="2 of 2 attention calls did not reach"):
        with instrument(tr, rt), rt.scope(phase="rollout", step=0, sigma=1.0, branch="cond",
                                          samples=[0, 1, 2], txt_lens=[7, 4, 2], img_grid=GRID):
            _forward(tr, x, txt, mask, tau)


def test_a_capture_point_that_never_fires_is_an_error(load):
    """A runtime that computes an operator in a module the table does not name (here the text MLP's
    down projection of block 1 replaced) must not read as silence."""
    from drifttool.adapters.xfuser_qwenimage import instrument

    tr = load("xfuser", torch.float32)
    blk = tr.transformer_blocks[1]
    original = blk.txt_mlp.net[2]
    x, txt, mask, tau = _inputs(19)
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with pytest.raises(DriftToolError, match=r"transformer_blocks.1.txt_mlp.net.2 \(mlp_down_gemm, "
                                             r"txt\) never ran") as e:
        with instrument(tr, rt), rt.scope(phase="rollout", step=0, sigma=1.0, branch="cond",
                                          samples=[0, 1, 2], txt_lens=[7, 4, 2], img_grid=GRID):
            blk.txt_mlp.net[2] = torch.nn.Linear(original.in_features, original.out_features)
            try:
                _forward(tr, x, txt, mask, tau)
            finally:
                blk.txt_mlp.net[2] = original
    assert "\n" not in str(e.value)
    assert not [n for n, m in tr.named_modules() if m._forward_hooks or m._forward_pre_hooks]
