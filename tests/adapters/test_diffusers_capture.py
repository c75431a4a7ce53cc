"""The diffusers capture adapter: neutral hooks, drifttool's identities, a diffable rollout."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from drifttool.adapters.diffusers_qwenimage import (
    DiffusersQwenImage, instrument, run_diffusers,
)
from drifttool.artifact.reader import open_run
from drifttool.capture.recorder import Recorder
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import Verdict
from drifttool.errors import DriftToolError
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec

GRID = (4, 6)


def _inputs(seed: int, batch: int = 3, L: int = 7, lens=(7, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, GRID[0] * GRID[1], 64, generator=g)
    txt = torch.randn(batch, L, 32, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]  # [B, L] right padding
    tau = torch.tensor([1.0, 0.5123, 0.02])[:batch]
    return x, txt, mask, tau


def _scope(batch, lens):
    return dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=list(range(batch)),
                txt_lens=list(lens), img_grid=GRID)


def _forward(tr, x, txt, mask, tau):
    with torch.no_grad():
        return tr(hidden_states=x.to(tr.dtype), encoder_hidden_states=txt.to(tr.dtype),
                  encoder_hidden_states_mask=mask, timestep=tau,
                  img_shapes=[(1, *GRID)] * x.shape[0], return_dict=False)[0]


def _hooked_modules(tr):
    return [n for n, m in tr.named_modules() if m._forward_hooks or m._forward_pre_hooks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hooks_change_no_output_bytes(random_transformer, dtype):
    import diffusers.models.transformers.transformer_qwenimage as T

    tr = random_transformer(seed=1, dtype=dtype)
    x, txt, mask, tau = _inputs(1)
    plain = _forward(tr, x, txt, mask, tau)
    rt = Runtime(mode="auto", recorder=Recorder("L2"))
    funcs = (T.apply_rotary_emb_qwen, T.dispatch_attention_fn)
    with instrument(tr, rt), rt.scope(**_scope(3, (7, 4, 2))):
        hooked = _forward(tr, x, txt, mask, tau)
        assert _hooked_modules(tr)
    after = _forward(tr, x, txt, mask, tau)
    for out in (hooked, after):
        assert out.dtype == plain.dtype and torch.equal(
            out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            plain.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert not _hooked_modules(tr)  # every hook removed
    assert (T.apply_rotary_emb_qwen, T.dispatch_attention_fn) == funcs  # functions restored
    rt.recorder.flush()
    assert rt.recorder.ops_table().num_rows > 0


def test_records_match_drifttool_production_forward(random_transformer, tmp_path):
    """Same weights, same inputs: every hooked record has drifttool's identity and, in bf16,
    its digest (the production backend is byte-equal to diffusers)."""
    from drifttool.model.checkpoint import load_checkpoint

    tr32 = random_transformer(seed=2)
    tr32.save_pretrained(tmp_path / "tr")
    tr = tr32.to(torch.bfloat16)
    ours = load_checkpoint(tmp_path / "tr", dtype=torch.bfloat16)
    x, txt, mask, tau = _inputs(2)
    sc = _scope(3, (7, 4, 2))

    rt_d = Runtime(mode="auto", recorder=Recorder("L2"))
    with instrument(tr, rt_d), rt_d.scope(**sc):
        v_d = _forward(tr, x, txt, mask, tau)
    rt_o = Runtime(mode="auto", recorder=Recorder("L2"))
    with torch.no_grad(), rt_o.scope(**sc):
        v_o = ours(x.to(torch.bfloat16), txt.to(torch.bfloat16), mask, tau, GRID, rt_o)
    assert torch.equal(v_d, v_o)
    for rt in (rt_d, rt_o):
        rt.recorder.flush()
    key = ("block", "stream", "op", "call", "index", "sample", "branch")

    def records(rt):
        t = rt.recorder.ops_table().to_pylist()
        return {tuple(r[k] for k in key): (r["digest"], r["row_digests"]) for r in t}

    rd, ro = records(rt_d), records(rt_o)
    assert set(rd) == set(ro)
    assert rd == ro
    sites = lambda rt: {(e.op, e.block, e.stream, e.call) for e in rt.trace.entries()}  # noqa: E731
    assert sites(rt_d) == sites(rt_o)
    kernels = {e.kernel for e in rt_d.trace.entries() if e.op == "joint_attention_fused"}
    assert all(k.startswith("diffusers.attention:native/torch.sdpa:") for k in kernels)
    assert not any(k.endswith("unknown") for k in kernels)


@pytest.fixture(scope="module")
def fixture_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter")
    run_diffusers(RunSpec(), out / "diffusers")
    execute(RunSpec(mode="auto"), out / "auto")
    execute(RunSpec(), out / "strict")
    return out


def test_diffusers_rollout_equals_drifttool_auto(fixture_runs):
    rep = diff_runs(open_run(fixture_runs / "auto"), open_run(fixture_runs / "diffusers"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].matched > 1000 and rep.counts["ops"].only_b == 0
    run = open_run(fixture_runs / "diffusers")
    assert run.manifest["model_source"]["implementation"] == "diffusers.QwenImageTransformer2DModel"
    assert run.manifest["fingerprint"] == {**open_run(fixture_runs / "auto").manifest["fingerprint"]}
    attn = [r for r in run.trace_rows() if r["op"] == "joint_attention_fused"]
    assert attn and all("torch.sdpa:" in r["kernel"] and r["actual"] == "diffusers" for r in attn)


def test_diffusers_rollout_against_strict_names_the_first_drifting_operator(fixture_runs):
    rep = diff_runs(open_run(fixture_runs / "strict"), open_run(fixture_runs / "diffusers"))
    assert rep.verdict is Verdict.DRIFT
    fd = rep.first_drift
    assert (fd.kind, fd.op, fd.step, fd.block, fd.origin) == ("op", "timestep_embed_mlp", 0, -1, True)


def test_model_wrapper_reports_the_checkpoint_names(random_transformer):
    tr = random_transformer(seed=3)
    m = DiffusersQwenImage(tr)
    assert dict(m.named_parameters()).keys() == dict(tr.named_parameters()).keys()
    assert m.config.num_layers == 2 and m.dtype == torch.float32


def test_instrument_refuses_other_models():
    with pytest.raises(DriftToolError, match="QwenImageTransformer2DModel"):
        with instrument(torch.nn.Linear(2, 2), Runtime(mode="auto")):
            pass


def test_adapter_imports_diffusers_lazily():
    code = ("import sys; import drifttool.adapters.diffusers_qwenimage, drifttool.runner; "
            "assert 'diffusers' not in sys.modules, 'diffusers imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_transformer_takes_pipeline_folders_and_variants(random_transformer, tmp_path):
    from drifttool.adapters.diffusers_qwenimage import load_transformer

    tr = random_transformer(seed=4)
    tr.save_pretrained(tmp_path / "pipe" / "transformer", variant="fp16")
    (tmp_path / "pipe" / "model_index.json").write_text('{"transformer": ["diffusers", "QwenImageTransformer2DModel"]}')
    loaded = load_transformer(tmp_path / "pipe", torch.float32, variant="fp16")
    got, want = loaded.state_dict(), tr.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_rope_is_recorded_under_the_installed_diffusers_dispatch(random_transformer):
    """diffusers 0.42 calls ``apply_rotary_emb_qwen``; 0.40 (vllm-omni's pin) picks the function
    from ``ROPE_PER_DEVICE``: either way four RoPE outputs per block, named by what ran."""
    import diffusers

    tr = random_transformer(seed=5)
    x, txt, mask, tau = _inputs(5)
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with instrument(tr, rt), rt.scope(**_scope(3, (7, 4, 2))):
        _forward(tr, x, txt, mask, tau)
    rope = [e for e in rt.trace.entries() if e.op == "multi_axis_rope"]
    assert len(rope) == 4 * len(tr.transformer_blocks)
    want = ("diffusers:ROPE_PER_DEVICE['cuda'] (apply_rotary_emb_qwen, use_real=False)"
            if diffusers.__version__.startswith("0.40.") else "diffusers:apply_rotary_emb_qwen")
    assert {e.kernel for e in rope} == {want}


def test_an_unsupported_diffusers_version_is_refused_in_one_line(random_transformer, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.41.2")
    with pytest.raises(DriftToolError) as e:
        with instrument(random_transformer(), Runtime(mode="auto")):
            pass
    assert str(e.value) == ("diffusers 0.41.2 is not supported by the capture adapter "
                            "(supported: 0.40.x, 0.42.x)")


def test_a_tap_that_never_fires_is_an_error(random_transformer):
    tr = random_transformer(seed=6)
    x, txt, mask, tau = _inputs(6)
    blk = tr.transformer_blocks[1]
    original = blk.img_mlp.net[2]
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with pytest.raises(DriftToolError, match=r"transformer_blocks.1.img_mlp.net.2 .* never ran"):
        with instrument(tr, rt), rt.scope(**_scope(3, (7, 4, 2))):
            blk.img_mlp.net[2] = torch.nn.Linear(original.in_features, original.out_features)
            try:
                _forward(tr, x, txt, mask, tau)
            finally:
                blk.img_mlp.net[2] = original
