"""The strict CUDA sampler operators' backward (``strict_cuda/sampler.py``; contract
``grad.cuda1``) under Triton's interpreter, on CPU tensors: the Triton forward's outputs feed the
strict CPU family's own gradient formulas, so ``cfg_combine_renorm``'s (dc, du) and
``flow_sde_step_logp``'s (dv, dx) — through mu and logp, η > 0 with sampling or replay, and the
Euler step — must equal strict CPU's bytes, with bf16 and FP32 inputs. On the GPU the same
formulas run as torch CUDA operations: ``tests/gpu/test_strict_cuda_rows.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_same_bytes

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.ops import scheduler
from drifttool.ops.registry import impls
from drifttool.ops.strict_cuda import backward as bw
from drifttool.ops.strict_cuda import sampler as SM

pytest.importorskip("drifttool.ops.strict_cuda.kernels.sampler")


def _g(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _grads(fn, leaves_in, outs_weights, **kw):
    """Gradients of Σ_k ⟨w_k, out_k⟩ w.r.t. the leaves (fresh copies that require grad)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves_in]
    outs = fn(*leaves, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * w).sum() for o, w in zip(outs, outs_weights) if w is not None)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cfg_renorm_grads_equal_strict_cpu_bytes(dtype):
    c, u = _g(1, 3, 11, 64, dtype=dtype), _g(2, 3, 11, 64, dtype=dtype)
    gv = _g(3, 3, 11, 64)
    got = _grads(SM.cfg_combine_renorm, (c, u), (gv,), scale=4.0)
    want = _grads(scheduler.cfg_combine_renorm_strict, (c, u), (gv,), scale=4.0)
    for what, a, b in zip(("dc", "du"), got, want):
        assert a.dtype == dtype
        assert_same_bytes(a, b, f"cfg_combine_renorm {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 300, 7)], ids=["under-one-chunk", "three-chunks"])
def test_sde_step_grads_equal_strict_cpu_bytes(shape, dtype):
    v, x, noise = _g(10, *shape, dtype=dtype), _g(11, *shape, dtype=dtype), _g(12, *shape)
    g_mu, g_logp = _g(13, *shape), _g(14, shape[0])
    sig = scheduler.flow_sigma_table(6, 64)
    for sigma in (sig[0], sig[2]):  # sigma == 1 takes sigma_max
        kw = dict(sigma=sigma, sigma_next=sig[3], eta=1.2, sigma_max=sig[1])
        for extra in (dict(noise=noise), dict(prev_sample=_g(15, *shape))):
            # outputs (x_next, logp, mu, std_t): the loss reads logp and mu
            got = _grads(SM.flow_sde_step_logp, (v, x), (None, g_logp, g_mu), **kw, **extra)
            want = _grads(scheduler.flow_sde_step_logp_strict, (v, x), (None, g_logp, g_mu), **kw, **extra)
            for what, a, b in zip(("dv", "dx"), got, want):
                assert_same_bytes(a, b, f"sde {what}, sigma {float(sigma):.3f}, {sorted(extra)}")
    kw = dict(sigma=sig[2], sigma_next=sig[3], eta=0.0, sigma_max=sig[1])
    got = _grads(SM.flow_sde_step_logp, (v, x), (None, None, g_mu), **kw)
    want = _grads(scheduler.flow_sde_step_logp_strict, (v, x), (None, None, g_mu), **kw)
    for what, a, b in zip(("dv", "dx"), got, want):
        assert_same_bytes(a, b, f"euler {what}")


def test_sde_step_grads_of_a_sample_do_not_depend_on_the_batch():
    v, x, prev = _g(20, 3, 37, 16), _g(21, 3, 37, 16), _g(22, 3, 37, 16)
    g_mu, g_logp = _g(23, 3, 37, 16), _g(24, 3)
    sig = scheduler.flow_sigma_table(6, 64)
    kw = dict(sigma=sig[1], sigma_next=sig[2], eta=1.0, sigma_max=sig[1])
    full = _grads(SM.flow_sde_step_logp, (v, x), (None, g_logp, g_mu), prev_sample=prev, **kw)
    one = _grads(SM.flow_sde_step_logp, (v[1:2], x[1:2]), (None, g_logp[1:2], g_mu[1:2]),
                 prev_sample=prev[1:2], **kw)
    for what, a, b in zip(("dv", "dx"), full, one):
        assert_same_bytes(a[1:2], b, f"{what}: sample 1 of 3 vs alone")


def test_sampler_operators_are_registered_trainable():
    for name in ("cfg_combine_renorm", "flow_sde_step_logp"):
        assert name in bw.TRAINABLE
        found = impls(name, "strict", "cuda")[0]
        assert "forward only" not in [c.name for c in found.constraints], name
