"""Sampler operators: sigma table, CFG combine + renorm, Flow-GRPO SDE step + logp.

Reference values from numerics §3.3/§4; reference parity against ``drifttool.references.sampler``
(FP64); raw-byte batch invariance (``view(torch.int32)``, distinguishes ±0 and NaN payloads).
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drifttool.errors import UnsupportedConfigError
from drifttool.ops import registry
from drifttool.ops import scheduler as S
from drifttool.references import sampler as ref
from drifttool.runtime import Mode, Runtime

# Declared tolerances vs the FP64 reference (RL-Kernel ws1 profile: reduction fp32 1e-4/1e-4,
# logprob fp32 1e-5 abs; sigma table: one fp32 rounding of each op ≈ a few ulp of 1).
SIGMA_ATOL = 2e-7
CFG_ATOL, CFG_RTOL = 1e-5, 1e-5
SDE_ATOL, SDE_RTOL = 1e-5, 1e-5
LOGP_ATOL = 1e-5


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes as integers (int32 for fp32, int16 for bf16)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------------------------
# Registration


@pytest.mark.parametrize("name", ["flow_sigma_table", "cfg_combine_renorm", "flow_sde_step_logp"])
def test_declared_with_contract_and_both_backends(name):
    sp = registry.spec(name)
    assert sp.contract == f"qwenimage.{name}.v1"
    assert sp.differentiable is (name != "flow_sigma_table")
    for backend in ("strict", "production"):
        assert callable(registry.implementation(name, backend))


def test_call_traces_actual_backend_and_kernel():
    rt = Runtime(mode=Mode.STRICT)
    sig = registry.call(rt, "flow_sigma_table", 10, 1024)
    c, u = torch.randn(1, 4, 64), torch.randn(1, 4, 64)
    registry.call(rt, "cfg_combine_renorm", c, u, 4.0, stream="img")
    entries = {e.op: e for e in rt.trace.entries()}
    assert entries["cfg_combine_renorm"].actual == "strict"
    assert entries["cfg_combine_renorm"].kernel == "torch.fp32.pairwise_tree_norm"
    assert entries["flow_sigma_table"].contract == "qwenimage.flow_sigma_table.v1"
    assert not any(e.fallback for e in rt.trace.entries())
    rt2 = Runtime(mode=Mode.AUTO)
    assert same_bytes(registry.call(rt2, "flow_sigma_table", 10, 1024), sig)
    registry.call(rt2, "cfg_combine_renorm", c, u, 4.0)
    assert {e.op: e for e in rt2.trace.entries()}["cfg_combine_renorm"].actual == "production"


def test_reference_module_is_independent():
    src = pathlib.Path(ref.__file__).read_text()
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add(node.module or "")
    assert not any(m.startswith(("drifttool.ops", "drifttool.model", "torch")) for m in mods), mods


# ---------------------------------------------------------------------------------------------
# flow_sigma_table (numerics §3.3)


@pytest.mark.parametrize(
    "tokens,mu",
    [(4096, 0.6935483870967742), (1024, 0.5387096774193548), (6889, 0.8343245967741936)],
)
def test_mu_values_to_the_bit(tokens, mu):
    assert S.flow_shift_mu(tokens) == mu


def test_sigma_512_n10_listed_values():
    sig = S.flow_sigma_table(10, 1024)
    assert sig.dtype == torch.float32 and sig.shape == (11,)
    listed = ["1.0000000", "0.9289696", "0.8514848", "0.7666239", "0.6732809", "0.5701172",
              "0.4554973", "0.3274001", "0.1833005", "0.0200000", "0.0000000"]
    assert [f"{x:.7f}" for x in sig.tolist()] == listed
    assert sig[0].item() == 1.0
    assert sig[-2].item() == 0.019999980926513672
    assert bits(sig[-1:]).item() == 0  # +0, not -0


def test_sigma_1024_and_1328_listed_values():
    sig = S.flow_sigma_table(50, 4096)
    assert [f"{x:.10f}" for x in sig[:4].tolist()] == [
        "1.0000000000", "0.9897009134", "0.9791914821", "0.9684653282"]
    assert sig[-2].item() == 0.019999980926513672 and sig.shape == (51,)
    assert f"{S.flow_sigma_table(50, 6889)[1].item():.10f}" == "0.9909883142"


def _diffusers_sigmas(num_steps: int, tokens: int):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sch = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        time_shift_type="exponential", invert_sigmas=False,
    )
    # QwenImagePipeline: sigmas = linspace(1, 1/N, N); mu = calculate_shift(seq_len, ...config)
    m = (0.9 - 0.5) / (8192 - 256)
    mu = tokens * m + (0.5 - m * 256)
    sch.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return sch.sigmas, sch.timesteps


@pytest.mark.parametrize("num_steps", [2, 3, 10, 28, 50])
@pytest.mark.parametrize("tokens", [64, 256, 1024, 4096, 6032, 6889, 8192, 16384])
def test_sigma_table_matches_diffusers_bit_for_bit(num_steps, tokens):
    d_sig, d_t = _diffusers_sigmas(num_steps, tokens)
    for backend in ("strict", "production"):
        sig = registry.implementation("flow_sigma_table", backend)(num_steps, tokens)
        assert same_bytes(sig, d_sig)
    assert same_bytes(sig[:-1] * 1000, d_t)
    # the FP32 recipe of the reference reproduces it too; FP64 agrees to tolerance
    assert same_bytes(torch.from_numpy(ref.flow_sigma_table_ref(num_steps, tokens, dtype=np.float32)), sig)
    r64 = ref.flow_sigma_table_ref(num_steps, tokens)
    np.testing.assert_allclose(sig.numpy().astype(np.float64), r64, rtol=0, atol=SIGMA_ATOL)


@pytest.mark.parametrize("num_steps,last_square,first_bad", [(3, 578, 334138), (4, 589, 347890), (50, 634, 402898)])
def test_the_table_past_its_finite_range_is_refused_where_diffusers_gives_nan(num_steps, last_square, first_bad):
    """Huge images: μ grows with the token count until e^μ/(e^μ + N − 1) rounds to 1 in fp32 and
    the terminal stretch divides by 0. diffusers' scheduler then returns NaN; drifttool refuses
    in one line, without numpy's warning. Below, the tables still equal diffusers' bytes
    (``last_square``² patches: the largest square image, in patches a side, that runs)."""
    import warnings

    for tokens in (last_square ** 2, first_bad - 1):
        d_sig, _ = _diffusers_sigmas(num_steps, tokens)
        assert same_bytes(S.flow_sigma_table(num_steps, tokens), d_sig)
    for tokens in (first_bad, (last_square + 1) ** 2, 640 * 640, 1024 * 1024):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # diffusers' own "invalid value encountered in divide"
            d_sig, _ = _diffusers_sigmas(num_steps, tokens)
        assert not torch.isfinite(d_sig).all()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none from drifttool
            with pytest.raises(UnsupportedConfigError, match=rf"mu = .* makes the {num_steps}-step sigma "
                               "table non-finite .*diffusers' FlowMatchEulerDiscreteScheduler computes the same NaN"):
                S.flow_sigma_table(num_steps, tokens)
    assert all(torch.isfinite(S.flow_sigma_table(num_steps, n)).all() for n in range(first_bad - 2000, first_bad))


def test_sigma_table_rejects_bad_input():
    with pytest.raises(UnsupportedConfigError):
        S.flow_sigma_table(1, 1024)
    with pytest.raises(ValueError):
        S.flow_sigma_table(0, 1024)
    with pytest.raises(ValueError):
        S.flow_sigma_table(10, 0)
    assert S.flow_sigma_table(1, 1024, shift_terminal=None).tolist() == [1.0, 0.0]


def test_timestep_policies():
    sig = S.flow_sigma_table(50, 4096)[:-1]
    t = sig * 1000
    assert same_bytes(S.timestep_input(sig, "sigma_fp32"), sig)
    pipe = S.timestep_input(sig, "pipeline_bf16")
    # diffusers: timestep = t.to(bf16); model gets timestep / 1000 (bf16)
    assert same_bytes(pipe, (t.to(torch.bfloat16) / 1000).float())
    assert t[1].item() == pytest.approx(989.70, abs=5e-3)
    assert pipe[1].item() == 0.98828125
    assert (pipe - sig).abs().max().item() == pytest.approx(2.885e-3, abs=1e-5)
    train = S.timestep_input(sig, "t_div_1000_fp32")
    assert same_bytes(train, t / 1000)
    # §5 trap 2: pipeline bf16(bf16(t)/1000) vs training bf16(t/1000) differ on 18/50 steps
    assert int((pipe != train.to(torch.bfloat16).float()).sum()) == 18
    assert S.timestep_input(0.5, "sigma_fp32").dtype == torch.float32
    with pytest.raises(ValueError):
        S.timestep_input(sig, "bf16")


# ---------------------------------------------------------------------------------------------
# cfg_combine_renorm (numerics §3.4, trap 12)


def _cfg_inputs(B, N, C, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(B, N, C, generator=g).to(dtype)
    u = (0.8 * c.float() + 0.5 * torch.randn(B, N, C, generator=g)).to(dtype)
    return c, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7, 64), (3, 6889, 64), (2, 24, 16)])
def test_cfg_strict_vs_reference(shape, dtype):
    c, u = _cfg_inputs(*shape, dtype=dtype)
    out = S.cfg_combine_renorm_strict(c, u, 4.0)
    assert out.dtype == torch.float32 and out.shape == c.shape
    want = ref.cfg_combine_renorm_ref(c.float().numpy(), u.float().numpy(), 4.0)
    np.testing.assert_allclose(out.numpy(), want, rtol=CFG_RTOL, atol=CFG_ATOL)
    # the renorm: per-token norm of the output equals the norm of v_cond
    np.testing.assert_allclose(
        np.linalg.norm(out.double().numpy(), axis=-1), np.linalg.norm(c.double().numpy(), axis=-1),
        rtol=1e-5,
    )


def test_cfg_production_is_diffusers_expression():
    c, u = _cfg_inputs(2, 33, 64, dtype=torch.bfloat16)
    out = S.cfg_combine_renorm_production(c, u, 4.0)
    comb = u + 4.0 * (c - u)
    want = comb * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    assert out.dtype == torch.bfloat16 and same_bytes(out, want)
    # bf16 production vs fp32 strict: documented to differ at bf16 precision
    strict = S.cfg_combine_renorm_strict(c, u, 4.0)
    assert not same_bytes(out.float(), strict)
    np.testing.assert_allclose(out.float().numpy(), strict.numpy(), rtol=5e-2, atol=5e-2)


def test_cfg_production_fp32_combines_like_strict():
    c, u = _cfg_inputs(2, 257, 64)
    p = S.cfg_combine_renorm_production(c, u, 4.0)
    s = S.cfg_combine_renorm_strict(c, u, 4.0)
    assert p.dtype == s.dtype == torch.float32
    np.testing.assert_allclose(p.numpy(), s.numpy(), rtol=1e-6, atol=1e-6)
    # v_uncond == v_cond → comb = c + s·0 = c exactly, ratio = ‖c‖/‖c‖ = 1: output is c
    assert same_bytes(S.cfg_combine_renorm_strict(c, c.clone(), 4.0), c)


def test_cfg_no_epsilon_nan_propagates():
    c, u = _cfg_inputs(1, 4, 64)
    u[0, 1] = c[0, 1]  # comb = c there: fine
    c2 = c.clone()
    c2[0, 2] = 0.0
    u2 = u.clone()
    u2[0, 2] = 0.0  # comb = 0 and ‖c‖ = 0: 0/0 = NaN, not hidden by an epsilon
    out = S.cfg_combine_renorm_strict(c2, u2, 4.0)
    assert torch.isnan(out[0, 2]).all() and torch.isfinite(out[0, [0, 1, 3]]).all()
    c2[0, 3, 5] = float("nan")
    assert torch.isnan(S.cfg_combine_renorm_strict(c2, u2, 4.0)[0, 3]).all()


def test_cfg_errors():
    c, u = _cfg_inputs(1, 4, 64)
    with pytest.raises(ValueError):
        S.cfg_combine_renorm_strict(c, u[:, :3], 4.0)
    with pytest.raises(ValueError):
        S.cfg_combine_renorm_strict(c, u, float("nan"))
    with pytest.raises(UnsupportedConfigError):
        S.cfg_combine_renorm_strict(c.half(), u.half(), 4.0)


def test_cfg_strict_thread_invariant():
    c, u = _cfg_inputs(3, 6889, 64, seed=3)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = S.cfg_combine_renorm_strict(c, u, 4.0)
    finally:
        torch.set_num_threads(n)
    assert same_bytes(one, S.cfg_combine_renorm_strict(c, u, 4.0))


def _plant(target: torch.Tensor, B: int, pos: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    batch = torch.randn(B, *target.shape[1:], generator=g).to(target.dtype) * 3
    batch[pos] = target[0]
    return batch


INVARIANCE = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@INVARIANCE
@given(B=st.integers(1, 3), pos=st.integers(0, 2), N=st.sampled_from([1, 2, 7, 63, 513, 6889]),
       C=st.sampled_from([16, 64]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_cfg_strict_batch_invariance_bytes(B, pos, N, C, seed, dtype):
    pos = pos % B
    c, u = _cfg_inputs(1, N, C, seed=seed, dtype=dtype)
    solo = S.cfg_combine_renorm_strict(c, u, 4.0)
    out = S.cfg_combine_renorm_strict(_plant(c, B, pos, seed + 1), _plant(u, B, pos, seed + 2), 4.0)
    assert same_bytes(out[pos : pos + 1], solo)
    # a token's bytes do not depend on the other tokens either
    k = N // 2
    assert same_bytes(S.cfg_combine_renorm_strict(c[:, k : k + 1], u[:, k : k + 1], 4.0), solo[:, k : k + 1])


# ---------------------------------------------------------------------------------------------
# flow_sde_step_logp (numerics §4)


def _sde_inputs(B, N, C, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, C, generator=g) for _ in range(3))  # v, x, noise


def test_check_values_512_n10_eta_1_2():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(1, 4, 64)
    stds, scales = [], []
    for i in range(10):
        _, _, _, std = S.flow_sde_step_logp_strict(v, x, sig[i], sig[i + 1], eta=1.2,
                                                   sigma_max=sig[1], noise=eps)
        stds.append(std.item())
        scales.append((std * torch.sqrt(sig[i] - sig[i + 1])).item())
    assert [round(s, 4) for s in stds[:3]] == [4.5026, 4.3397, 2.8733]
    assert round(stds[-1], 4) == 0.1714
    assert [round(s, 4) for s in scales[1:3]] == [1.2080, 0.8370] and round(scales[-1], 4) == 0.0242
    # noise scale at step 0 is η exactly (sqrt(1/(1−σ₁))·sqrt(1−σ₁) = 1), here to the fp32 bit
    assert scales[0] == float(np.float32(1.2))
    # σ_max substitution (trap 9): at σ = 1 the std uses sigmas[1], not σ_0
    _, _, _, std0 = S.flow_sde_step_logp_strict(v, x, sig[0], sig[1], eta=1.2, sigma_max=sig[2],
                                                noise=eps)
    assert std0.item() != stds[0]


@pytest.mark.parametrize("backend", ["strict", "production"])
@pytest.mark.parametrize("step", [0, 1, 5, 8, 9])
def test_sde_vs_reference(backend, step):
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(2, 37, 64, seed=step)
    fn = registry.implementation("flow_sde_step_logp", backend)
    x1, logp, mu, std = fn(v, x, sig[step], sig[step + 1], eta=1.2, sigma_max=sig[1], noise=eps)
    rx1, rlogp, rmu, rstd = ref.flow_sde_step_logp_ref(
        v.numpy(), x.numpy(), float(sig[step]), float(sig[step + 1]), eta=1.2,
        sigma_max=float(sig[1]), noise=eps.numpy())
    for got, want in ((x1, rx1), (mu, rmu), (std, rstd)):
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=SDE_RTOL, atol=SDE_ATOL)
    np.testing.assert_allclose(logp.numpy(), rlogp, rtol=0, atol=LOGP_ATOL)
    # replay against the same fp32 next latent
    _, logp_r, _, _ = fn(v, x, sig[step], sig[step + 1], eta=1.2, sigma_max=sig[1], prev_sample=x1)
    _, rlogp_r, _, _ = ref.flow_sde_step_logp_ref(
        v.numpy(), x.numpy(), float(sig[step]), float(sig[step + 1]), eta=1.2,
        sigma_max=float(sig[1]), prev_sample=x1.numpy())
    np.testing.assert_allclose(logp_r.numpy(), rlogp_r, rtol=0, atol=LOGP_ATOL)


def test_sde_strict_vs_production_documented():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(3, 129, 64, seed=7)
    for i in range(9):
        a = S.flow_sde_step_logp_strict(v, x, sig[i], sig[i + 1], eta=1.2, sigma_max=sig[1], noise=eps)
        b = S.flow_sde_step_logp_production(v, x, sig[i], sig[i + 1], eta=1.2, sigma_max=sig[1], noise=eps)
        for k in (0, 2, 3):  # x_next, mu, std_t: equal up to the last bit of std_t's sqrt
            # strict takes sqrt in FP64 rounded once (correctly rounded); production's FP32
            # torch.sqrt is not always (measured), so an ULP of std_t may differ.
            np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=4e-7, atol=1e-6, err_msg=str((i, k)))
        np.testing.assert_allclose(a[1].numpy(), b[1].numpy(), rtol=0, atol=LOGP_ATOL)


def test_sde_sampling_vs_replay_bytes():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(2, 50, 64, seed=11)
    for backend in ("strict", "production"):
        fn = registry.implementation("flow_sde_step_logp", backend)
        x1, logp, mu, std = fn(v, x, sig[3], sig[4], eta=1.2, sigma_max=sig[1], noise=eps)
        x1r, logpr, mur, stdr = fn(v, x, sig[3], sig[4], eta=1.2, sigma_max=sig[1], prev_sample=x1)
        assert same_bytes(x1r, x1) and same_bytes(logpr, logp) and same_bytes(mur, mu)


def test_sde_eta_zero_is_euler_and_logp_absent():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(2, 9, 64)
    for backend in ("strict", "production"):
        fn = registry.implementation("flow_sde_step_logp", backend)
        x1, logp, mu, std = fn(v, x, sig[9], sig[10], eta=0.0, sigma_max=sig[1])
        assert same_bytes(x1, x + (sig[10] - sig[9]) * v) and same_bytes(mu, x1)
        assert torch.isnan(logp).all() and logp.shape == (2,)
        assert same_bytes(std, torch.zeros(2))
        # noise is ignored; replay returns the stored next latent itself
        x1n, _, _, _ = fn(v, x, sig[9], sig[10], eta=0.0, sigma_max=sig[1], noise=eps)
        assert same_bytes(x1n, x1)
        stored = torch.randn_like(x)
        assert same_bytes(fn(v, x, sig[9], sig[10], eta=0.0, sigma_max=sig[1], prev_sample=stored)[0], stored)


def test_sde_gradient_flows_through_mu_only():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(2, 16, 64, seed=5)
    x1_old = S.flow_sde_step_logp_strict(v, x, sig[2], sig[3], eta=1.2, sigma_max=sig[1], noise=eps)[0]
    v = (v + 0.01 * torch.randn_like(v)).requires_grad_(True)
    x1, logp, mu, std = S.flow_sde_step_logp_strict(v, x, sig[2], sig[3], eta=1.2, sigma_max=sig[1],
                                                    prev_sample=x1_old)
    assert not x1.requires_grad and mu.requires_grad
    logp.sum().backward()
    g = v.grad
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    # analytic: dlogp_b/dv = (1/D)·(x1 − mu)/s²·c·Δ  (c = 1 + var(1−σ)/(2σ))
    s_, sn = float(sig[2]), float(sig[3])
    dt = sn - s_
    var = std[0].item() ** 2
    scale2 = var * (-dt)
    cc = 1 + var * (1 - s_) / (2 * s_)
    want = (x1 - mu).detach().double() / scale2 * cc * dt / x[0].numel()
    np.testing.assert_allclose(g.double().numpy(), want.numpy(), rtol=1e-3, atol=1e-9)
    # production too
    v2 = v.detach().clone().requires_grad_(True)
    S.flow_sde_step_logp_production(v2, x, sig[2], sig[3], eta=1.2, sigma_max=sig[1],
                                    prev_sample=x1_old)[1].sum().backward()
    np.testing.assert_allclose(v2.grad.numpy(), g.numpy(), rtol=1e-4, atol=1e-9)


def test_sde_scalar_and_vector_sigma_same_bytes():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(3, 20, 64, seed=2)
    a = S.flow_sde_step_logp_strict(v, x, sig[4], sig[5], eta=1.2, sigma_max=sig[1], noise=eps)
    b = S.flow_sde_step_logp_strict(v, x, sig[4].expand(3), sig[5].expand(3), eta=1.2,
                                    sigma_max=float(sig[1]), noise=eps)
    assert all(same_bytes(p, q) for p, q in zip(a, b))


def test_sde_errors():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(1, 4, 64)
    kw = dict(eta=1.2, sigma_max=sig[1])
    with pytest.raises(ValueError):  # stochastic step without pinned noise
        S.flow_sde_step_logp_strict(v, x, sig[0], sig[1], **kw)
    with pytest.raises(ValueError):
        S.flow_sde_step_logp_strict(v, x, sig[0], sig[1], noise=eps, prev_sample=x, **kw)
    with pytest.raises(UnsupportedConfigError):  # sigma_next >= sigma
        S.flow_sde_step_logp_strict(v, x, sig[1], sig[0], noise=eps, **kw)
    with pytest.raises(UnsupportedConfigError):
        S.flow_sde_step_logp_strict(v, x, sig[0], sig[1], noise=eps.double(), **kw)
    with pytest.raises(ValueError):
        S.flow_sde_step_logp_strict(v, x[:, :3], sig[0], sig[1], noise=eps, **kw)
    with pytest.raises(ValueError):
        S.flow_sde_step_logp_strict(v, x, sig[0], sig[1], noise=eps, eta=-1.0, sigma_max=sig[1])


def test_sde_nan_propagates():
    sig = S.flow_sigma_table(10, 1024)
    v, x, eps = _sde_inputs(2, 8, 64)
    v[1, 3, 7] = float("nan")
    x1, logp, mu, _ = S.flow_sde_step_logp_strict(v, x, sig[1], sig[2], eta=1.2, sigma_max=sig[1], noise=eps)
    assert torch.isnan(logp[1]) and torch.isfinite(logp[0])
    assert torch.isnan(x1[1, 3, 7]) and torch.isfinite(x1[0]).all()


@INVARIANCE
@given(B=st.integers(1, 3), pos=st.integers(0, 2), N=st.sampled_from([1, 3, 7, 64, 257, 6889]),
       step=st.integers(0, 9), seed=st.integers(0, 2**16), replay=st.booleans())
def test_sde_strict_batch_invariance_bytes(B, pos, N, step, seed, replay):
    pos = pos % B
    sig = S.flow_sigma_table(10, 1024)
    eta = 1.2 if step < 9 else 0.0
    v, x, eps = _sde_inputs(1, N, 64, seed=seed)
    other = dict(noise=eps) if not replay else dict(prev_sample=eps * 0.5 + x)
    solo = S.flow_sde_step_logp_strict(v, x, sig[step], sig[step + 1], eta=eta, sigma_max=sig[1], **other)
    # companions sit at other steps of the schedule (per-sample sigmas)
    g = torch.Generator().manual_seed(seed + 1)
    steps = torch.randint(0, 9, (B,), generator=g)
    steps[pos] = step
    bv, bx = _plant(v, B, pos, seed + 2), _plant(x, B, pos, seed + 3)
    bother = {k: _plant(t, B, pos, seed + 4) for k, t in other.items()}
    out = S.flow_sde_step_logp_strict(bv, bx, sig[steps], sig[steps + 1], eta=eta, sigma_max=sig[1], **bother)
    for o, s in zip(out, solo):
        assert same_bytes(o[pos : pos + 1], s)
