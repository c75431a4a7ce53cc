"""The table of taps (``drifttool.adapters.taps``), ``ops.sink.record_external`` and the
diffusers attention capture backend (``drifttool.adapters.diffusers_attention``)."""

from __future__ import annotations

import pytest
import torch

from drifttool.adapters.taps import AFTER, BEFORE, Tap, tap_modules
from drifttool.capture.recorder import Recorder
from drifttool.ops.sink import record_external
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runtime import Runtime

SCOPE = dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=[0, 1], txt_lens=[3, 2],
             img_grid=(2, 3))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(8, 8) for _ in range(3))
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, *, scale=1.0):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        return self.norm(q + k + v) * scale, x


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.embed(x)  # [B, 6, 8]
        for blk in self.blocks:
            h, _ = blk(h, scale=0.5)
        return self.out(h)


TABLE = (
    Tap("embed", "latent_proj_gemm", "img", block=BEFORE),
    Tap(("blocks.*.to_q", "blocks.*.to_k", "blocks.*.to_v"), "qkv_bias_gemm", "img", "BS..",
        heads=True, note=" (q, k, v)"),
    Tap("blocks.*.norm", "adaln_gate_residual", "img", read="input"),
    Tap("blocks.*", "adaln_gate_residual", "img", item=1, note=" (output)"),
    Tap("out", "latent_proj_gemm", "img", block=AFTER),
)


def _run(model, table=TABLE, level="L1"):
    rt = Runtime(mode="auto", recorder=Recorder(level))
    with torch.no_grad(), tap_modules(model, table, rt, actual="toy", depth=2, head_dim=4), \
            rt.scope(**SCOPE):
        model(torch.randn(2, 6, 4))
    rt.recorder.flush()
    return rt


def test_a_table_becomes_hooks_that_record_in_program_order():
    torch.manual_seed(0)
    model = _Model()
    rt = _run(model)
    rows = [(r["block"], r["op"], r["call"], r["index"], r["op_pos"], tuple(r["shape"]))
            for r in rt.recorder.ops_table().to_pylist() if r["sample"] == 0]
    assert rows == [
        (-1, "latent_proj_gemm", 0, 0, 0, (6, 8)),
        *[row for b in (0, 1) for row in (
            (b, "qkv_bias_gemm", 0, 0, 0, (6, 2, 4)),  # [S, H, Dh]: heads split
            (b, "qkv_bias_gemm", 0, 1, 0, (6, 2, 4)),
            (b, "qkv_bias_gemm", 0, 2, 0, (6, 2, 4)),
            (b, "adaln_gate_residual", 0, 0, 1, (6, 8)),
            (b, "adaln_gate_residual", 1, 0, 2, (6, 8)))],
        (2, "latent_proj_gemm", 0, 0, 0, (6, 4)),
    ]
    kernels = {(e.block, e.op, e.call): e.kernel for e in rt.trace.entries()}
    assert kernels[(0, "qkv_bias_gemm", 0)] == "toy:blocks.0.to_v (q, k, v)"
    assert kernels[(1, "adaln_gate_residual", 0)] == "toy:blocks.1.norm (input)"
    assert kernels[(1, "adaln_gate_residual", 1)] == "toy:blocks.1 (output)"
    assert all(e.actual == "toy" and e.requested == "production" for e in rt.trace.entries())
    assert not [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


class _KeywordModel(_Model):
    """The same model, its blocks called with ``x`` as a keyword."""

    def forward(self, x):
        h = self.embed(x)
        for blk in self.blocks:
            h, _ = blk(x=h, scale=0.5)
        return self.out(h)


def test_an_input_tap_reads_a_keyword_or_positional_argument():
    model = _Model()
    keyword = _KeywordModel()
    keyword.load_state_dict(model.state_dict())
    by_name = (Tap("blocks.*", "adaln_modulation", "img", read="input", item="x"),)
    by_pos = (Tap("blocks.*", "adaln_modulation", "img", read="input"),)

    def digests(m, table):
        torch.manual_seed(1)  # the same input for every run
        return [r["digest"] for r in _run(m, table).recorder.ops_table().to_pylist()]

    positional = digests(model, by_name)  # x passed by position, the tap names it
    assert len(positional) == 4 and len(set(positional)) == 4  # 2 blocks x 2 samples, all distinct
    assert digests(model, by_pos) == positional  # the first positional argument
    assert digests(keyword, by_name) == positional  # x passed as a keyword, read by its name


@pytest.mark.parametrize("tap,error,match", [
    (Tap("blocks.*.nothing", "qk_rmsnorm", "img"), DriftToolError, "matches no module"),
    (Tap("embed", "qk_rmsnorm", "img"), DriftToolError, "no block index"),
    (Tap("embed", "no_such_operator", "img", block=BEFORE), UnsupportedConfigError, "unknown operator"),
    (Tap("blocks.*.to_q", "qkv_bias_gemm", "img", heads=True), DriftToolError, "head_dim"),
])
def test_a_bad_tap_is_refused_and_leaves_no_hooks(tap, error, match):
    model = _Model()
    rt = Runtime(mode="auto")
    with pytest.raises(error, match=match):
        with tap_modules(model, (TABLE[0], tap), rt, actual="toy", depth=2):
            pass
    assert not [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


class _Plan:
    """A parallel plan that records nothing on this rank, and remembers the block in scope."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def for_capture(self, rt, site, out, layouts, keep_rows):
        self.blocks.append(rt.scope_value("block"))
        return None


def test_record_external_traces_and_leaves_the_records_to_the_plan():
    plan = _Plan()
    rt = Runtime(mode="auto", recorder=Recorder("L1"), plan=plan)
    t = torch.randn(2, 6, 8)
    with rt.scope(**SCOPE):
        site = record_external(rt, "mlp_down_gemm", "img", t, "BS.", contract="c", actual="ext",
                               kernel="ext:mlp", block=4)
    rt.recorder.flush()
    assert (site["block"], site["call"], site["op_pos"]) == (4, 0, 0)
    assert plan.blocks == [4]  # the call's block is in scope while the plan decides
    assert rt.recorder.ops_table().num_rows == 0
    [e] = rt.trace.entries()
    assert (e.op, e.block, e.contract, e.actual, e.kernel, e.fallback) == (
        "mlp_down_gemm", 4, "c", "ext", "ext:mlp", False)


# -- the diffusers attention capture backend -------------------------------------------------------
def _forward(tr):
    g = torch.Generator().manual_seed(0)
    x, txt = torch.randn(2, 6, 64, generator=g), torch.randn(2, 3, 32, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    with torch.no_grad():
        return tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                  timestep=torch.tensor([0.5, 0.5]), img_shapes=[(1, 2, 3)] * 2,
                  return_dict=False)[0]


def _attention_records(tr):
    from drifttool.adapters.diffusers_qwenimage import instrument

    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with instrument(tr, rt), rt.scope(**SCOPE):
        out = _forward(tr)
    rt.recorder.flush()
    rows = [r for r in rt.recorder.ops_table().to_pylist()
            if r["op"] in ("joint_attention_fused", "multi_axis_rope")]
    kernels = {e.kernel for e in rt.trace.entries() if e.op == "joint_attention_fused"}
    return out, [(r["block"], r["op"], r["stream"], r["call"], r["digest"]) for r in rows], kernels


def _rope(records):
    """Block 0's RoPE records: before the first attention, so the same under any backend."""
    return [r for r in records if r[1] == "multi_axis_rope" and r[0] == 0]


def test_attention_of_a_processor_with_its_own_backend_is_captured_and_restored(random_transformer):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    tr = random_transformer(seed=2)
    _, want, kernels = _attention_records(tr)
    assert len(want) == 2 * 2 * 5 and kernels  # 2 blocks x 2 samples x (4 RoPE + 1 attention)
    before = _AttentionBackendRegistry._active_backend
    tr.set_attention_backend("_native_math")  # every processor's, and the active one
    try:
        active, keys = _AttentionBackendRegistry._active_backend, set(_AttentionBackendRegistry._backends)
        plain = _forward(tr)
        out, got, kernels = _attention_records(tr)
        assert torch.equal(out, plain) and len(got) == len(want) and _rope(got) == _rope(want)
        assert kernels == {"diffusers.attention:_native_math"}
        procs = [m.processor for m in tr.modules() if hasattr(m, "processor")]
        assert all(p._attention_backend is AttentionBackendName._NATIVE_MATH for p in procs)
        assert _AttentionBackendRegistry._active_backend == active
        assert set(_AttentionBackendRegistry._backends) == keys
    finally:
        _AttentionBackendRegistry.set_active_backend(before)


def test_attention_under_the_attention_backend_context_is_captured(random_transformer):
    from diffusers.models.attention_dispatch import attention_backend

    tr = random_transformer(seed=2)
    _, want, _ = _attention_records(tr)
    with attention_backend("_native_math"):
        plain = _forward(tr)
        out, got, kernels = _attention_records(tr)
    assert torch.equal(out, plain) and len(got) == len(want) and _rope(got) == _rope(want)
    assert kernels == {"diffusers.attention:_native_math"}


def test_a_dispatch_the_capture_did_not_begin_runs_unrecorded(random_transformer):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from drifttool.adapters.diffusers_qwenimage import instrument

    tr = random_transformer(seed=2)
    q = torch.randn(1, 5, 2, 8)
    rt = Runtime(mode="auto", recorder=Recorder("L1"))
    with instrument(tr, rt), rt.scope(**SCOPE):
        got = dispatch_attention_fn(q, q, q)  # another model's attention
    assert torch.equal(got, dispatch_attention_fn(q, q, q))
    assert not rt.trace.entries()
