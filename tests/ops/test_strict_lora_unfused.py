"""The strict CPU block GEMMs with an unfused FP32 LoRA branch (``lora=``, LoRA mode
``unfused-fp32``; ``drifttool.ops.strict.lora_linear``), raw bytes on fresh random inputs.

- B = 0 (peft's init): y, dx, dW and db are the bytes of the operator without ``lora``;
- a sample's y and dx bytes do not depend on its batch companions, its position or the batch
  size (1, 2, 3, 4); dA and dB of a batch are the pairwise tree of the per-sample gradients, so
  aligned micro-batches combined by the tree give the batch's bytes;
- against the FP64 reference (``references/ops.py``, ``lora=``) within the operator's tolerance
  profile (forward and backward, references/tolerances.json);
- bf16 or misfit factors are refused by the declared constraint; an audit run falls back to
  production's form of the same branch.

Shapes: odd token counts (7, 13), the exact kernel (N·K ≤ 65536) and the tiled one, ranks 1 and 5.
"""

from __future__ import annotations

import math

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call, implementation
from drifttool.ops.strict_trees import tree_sum_stack
from drifttool.references import ops as ref
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes
from tests.ops.test_reference_accuracy import TOLERANCES, assert_within

ONE = ("attn_out_bias_gemm", "mlp_up_gemm_gelu", "mlp_down_gemm")
OPS = ("qkv_bias_gemm", *ONE)
GEOMETRY = {"exact": (48, 96), "tiled": (200, 400)}  # (K, N): N·K ≤ 65536 → exact products, else tiled
HEADS = 2


def _rn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


class Setup:
    """One operator's weights and FP32 factors (A ~ U(±1/√K) as peft, B ~ N(0, 0.05²) or 0)."""

    def __init__(self, op: str, geometry: str, dtype: torch.dtype, rank: int, g: torch.Generator,
                 zero_b: bool = False, skip: int | None = None):
        k, n = GEOMETRY[geometry]
        if op == "qkv_bias_gemm":
            n = k  # q, k, v [d, d]
        self.op, self.k, self.dtype = op, k, dtype
        count = 3 if op == "qkv_bias_gemm" else 1
        self.weights = []
        for _ in range(count):
            self.weights += [_rn(g, n, k, scale=1 / math.sqrt(k)).to(dtype), _rn(g, n, scale=0.1).to(dtype)]
        self.factors = []
        for i in range(count):
            a = (torch.rand(rank, k, generator=g) * 2 - 1) / math.sqrt(k)
            b = torch.zeros(n, rank) if zero_b else _rn(g, n, rank, scale=0.05)
            self.factors.append(None if i == skip else (a, b, 1.5 if i else 8 / math.sqrt(rank)))

    def lora(self, factors=None):
        fs = self.factors if factors is None else factors
        return tuple(fs) if self.op == "qkv_bias_gemm" else fs[0]

    def x(self, g, batch, rows):
        return _rn(g, batch, rows, self.k, scale=1.5).to(self.dtype)

    def run(self, x, *, lora=True, grads=True, gy=None):
        """(outputs flattened to [B, S, N·count], {name: gradient}) for x; gradients of x, the
        weights and the factors for the output gradient ``gy`` (default none: forward only)."""
        fn = implementation(self.op, "strict")
        x = x.detach().clone().requires_grad_(grads)
        ws = [w.detach().clone().requires_grad_(grads) for w in self.weights]
        fs = [None if f is None else (f[0].detach().clone().requires_grad_(grads),
                                      f[1].detach().clone().requires_grad_(grads), f[2])
              for f in self.factors]
        extra = (HEADS,) if self.op == "qkv_bias_gemm" else ()
        kw = {"lora": self.lora(fs)} if lora else {}
        y = fn(x, *ws, *extra, **kw)
        y = torch.cat([o.flatten(-2) for o in y], -1) if isinstance(y, tuple) else y
        if gy is None:
            return y.detach(), {}
        leaves = {"x": x, **{f"w{i}": w for i, w in enumerate(ws)}}
        if lora:
            for i, f in enumerate(fs):
                if f is not None:
                    leaves |= {f"A{i}": f[0], f"B{i}": f[1]}
        gs = torch.autograd.grad(y, list(leaves.values()), gy, allow_unused=True)
        return y.detach(), {n: gr for n, gr in zip(leaves, gs)}


def _cases():
    return [pytest.param(op, geometry, id=f"{op}-{geometry}") for op in OPS for geometry in GEOMETRY]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op,geometry", _cases())
def test_zero_b_is_the_operator_without_lora(op, geometry, dtype):
    g = torch.Generator().manual_seed(1)
    s = Setup(op, geometry, dtype, rank=5, g=g, zero_b=True)
    x = s.x(g, 3, 13)
    y0, g0 = s.run(x, lora=False)
    gy = torch.randn(y0.shape, generator=g).to(dtype)
    y0, g0 = s.run(x, lora=False, gy=gy)
    y1, g1 = s.run(x, gy=gy)
    assert_same_bytes(y1, y0, f"{op} y with B = 0")
    for name in g0:
        assert_same_bytes(g1[name], g0[name], f"{op} d{name} with B = 0")
    assert all(g1[n] is not None and g1[n].dtype == torch.float32 for n in g1 if n[0] in "AB")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op,geometry", _cases())
def test_sample_bytes_do_not_depend_on_the_batch(op, geometry, dtype):
    """A sample alone (batch 1) vs at every position of batches of 3 and 4 with random
    companions: the same y and dx bytes; dA, dB (and dW, db) of the batch = tree_sum_stack of the
    per-sample gradients, so aligned micro-batches of 2 combined by the tree give the batch's."""
    g = torch.Generator().manual_seed(2)
    s = Setup(op, geometry, dtype, rank=1 if geometry == "exact" else 5, g=g,
              skip=1 if op == "qkv_bias_gemm" else None)  # q, v adapted, k not
    rows = 7
    for batch in (3, 4):
        x = s.x(g, batch, rows)
        y, _ = s.run(x, grads=False)
        gy = torch.randn(y.shape, generator=g).to(dtype)
        _, full = s.run(x, gy=gy)
        solo = [s.run(x[i : i + 1], gy=gy[i : i + 1]) for i in range(batch)]
        for i, (yi, gi) in enumerate(solo):
            what = f"{op} {geometry} {dtype}: sample {i} of {batch}"
            assert_same_bytes(y[i : i + 1], yi, f"{what}: y")
            assert_same_bytes(full["x"][i : i + 1], gi["x"], f"{what}: dx")
        halves = [s.run(x[a : a + 2], gy=gy[a : a + 2])[1] for a in (0, 2)] if batch == 4 else None
        for name in full:
            if name == "x" or full[name].dtype != torch.float32:  # a bf16 dW is rounded per batch
                continue
            want = tree_sum_stack([gi[name] for _, gi in solo])
            assert_same_bytes(full[name], want, f"{op} {geometry} {dtype} batch {batch}: d{name} vs tree")
            if halves:
                assert_same_bytes(full[name], halves[0][name] + halves[1][name],
                                  f"{op} {geometry} {dtype}: d{name} of 4 vs micro-batches of 2")


def _reference(s: Setup, x, gy):
    """(y, {name: gradient}) of the FP64 reference with the factors as FP64 leaves."""
    leaves = {"x": x.to(torch.float64).requires_grad_(True)}
    ws = []
    for i, w in enumerate(s.weights):
        leaves[f"w{i}"] = w.to(torch.float64).requires_grad_(True)
        ws.append(leaves[f"w{i}"])
    fs = []
    for i, f in enumerate(s.factors):
        if f is None:
            fs.append(None)
            continue
        leaves[f"A{i}"] = f[0].to(torch.float64).requires_grad_(True)
        leaves[f"B{i}"] = f[1].to(torch.float64).requires_grad_(True)
        fs.append((leaves[f"A{i}"], leaves[f"B{i}"], f[2]))
    fn = ref.OPS[s.op]
    extra = (HEADS,) if s.op == "qkv_bias_gemm" else ()
    y = fn(leaves["x"], *ws, *extra, lora=s.lora(fs))
    y = torch.cat([o.flatten(-2) for o in y], -1) if isinstance(y, tuple) else y
    gs = torch.autograd.grad(y, list(leaves.values()), gy.to(torch.float64))
    return y.detach(), dict(zip(leaves, gs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("op,geometry", _cases())
def test_matches_the_fp64_reference(op, geometry, dtype):
    """y and every gradient (x, W, b, A, B) within the operator's strict tolerance profile."""
    g = torch.Generator().manual_seed(3)
    s = Setup(op, geometry, dtype, rank=5, g=g)
    x = s.x(g, 3, 13)
    y, _ = s.run(x, grads=False)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    y, got = s.run(x, gy=gy)
    ry, want = _reference(s, x, gy)
    name = {"float32": "float32", "bfloat16": "bfloat16"}[str(dtype).removeprefix("torch.")]
    fwd = TOLERANCES["ops"][op]["strict"][name]
    assert_within(y, ry, fwd["atol"], fwd["rtol"], f"{op} {geometry} {name} y")
    bwd = TOLERANCES["backward"]["ops"][op]["strict"][name]
    for key in want:
        assert_within(got[key], want[key], bwd["atol"], bwd["rtol"], f"{op} {geometry} {name} d{key}")


def test_the_reference_catches_a_dropped_branch():
    """The judge can fail: the operator without its branch is out of tolerance."""
    g = torch.Generator().manual_seed(4)
    s = Setup("mlp_down_gemm", "exact", torch.float32, rank=5, g=g)
    x = s.x(g, 1, 7)
    y, _ = s.run(x, lora=False, grads=False)
    ry, _ = _reference(s, x, torch.ones_like(y))
    fwd = TOLERANCES["ops"]["mlp_down_gemm"]["strict"]["float32"]
    with pytest.raises(pytest.fail.Exception, match="out of tolerance"):
        assert_within(y, ry, fwd["atol"], fwd["rtol"], "no branch")


@pytest.mark.parametrize("bad,needle", [
    (lambda a, b: (a.bfloat16(), b.bfloat16(), 1.0), "must be float32"),
    (lambda a, b: (a[:, :-1], b, 1.0), "do not fit"),
    (lambda a, b: (a, b, torch.tensor(1.0)), "python float"),
    (lambda a, b: (a, b), "(A, B, scale)"),
])
def test_unsupported_factors_fail_closed(bad, needle):
    g = torch.Generator().manual_seed(5)
    s = Setup("mlp_up_gemm_gelu", "exact", torch.bfloat16, rank=2, g=g)
    a, b, _ = s.factors[0]
    with pytest.raises(UnsupportedConfigError, match="constraint 'lora factors") as e:
        implementation("mlp_up_gemm_gelu", "strict")(s.x(g, 1, 7), *s.weights, lora=bad(a, b))
    assert needle in str(e.value)
    q = Setup("qkv_bias_gemm", "exact", torch.bfloat16, rank=2, g=g)
    with pytest.raises(UnsupportedConfigError, match="tuple of 3 entries"):
        implementation("qkv_bias_gemm", "strict")(q.x(g, 1, 7), *q.weights, HEADS, lora=q.factors[0])


def test_audit_falls_back_to_productions_form_of_the_branch():
    """An audit run whose strict GEMM cannot run falls back to production, which adds the same
    factors as peft does (``ops.lora.add_branch``), and records the fallback."""
    from drifttool.ops.lora import add_branch

    g = torch.Generator().manual_seed(6)
    s = Setup("mlp_down_gemm", "exact", torch.bfloat16, rank=3, g=g)
    x = s.x(g, 2, 7)
    rt = Runtime(mode="audit", unavailable={("mlp_down_gemm", "strict")})
    with torch.no_grad():
        y = call(rt, "mlp_down_gemm", x, *s.weights, lora=s.lora(), stream="img", layout=None)
        want = add_branch(torch.nn.functional.linear(x, *s.weights), x, s.lora())
    assert_same_bytes(y, want, "audit fallback")
    (row,) = [r for r in rt.trace.rows() if r["op"] == "mlp_down_gemm"]
    assert row["actual"] == "production" and row["fallback"]
