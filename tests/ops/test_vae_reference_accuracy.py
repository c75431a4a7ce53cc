"""Forward accuracy of the VAE operators' strict and production families against their
independent FP64 references (``drifttool.references.vae``).

    $ python -m pytest tests/ops/test_vae_reference_accuracy.py -q
    $ python -m tests.ops.test_vae_reference_accuracy --measure --json stats.json   # re-derive

Criterion and derivation as ``tests/ops/test_reference_accuracy.py`` (|c − r| ≤ atol + rtol·|r|,
c rounded to the activation dtype first; tolerances 4× the excess over one output rounding),
profile ``references/tolerances_vae.json``. Cases: small awkward shapes at batch 1 and 3, and the
real VAE's widths (384 channels) on a few pixels; one two-frame case for the causal padding.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.ops.registry import implementation
from drifttool.ops.specs import VAE_MODEL_OPERATORS
from drifttool.references import vae as ref
from tests.ops.test_reference_accuracy import _up2, assert_within, error_stats, UNIT_ROUNDOFF

REF_SOURCE = Path(ref.__file__)
PROFILE = REF_SOURCE.with_name("tolerances_vae.json")
TOLERANCES = json.loads(PROFILE.read_text())
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("strict", "production")
LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


@dataclass(frozen=True)
class Case:
    """One operator call: ``make(dtype, g)`` → (args, kwargs), every floating input in the case
    dtype; the output is in the case dtype."""

    op: str
    label: str
    make: Callable[[torch.dtype, torch.Generator], tuple[tuple, dict]]

    @property
    def id(self) -> str:
        return f"{self.op}[{self.label}]"


def _rn(g, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=g) * scale + shift


def _conv_w(g, dt, co, ci, *k):
    fan = ci * math.prod(k)
    return _rn(g, co, ci, *k, scale=1 / math.sqrt(fan)).to(dt), _rn(g, co, scale=0.1).to(dt)


def _cases() -> list[Case]:
    C: list[Case] = []

    def conv(b, ci, co, t, h, w, k, p, residual=False):
        def make(dt, g):
            x = _rn(g, b, ci, t, h, w).to(dt)
            args = (x, *_conv_w(g, dt, co, ci, *k))
            kw = {"padding": p}
            if residual:
                kw["residual"] = _rn(g, b, co, t, h, w).to(dt)
            return args, kw
        return make

    C.append(Case("vae_causal_conv3d", "b3_c8to16_k3_7x5", conv(3, 8, 16, 1, 7, 5, (3, 3, 3), 1)))
    C.append(Case("vae_causal_conv3d", "b1_c16_k3_residual", conv(1, 16, 16, 1, 6, 4, (3, 3, 3), 1, True)))
    C.append(Case("vae_causal_conv3d", "b2_c16to32_k1", conv(2, 16, 32, 1, 5, 3, (1, 1, 1), 0)))
    C.append(Case("vae_causal_conv3d", "b1_c8_t2_k3", conv(1, 8, 8, 2, 4, 4, (3, 3, 3), 1)))
    C.append(Case("vae_causal_conv3d", "real_c384_k3_4x4", conv(1, 384, 384, 1, 4, 4, (3, 3, 3), 1)))

    def norm(b, c, h, w, silu):
        def make(dt, g):
            return (_rn(g, b, c, 1, h, w, scale=2.0, shift=0.3).to(dt),
                    _rn(g, c, 1, 1, 1, scale=0.3, shift=1.0).to(dt)), {"silu": silu}
        return make

    C.append(Case("vae_rms_norm", "b3_c16_silu", norm(3, 16, 5, 7, True)))
    C.append(Case("vae_rms_norm", "b1_c8", norm(1, 8, 4, 4, False)))
    C.append(Case("vae_rms_norm", "real_c384_silu_16x16", norm(1, 384, 16, 16, True)))

    def resample(b, c, h, w, mode):
        co = c // 2 if mode == "upsample" else c
        def make(dt, g):
            return (_rn(g, b, c, 1, h, w).to(dt), *_conv_w(g, dt, co, c, 3, 3)), {"mode": mode}
        return make

    C.append(Case("vae_resample", "up_b3_c16_3x5", resample(3, 16, 3, 5, "upsample")))
    C.append(Case("vae_resample", "down_b3_c8_7x6", resample(3, 8, 7, 6, "downsample")))
    C.append(Case("vae_resample", "real_up_c384_4x4", resample(1, 384, 4, 4, "upsample")))
    C.append(Case("vae_resample", "real_down_c384_8x8", resample(1, 384, 8, 8, "downsample")))

    def attn(b, c, h, w):
        def make(dt, g):
            x = _rn(g, b, c, 1, h, w).to(dt)
            gamma = _rn(g, c, 1, 1, scale=0.3, shift=1.0).to(dt)
            wq, bq = _conv_w(g, dt, 3 * c, c, 1, 1)
            wp, bp = _conv_w(g, dt, c, c, 1, 1)
            return (x, gamma, wq, bq, wp, bp), {}
        return make

    C.append(Case("vae_mid_attention", "b3_c16_3x5", attn(3, 16, 3, 5)))
    C.append(Case("vae_mid_attention", "real_c384_9x9", attn(1, 384, 9, 9)))

    def latent(b, h, w, inverse):
        def make(dt, g):
            z = _rn(g, b, 16, 1, h, w, scale=2.0).to(dt)
            return (z, torch.tensor(LATENTS_MEAN), torch.tensor(LATENTS_STD)), {"inverse": inverse}
        return make

    C.append(Case("vae_latent_normalize", "fwd_b3_3x5", latent(3, 3, 5, False)))
    C.append(Case("vae_latent_normalize", "inv_b3_3x5", latent(3, 3, 5, True)))
    C.append(Case("vae_latent_normalize", "real_fwd_128x128", latent(1, 128, 128, False)))
    C.append(Case("vae_latent_normalize", "real_inv_128x128", latent(1, 128, 128, True)))
    return C


CASES = _cases()


def _seed(case: Case) -> int:
    return sum(ord(ch) * (i + 1) for i, ch in enumerate(case.id)) % (2**31)


def run_case(case: Case, family: str, dtype_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the family's output on the CPU, the FP64 reference) of one case."""
    args, kwargs = case.make(DTYPES[dtype_name], torch.Generator().manual_seed(_seed(case)))
    c = implementation(case.op, family)(*args, **kwargs)
    return c, ref.OPS[case.op](*args, **kwargs)


@pytest.mark.parametrize("family", BACKENDS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_matches_reference(case: Case, dtype_name: str, family: str):
    c, r = run_case(case, family, dtype_name)
    assert c.dtype == DTYPES[dtype_name], f"{case.id}: output dtype {c.dtype}"
    tol = TOLERANCES["ops"][case.op][family][dtype_name]
    assert_within(c, r, tol["atol"], tol["rtol"], f"{case.id} {family} {dtype_name}")


def test_every_vae_operator_has_a_reference_cases_and_tolerances():
    assert set(ref.OPS) == set(VAE_MODEL_OPERATORS)  # vae_image_resize: tests/ops/test_vae_image_resize.py
    assert TOLERANCES["profile"] == "drifttool-vae-cpu-v1"
    for op in VAE_MODEL_OPERATORS:
        labels = [c.label for c in CASES if c.op == op]
        assert any("real" in lab for lab in labels) and any("real" not in lab for lab in labels), op
        entry = TOLERANCES["ops"][op]
        assert entry.get("rationale"), op
        for be in BACKENDS:
            for dt in DTYPES:
                assert entry[be][dt]["atol"] >= 0 and entry[be][dt]["rtol"] >= 0, (op, be, dt)


def test_reference_module_imports_nothing_from_drifttool():
    """As ``references/ops.py``: only torch and math, statically and in a fresh interpreter."""
    imported = set()
    for node in ast.walk(ast.parse(REF_SOURCE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0
            imported.add(node.module)
    assert imported <= {"__future__", "math", "torch"}, imported
    code = ("import sys; import drifttool.references.vae; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'drifttool'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert eval(out.stdout.strip()) == ["drifttool", "drifttool.references", "drifttool.references.vae"]


def test_reference_convolution_matches_torch_in_fp64():
    """The tap-sum convolution of the reference against ``F.conv3d`` in FP64 (a check of the
    reference itself: the two agree to FP64 rounding)."""
    g = torch.Generator().manual_seed(3)
    x, w, b = _rn(g, 2, 4, 2, 5, 6).double(), _rn(g, 3, 4, 3, 3, 3).double(), _rn(g, 3).double()
    got = ref.vae_causal_conv3d(x, w, b, padding=1)
    want = torch.nn.functional.conv3d(torch.nn.functional.pad(x, (1, 1, 1, 1, 2, 0)), w, b)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# measurement (python -m tests.ops.test_vae_reference_accuracy --measure [--json FILE])


def measure() -> dict:
    """Per (op, family, dtype): the error statistics, max over the cases, and the tolerance the
    derivation gives (bf16 floored at fp32's excess)."""
    stats: dict = {}
    for case in CASES:
        for dt in DTYPES:
            for be in BACKENDS:
                c, r = run_case(case, be, dt)
                e = stats.setdefault(case.op, {}).setdefault(be, {}).setdefault(dt, {})
                for key, val in error_stats(c, r).items():
                    e[key] = max(e.get(key, 0.0), val)
    derived: dict = {}
    for op, fams in stats.items():
        for be, dts in fams.items():
            for dt, e in dts.items():
                floor = dts["float32"] if dt == "bfloat16" else e
                exa = max(e["excess_abs_small"], floor["excess_abs_small"])
                exr = max(e["excess_rel_large"], floor["excess_rel_large"])
                derived.setdefault(op, {}).setdefault(be, {})[dt] = {
                    "atol": _up2(4 * exa), "rtol": _up2(UNIT_ROUNDOFF[DTYPES[dt]] + 4 * exr), "measured": e}
    return derived


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(2)
    if "--measure" in sys.argv:
        result = measure()
        text = json.dumps(result, indent=1)
        if "--json" in sys.argv:
            Path(sys.argv[sys.argv.index("--json") + 1]).write_text(text)
        print(text)
