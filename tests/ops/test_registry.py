"""Dispatch by (family, device) with declared constraints; fail-closed and audit fallback
(RFC qwenimage_runtime_modes, qwenimage_operator_trace); decomposition of the fused attention."""

import json

import pytest
import torch

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.ops import registry
from drifttool.ops.constraints import Constraint
from drifttool.ops.registry import call, implementation, impls, kernel_id, specs
from drifttool.ops.declaration import OpSpec
from drifttool.ops.specs import OPERATORS, SITES, STREAMS
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec
from tests.conftest import bits

TENSOR_FREE = {"flow_sigma_table"}  # host arithmetic, no tensor arguments: dispatched to the CPU


class Sink:
    """Capture sink at ``level``: keeps (op, layout, tensor) of every capture."""

    def __init__(self, level):
        self.level, self.rows, self.roles = level, [], []

    def capture(self, site, tensor, layout, index=0, role="output"):
        self.rows.append((site["op"], layout, tensor))
        self.roles.append(role)


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry tables, restored after the test (registrations stay local)."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_IMPLS", {k: list(v) for k, v in registry._IMPLS.items()})
    return registry


def _gemm_args(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 8, generator=g).to(dtype)
    w = torch.randn(6, 8, generator=g).to(dtype)
    return x.to(device), w.to(device), None


def test_every_ws1_row_is_declared_as_its_row_says_with_both_families():
    """``specs.OPERATORS`` is the one declaration: each row is an ``OpSpec`` with its contract,
    summary, dtypes and decomposition, and has a strict and a production implementation; its
    streams, sites and layouts are the model's and sampler's own (``test_rows_match_the_call_sites``)."""
    assert OPERATORS and set(OPERATORS) <= set(specs())  # other operators (e.g. lora_merge) too
    for name, row in OPERATORS.items():
        s = specs()[name]
        assert s.contract == row.contract == f"qwenimage.{name}.v{row.version}" and row.version in (1, 2)
        assert (s.summary, s.differentiable, s.dtypes) == (row.summary, row.differentiable, row.dtypes)
        assert (s.decomposition.ops if s.decomposition else ()) == row.decomposition
        assert set(row.streams) <= set(STREAMS) and set(row.sites) <= set(SITES), name
        implementation(name, "strict")
        implementation(name, "production")


def test_rows_match_the_call_sites():
    """Every call the MMDiT forward makes (strict at L2: the attention internals too) is of a
    declared row, at one of its streams and sites, with its layout; every transformer row the
    forward calls is called at each of its streams and sites."""
    from drifttool.model.config import tiny
    from drifttool.model.mmdit import MMDiT, random_init_

    model = random_init_(MMDiT(tiny()), seed=0)
    sink = Sink("L2")
    sites = []

    def capture(site, tensor, layout, index=0, role="output"):
        sites.append((site["op"], site["stream"], site["block"], index, layout))

    sink.capture = capture
    rt = Runtime(mode="strict", recorder=sink)
    g = torch.Generator().manual_seed(0)
    x, txt = torch.randn(1, 24, 64, generator=g), torch.randn(1, 5, 32, generator=g)
    with rt.scope(phase="rollout", step=0, branch="cond", samples=[0], txt_lens=[5], img_grid=(4, 6)):
        model(x, txt, None, torch.tensor([0.5]), (4, 6), rt)
    n = model.config.num_layers
    where = {-1: "inputs", n: "final"}
    seen = {}
    for op, stream, block, index, layout in sites:
        row = OPERATORS[op]
        site = where.get(block, "block")
        assert stream in row.streams and site in row.sites, (op, stream, site)
        assert layout == (row.layout if isinstance(row.layout, str) else row.layout[index]), (op, layout)
        seen.setdefault(op, set()).update({("stream", stream), ("site", site)})
    for op, got in seen.items():
        row = OPERATORS[op]
        assert got == {("stream", s) for s in row.streams} | {("site", s) for s in row.sites}, op
    model_rows = {n for n, r in OPERATORS.items() if r.sites and not r.sampler and r.component == "mmdit"}
    assert set(seen) == model_rows, model_rows ^ set(seen)


def test_production_is_registered_for_cuda_with_device_free_kernel_ids():
    for name in sorted(set(specs()) - TENSOR_FREE):
        cpu, cuda = kernel_id(name, "production", "cpu"), kernel_id(name, "production", "cuda")
        assert cuda is not None and cuda == cpu, name  # the trace records the device separately
        assert impls(name, "production", "cuda")[0].constraints[0].name == "device cuda"
    for name in specs():
        for family in ("strict", "production"):
            k = kernel_id(name, family)
            assert k is None or not k.startswith(("cpu.", "cuda.")), (name, family, k)
        k = kernel_id(name, "strict", "cuda")  # the strict CUDA family (partial until complete)
        assert k is None or not k.startswith(("cpu.", "cuda.")), (name, k)
    # the strict CUDA family keeps its own contract ids
    assert all(i.contract.endswith(".cuda1") for name in specs() for i in impls(name, "strict", "cuda"))


def test_lora_merge_is_declared_by_ops_not_the_model():
    import sys

    assert "lora_merge" in specs()
    assert impls("lora_merge", "strict")[0].fn.__module__ == "drifttool.ops.lora"
    assert impls("lora_merge", "production", "cuda")[0].fn.__module__ == "drifttool.ops.lora"
    assert "drifttool.ops.lora" in sys.modules


def test_dispatch_by_device_records_device_and_kernel(device):
    x, w, b = _gemm_args(device)
    rt = Runtime(mode="auto")
    y = call(rt, "mlp_down_gemm", x, w, b, stream="img")
    assert y.device.type == device
    (entry,) = rt.trace.entries()
    assert (entry.device, entry.actual, entry.kernel) == (device, "production", "torch.nn.functional.linear")
    assert torch.equal(bits(y.cpu()), bits(implementation("mlp_down_gemm", "production", device)(x, w, b).cpu()))


def test_strict_family_fails_closed_on_a_device_it_lacks(device):
    x, w, b = _gemm_args(device)
    rt = Runtime(mode="strict")
    if device == "cpu":
        call(rt, "mlp_down_gemm", x, w, b, stream="img")
        assert rt.trace.entries()[0].kernel == kernel_id("mlp_down_gemm", "strict")
        return
    with pytest.raises(UnsupportedConfigError, match="'mlp_down_gemm'.*'strict'.*'cuda'"):
        call(rt, "mlp_down_gemm", x, w, b, stream="img")


def test_mixed_device_arguments_are_rejected():
    x, w, b = _gemm_args("cpu")
    meta = w.to("meta")  # a second device type without a GPU
    for mode in ("strict", "audit", "auto"):
        with pytest.raises(UnsupportedConfigError, match="mlp_down_gemm.*more than one device.*cpu.*meta"):
            call(Runtime(mode=mode), "mlp_down_gemm", x, meta, b, stream="img")


def test_cpu_scalar_tensors_do_not_decide_the_device():
    from drifttool.ops.registry import call_device

    x = torch.zeros(2, 3, device="meta")
    assert call_device("op", (x, torch.tensor(0.5)), {}) == "meta"
    assert call_device("op", (torch.tensor(0.5),), {}) == "cpu"
    assert call_device("op", (3, 4), {}) == "cpu"  # flow_sigma_table: no tensors


def test_declared_dtype_constraint_fails_closed_naming_it():
    x, w, b = _gemm_args("cpu", torch.float16)
    with pytest.raises(UnsupportedConfigError) as err:
        call(Runtime(mode="strict"), "mlp_down_gemm", x, w, b, stream="img")
    msg = str(err.value)
    for part in ("'mlp_down_gemm'", "family 'strict'", "device 'cpu'", "dtypes float32|bfloat16 of (x, w, b)",
                 "float16", "allows no fallback"):
        assert part in msg, (part, msg)
    # the raw implementation is behind the same declared constraints
    with pytest.raises(UnsupportedConfigError, match="float16"):
        implementation("mlp_down_gemm", "strict")(x, w, b)


def test_declared_geometry_constraint_fails_closed_naming_it():
    q = torch.randn(2, 7, 2, 16)
    bad_mask = torch.ones(2, 6, dtype=torch.bool)  # S is 7
    with pytest.raises(UnsupportedConfigError, match=r"'production'.*key_mask \[B, S\] bool of k.*\[2, 7\]"):
        call(Runtime(mode="auto"), "joint_attention_fused", q, q, q, bad_mask, stream="joint")


def test_strict_mode_fails_closed_on_unavailable_family():
    rt = Runtime(mode="strict", unavailable={("mlp_down_gemm", "strict")})
    with pytest.raises(UnsupportedConfigError, match="mlp_down_gemm.*strict.*unavailable"):
        call(rt, "mlp_down_gemm", *_gemm_args("cpu"))


def test_audit_mode_records_the_fallback():
    rt = Runtime(mode="audit", unavailable={("mlp_down_gemm", "strict")})
    call(rt, "mlp_down_gemm", *_gemm_args("cpu"))
    (entry,) = rt.trace.entries()
    assert entry.requested == "strict" and entry.actual == "production" and entry.fallback
    assert "unavailable" in entry.reason and entry.declared
    rt.trace.check_strict()  # declared (audit) fallbacks are allowed


def test_audit_falls_back_on_a_failed_constraint_and_records_it():
    x, w, b = _gemm_args("cpu", torch.float16)
    rt = Runtime(mode="audit")
    y = call(rt, "mlp_down_gemm", x, w, b, stream="img")
    assert y.dtype == torch.float16
    (entry,) = rt.trace.entries()
    assert entry.actual == "production" and entry.fallback and entry.declared
    assert "dtypes float32|bfloat16" in entry.reason and "float16" in entry.reason


def test_fake_third_family_registers_from_outside(scratch_registry):
    """A family registered by another module (here: this test) is picked by dispatch when the
    mode requests it, on the device it declares, behind its own declared constraints — no edit
    to the model or the registry."""
    seen = []

    def even_rows(args):
        return None if args["x"].shape[1] % 2 == 0 else f"x has {args['x'].shape[1]} rows, not even"

    def scaled(x, w, b=None):
        seen.append(x.shape)
        return torch.nn.functional.linear(x, w, b) * 2

    registry.implements("mlp_down_gemm", "toy", device="cpu", kernel="toy.linear_x2",
                        constraints=(Constraint("even rows", even_rows, ("x",)),))(scaled)
    assert "toy" in registry.families("mlp_down_gemm")
    rt = Runtime(mode="audit", family="toy")  # audit: fall back to production, recorded
    x, w, b = _gemm_args("cpu")
    x4 = torch.randn(3, 4, 8)
    y = call(rt, "mlp_down_gemm", x4, w, b, stream="img")
    assert seen == [x4.shape] and torch.equal(y, torch.nn.functional.linear(x4, w) * 2)
    # constraint fails (5 rows): the fallback family runs and the reason names the constraint
    call(rt, "mlp_down_gemm", x, w, b, stream="img")
    entries = rt.trace.entries()
    assert [(e.actual, e.kernel, e.fallback) for e in entries] == [
        ("toy", "toy.linear_x2", False), ("production", "torch.nn.functional.linear", True)]
    assert "even rows" in entries[1].reason and "5 rows" in entries[1].reason
    assert entries[1].requested == "toy"
    with pytest.raises(UnsupportedConfigError, match="'toy'.*even rows.*allows no fallback"):
        call(Runtime(mode="auto", family="toy"), "mlp_down_gemm", x, w, b, stream="img")


def test_a_later_strict_cuda_family_slots_in(scratch_registry, monkeypatch):
    """Registering ``strict`` for another device needs nothing else: dispatch finds it by the
    call's device. ``meta`` stands in for cuda (allowed as a device type only here)."""
    monkeypatch.setattr(registry, "DEVICES", ("cpu", "cuda", "meta"))
    registry.implements("mlp_down_gemm", "strict", device="meta", kernel="fake.meta_linear")(
        lambda x, w, b=None: torch.empty(x.shape[:-1] + (w.shape[0],), device="meta"))
    rt = Runtime(mode="strict")
    x = torch.empty(2, 3, 8, device="meta")
    y = call(rt, "mlp_down_gemm", x, torch.empty(4, 8, device="meta"), None, stream="img")
    assert y.device.type == "meta"
    (entry,) = rt.trace.entries()
    assert (entry.actual, entry.device, entry.kernel) == ("strict", "meta", "fake.meta_linear")


def test_registration_rejects_undeclared_parameters_and_devices(scratch_registry):
    with pytest.raises(ValueError, match="reads \\['nope'\\]"):
        registry.implements("mlp_down_gemm", "toy", kernel="k",
                            constraints=(Constraint("c", lambda a: None, ("nope",)),))(lambda x, w, b=None: x)
    with pytest.raises(ValueError, match="unknown device"):
        registry.implements("mlp_down_gemm", "toy", device="tpu", kernel="k")
    with pytest.raises(ValueError, match="no decomposition"):
        registry.implements("mlp_down_gemm", "toy", kernel="k", decomposable=True)(lambda x, w, b=None: x)


def _attention_inputs(b=3, s=11, h=2, dh=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, s, h, dh, generator=g).to(dtype) for _ in range(3))
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 2:4] = False  # padded prompt rows of sample 1
    mask[2, 0] = False
    return q, k, v, mask


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_strict_fused_attention_expands_only_when_internals_are_captured(level):
    q, k, v, mask = _attention_inputs()
    sink = Sink(level)
    rt = Runtime(mode="strict", recorder=sink)
    out = call(rt, "joint_attention_fused", q, k, v, mask, stream="joint", layout="BS..")
    ops = [(op, lay) for op, lay, _ in sink.rows]
    traced = [e.op for e in rt.trace.entries()]
    if level == "L2":
        # the internals (role internal), then the fused operator's own record: an L1 run's
        # records are a subset of an L2 run's
        assert ops == [("joint_attn_qk_gemm", "B.SK"), ("joint_attn_softmax", "B.SK"),
                       ("joint_attn_av_gemm", "BS.."), ("joint_attention_fused", "BS..")]
        assert sink.roles == ["internal"] * 3 + ["output"]
        assert traced == ["joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm",
                          "joint_attention_fused"]
        assert torch.equal(bits(sink.rows[2][2]), bits(sink.rows[3][2]))
    else:
        assert ops == [("joint_attention_fused", "BS..")] and traced == ["joint_attention_fused"]
    ref = implementation("joint_attention_fused", "strict")(q, k, v, mask)
    assert torch.equal(bits(out), bits(ref)) and torch.equal(bits(sink.rows[-1][2]), bits(ref))


def test_production_fused_attention_never_expands_and_notes_it_at_l2():
    q, k, v, mask = _attention_inputs()
    sink = Sink("L2")
    rt = Runtime(mode="auto", recorder=sink)
    call(rt, "joint_attention_fused", q, k, v, mask, stream="joint", layout="BS..")
    assert [op for op, _, _ in sink.rows] == ["joint_attention_fused"]
    (entry,) = rt.trace.entries()
    assert not entry.fallback and "not captured" in entry.reason


def test_a_variant_of_a_decomposed_operator_forces_the_expansion():
    q, k, v, mask = _attention_inputs()
    seen = []

    def softmax_variant(scores, key_mask=None, *, text_len=None):
        seen.append(scores.shape)
        return implementation("joint_attn_softmax", "strict")(scores, key_mask, text_len=text_len)

    rt = Runtime(mode="strict", variants={"joint_attn_softmax": ("spy", softmax_variant)})
    call(rt, "joint_attention_fused", q, k, v, mask, stream="joint", layout="BS..")
    assert seen == [(3, 2, 11, 11)]
    assert "variant:spy" in {e.actual for e in rt.trace.entries()}


def test_strict_run_with_planted_unavailable_backend_exits_clean(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="qk_rmsnorm"):
        execute(RunSpec(unavailable=(("qk_rmsnorm", "strict"),)), tmp_path / "s")
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["complete"] is False
    execute(RunSpec(mode="audit", unavailable=(("qk_rmsnorm", "strict"),)), tmp_path / "a")
    from drifttool.artifact.reader import open_run

    rows = [r for r in open_run(tmp_path / "a").trace_rows() if r["op"] == "qk_rmsnorm"]
    assert rows and all(r["fallback"] and r["actual"] == "production" for r in rows)


def test_a_fused_variant_does_not_apply_where_the_family_expands():
    """A probe registers variants for the fused and the finer operators; under strict at L2 the
    fused operator is expanded (it does not run), so only the finer variant applies."""
    q, k, v, mask = _attention_inputs()
    calls = []

    def fused_variant(*a, **kw):
        calls.append("fused")
        return implementation("joint_attention_fused", "production")(*a, **kw)

    def softmax_variant(scores, key_mask=None, *, text_len=None):
        calls.append("softmax")
        return implementation("joint_attn_softmax", "strict")(scores, key_mask, text_len=text_len)

    variants = {"joint_attention_fused": ("f", fused_variant), "joint_attn_softmax": ("s", softmax_variant)}
    call(Runtime(mode="strict", recorder=Sink("L2"), variants=variants), "joint_attention_fused",
         q, k, v, mask, stream="joint", layout="BS..")
    assert calls == ["softmax"]
    calls.clear()
    call(Runtime(mode="auto", recorder=Sink("L2"), variants=variants), "joint_attention_fused",
         q, k, v, mask, stream="joint", layout="BS..")
    assert calls == ["fused"]


def test_operator_specs_name_their_component():
    """Every declared operator belongs to a component (the MMDiT, its sampler included, the text
    encoder: its rows ``te_*``, or the VAE); an unknown component is refused at declaration, so
    Phase B's models declare beside it."""
    from drifttool.components import COMPONENTS
    from drifttool.ops.specs import VAE_OPERATORS, WS1_OPERATORS

    assert all(s.component in COMPONENTS for s in specs().values())
    te = set(specs(component="text_encoder"))
    assert te and all(n.startswith("te_") for n in te)
    assert set(specs(component="vae")) == set(VAE_OPERATORS)
    assert set(specs(component="mmdit")) == set(specs()) - te - set(VAE_OPERATORS)
    assert set(WS1_OPERATORS) <= set(specs(component="mmdit"))
    with pytest.raises(ValueError, match="unknown component 'unet'"):
        registry.declare(OpSpec(name="unet_conv", contract="x.unet_conv.v1",
                                         differentiable=False, dtypes=(torch.float32,),
                                         summary="-", component="unet"))


@pytest.mark.parametrize("level,layout,marked", [("L1", "BS.", True), ("L2", "BS.", True),
                                                  ("L0", "BS.", False), ("L1", None, False),
                                                  (None, "BS.", False)])
def test_a_captured_call_is_marked_for_its_producing_kernels(scratch_registry, level, layout, marked):
    """While a call runs whose outputs the recorder will digest (above L0, a layout, no plan),
    ``capture.produced.wanted()`` is true for its kernels (which may then write the row tables);
    otherwise, and after the call, false."""
    from drifttool.capture import produced

    seen = []

    def linear(x, w, b=None):
        seen.append(produced.wanted())
        return torch.nn.functional.linear(x, w, b)

    registry.implements("mlp_down_gemm", "toy", device="cpu", kernel="toy.linear")(linear)
    rt = Runtime(mode="audit", family="toy", recorder=None if level is None else Sink(level))
    call(rt, "mlp_down_gemm", *_gemm_args("cpu"), stream="img", layout=layout)
    assert seen == [marked] and not produced.wanted()


def test_a_nested_call_that_is_not_captured_clears_the_mark(scratch_registry):
    """A captured call's implementation that calls another operator without capturing it: the
    inner call's kernels see no mark (they would digest outputs nobody reads), the outer call's
    see it again after."""
    from drifttool.capture import produced

    seen = []

    def inner(x, w, b=None):
        seen.append(("inner", produced.wanted()))
        return torch.nn.functional.linear(x, w, b)

    def outer(x, w, b=None):
        seen.append(("outer", produced.wanted()))
        y = call(rt, "mlp_down_gemm", x, w, b, stream="img", layout=None)
        seen.append(("outer", produced.wanted()))
        return y

    registry.implements("mlp_down_gemm", "toy", device="cpu", kernel="toy.inner")(inner)
    registry.implements("attn_out_bias_gemm", "toy", device="cpu", kernel="toy.outer")(outer)
    rt = Runtime(mode="audit", family="toy", recorder=Sink("L1"))
    call(rt, "attn_out_bias_gemm", *_gemm_args("cpu"), stream="img", layout="BS.")
    assert seen == [("outer", True), ("inner", False), ("outer", True)]
