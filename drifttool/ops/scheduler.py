"""Sampler operators: the FP32 sigma table, CFG combine + renorm, and the Flow-GRPO SDE step.

    >>> sig = call(rt, "flow_sigma_table", 10, 1024)          # 512², numerics §3.3
    >>> sig
    tensor([1.0000, 0.9290, 0.8515, 0.7666, 0.6733, 0.5701, 0.4555, 0.3274, 0.1833, 0.0200, 0.0000])
    >>> v = call(rt, "cfg_combine_renorm", v_cond, v_uncond, 4.0, stream="img", layout="BS.")
    >>> x1, logp, mu, std_t = call(rt, "flow_sde_step_logp", v, x, sig[0], sig[1],
    ...                            eta=1.2, sigma_max=sig[1], noise=eps)

Three RFC-386 rows, each declared here with contract id ``qwenimage.<name>.v1`` and implemented
for the ``strict`` and ``production`` backends:

====================  ===========================================  ==================================
operator              strict                                       production
====================  ===========================================  ==================================
flow_sigma_table      numpy fp32, diffusers' written order         same function (the arithmetic is
                      (exact IEEE ops, bit-equal to diffusers)     exact; no reduction)
cfg_combine_renorm    fp32 math; per-token norms by the pairwise     diffusers' expression in the input
                      tree over channels; fp32 output              dtype (``torch.norm``)
flow_sde_step_logp    fp32, Flow-GRPO's written order; ln s_t in   Flow-GRPO's expression verbatim in
                      binary64 rounded once; pairwise-tree mean   fp32; ``torch.mean``
====================  ===========================================  ==================================

``flow_sde_step_logp`` takes a ``rule`` keyword (``STEP_RULES``): ``"sde"`` (default, both
families) is the table's row; the production presets of ``drifttool.sampling.presets`` ask for
``"flow_grpo"`` (Flow-GRPO's step at every step, η = 0 outside its window, same kernel) and
``"diffusers_euler"`` (diffusers' ``scheduler.step``, kernel
``torch.native.diffusers_scheduler_step``). Strict declares ``"sde"`` only and refuses the others
by a declared constraint (tested in ``tests/sampling/test_presets.py``).

Strict vs production, byte for byte (tested in ``tests/ops/test_scheduler.py``):

* ``flow_sigma_table``: identical.
* ``cfg_combine_renorm``: with fp32 inputs the combined velocity is identical and the per-token
  norms may differ in the last bits (``torch.norm``'s reduction order is its own). With bf16 inputs
  production rounds every op to bf16 (diffusers) and returns bf16, strict upcasts and returns fp32.
* ``flow_sde_step_logp``: ``x_next``, ``mu`` and ``std_t`` equal up to an ULP of ``std_t`` (strict
  takes square roots in FP64 rounded once; FP32 ``torch.sqrt`` is not always correctly rounded);
  ``logp`` may differ in the last bits (``torch.log`` vs binary64 log for ``ln s_t``,
  ``torch.mean`` vs the pairwise tree).

Strict reductions use the canonical pairwise tree ``strict_math.tree_sum`` (adjacent pairs,
zero-padded to a power of two: the same tree as every other strict operator), and square roots
use ``strict_math.sqrt32`` (FP64, rounded once). ``torch.sum``/``torch.norm``/``torch.mean`` are
never used in strict: their order may depend on the tensor size and the thread count.

Backward (strict): ``cfg_combine_renorm`` and ``flow_sde_step_logp`` are ``torch.autograd.Function``s
whose forward is the arithmetic above and whose backward has a fixed per-token / per-element order
(``_CFGRenorm``, ``_SDEStep``; docs/strict-arithmetic.md, "Backward").
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import Constraint
from drifttool.ops.registry import OpSpec, declare, implements
from drifttool.ops.strict_math import sqrt32, tree_sum

_FLOATS = (torch.float32, torch.bfloat16)

FLOW_SIGMA_TABLE = declare(
    OpSpec(
        name="flow_sigma_table",
        contract="qwenimage.flow_sigma_table.v1",
        differentiable=False,
        dtypes=(torch.float32,),
        summary="linspace(1,1/N,N), exponential dynamic shift, terminal stretch to 0.02, append 0",
    )
)
CFG_COMBINE_RENORM = declare(
    OpSpec(
        name="cfg_combine_renorm",
        contract="qwenimage.cfg_combine_renorm.v1",
        differentiable=True,
        dtypes=_FLOATS,
        summary="u + s(c - u), rescaled per token to the norm of c over the channel axis",
    )
)
FLOW_SDE_STEP_LOGP = declare(
    OpSpec(
        name="flow_sde_step_logp",
        contract="qwenimage.flow_sde_step_logp.v1",
        differentiable=True,
        dtypes=_FLOATS,
        summary="Flow-GRPO 'sde' transition and Gaussian log-prob (mean over non-batch dims), FP32",
    )
)

MAX_LOGP_ELEMENTS = 1 << 24
"""Largest per-sample element count of the strict logp mean (the count is exact in fp32)."""

STEP_RULES = ("sde", "flow_grpo", "diffusers_euler")
"""How a ``flow_sde_step_logp`` call steps (its keyword ``rule``, default ``"sde"``):

* ``"sde"``: Flow-GRPO's SDE step with η > 0 (inside the SDE window); with η = 0 the FP32 Euler
  step x + Δσ·v, any noise ignored (drifttool's default sampler; strict and production).
* ``"flow_grpo"`` (production): Flow-GRPO's ``sde_step_with_logprob`` at **every** step, as its
  Qwen-Image rollout calls it: outside the window η = 0 goes through the same expression
  (std_t = 0) and the step's noise is still added, times 0 (numerics §4.1). Needs ``noise`` or
  ``prev_sample`` at every step.
* ``"diffusers_euler"`` (production): diffusers' ``FlowMatchEulerDiscreteScheduler.step``:
  x_next = (fp32(x) + Δσ·v).to(v.dtype), the product Δσ·v in v's dtype (numerics §3.4);
  η must be 0; no log-probability.
"""


def _rule_is(*allowed: str) -> Constraint:
    """Constraint: the call's ``rule`` keyword is one of ``allowed`` (``STEP_RULES``)."""

    def test(args) -> str | None:
        rule = args["rule"]
        if rule in allowed:
            return None
        if rule not in STEP_RULES:
            return f"unknown step rule {rule!r} (one of {', '.join(STEP_RULES)})"
        return f"step rule {rule!r} is not implemented here (this kernel runs {', '.join(allowed)})"

    return Constraint(f"step rule {'|'.join(allowed)}", test, ("rule",))



# ---------------------------------------------------------------------------------------------
# Sigma schedule (numerics §3.3) and timestep encoding (§3.4, §5 trap 2)


def flow_shift_mu(
    image_seq_len: int,
    *,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
) -> float:
    """Dynamic-shift exponent μ for ``image_seq_len`` image tokens (numerics §3.3).

    Linear in the token count and not clamped, evaluated in binary64 in diffusers' written order
    (``m = Δshift/Δlen; b = base_shift − m·base_len; μ = len·m + b``), so it is the same float as
    the pipeline's ``calculate_shift`` (4096 tokens → 0.6935483870967742).
    """
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def _sigma_table_np(
    num_steps: int,
    image_seq_len: int,
    *,
    base_shift: float,
    max_shift: float,
    base_seq_len: int,
    max_seq_len: int,
    shift_terminal: float | None,
) -> np.ndarray:
    if not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not isinstance(image_seq_len, (int, np.integer)) or image_seq_len < 1:
        raise ValueError(f"image_seq_len must be a positive int, got {image_seq_len!r}")
    if shift_terminal and num_steps < 2:
        # 1 - sigma1[-1] = 0 makes the stretch 0/0 (diffusers returns NaN).
        raise UnsupportedConfigError("flow_sigma_table: the terminal stretch needs num_steps >= 2")
    mu = flow_shift_mu(
        int(image_seq_len), base_shift=base_shift, max_shift=max_shift,
        base_seq_len=base_seq_len, max_seq_len=max_seq_len,
    )
    one = np.float32(1.0)
    # σ⁰ = linspace in binary64, then one cast to fp32 (diffusers' set_timesteps(sigmas=...)).
    s0 = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)  # [N]
    # Exponential shift with exponent 1: e^μ / (e^μ + (1/σ⁰ − 1)). e^μ is a binary64 libm value
    # rounded once to fp32 (NumPy 2 keeps fp32 for python-float operands); every op below is a
    # single correctly rounded fp32 op.
    e_mu = np.float32(math.exp(mu))
    s1 = e_mu / (e_mu + (one / s0 - one))
    if shift_terminal:
        one_minus = one - s1
        scale = one_minus[-1] / np.float32(1.0 - shift_terminal)
        s1 = one - one_minus / scale
    out = np.concatenate([s1.astype(np.float32), np.zeros(1, np.float32)])  # [N+1], trailing +0
    assert out.dtype == np.float32
    return out


def _flow_sigma_table(
    num_steps: int,
    image_seq_len: int,
    *,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
    shift_terminal: float | None = 0.02,
) -> torch.Tensor:
    """FP32 sigma table of the Qwen-Image scheduler (numerics §3.3; forward only).

    Args:
        num_steps: N, the number of denoising steps (≥ 1; ≥ 2 with a terminal stretch).
        image_seq_len: image token count h·w (packed 2×2 patches), e.g. 4096 at 1024².
        base_shift, max_shift, base_seq_len, max_seq_len: the dynamic-shift line (Qwen-Image's
            published scheduler config: 0.5 at 256 tokens, 0.9 at 8192; not the class defaults).
        shift_terminal: stretch so the last non-zero sigma is this value (0.02); ``None``/0 skips.

    Returns:
        ``sigmas`` fp32 CPU tensor [N+1], unitless, decreasing: σ_0 = 1 exactly, σ_{N−1} =
        0.019999980926513672 (fp32 of the stretch), σ_N = +0. The model timesteps of diffusers are
        ``sigmas[:N] * 1000`` (fp32); see ``timestep_input`` for what the model receives.

    Arithmetic: numpy fp32 in diffusers' written order (σ⁰ = fp32(linspace₆₄(1, 1/N, N));
    σ¹ = e^μ/(e^μ + (1/σ⁰ − 1)); r = (1 − σ¹_{N−1})/fp32(1 − 0.02); σ = 1 − (1 − σ¹)/r).
    Bit-equal to ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace, mu=μ)``
    configured as numerics §1.

    Raises:
        ValueError: non-positive ``num_steps`` or ``image_seq_len``.
        UnsupportedConfigError: ``num_steps == 1`` with a terminal stretch (0/0).
    """
    table = _sigma_table_np(
        num_steps, image_seq_len, base_shift=base_shift, max_shift=max_shift,
        base_seq_len=base_seq_len, max_seq_len=max_seq_len, shift_terminal=shift_terminal,
    )
    return torch.from_numpy(table)


# host arithmetic (numpy) and no tensor arguments: registered for the CPU, where dispatch sends a
# call without tensors, in both families
implements("flow_sigma_table", "strict", kernel="numpy_fp32.diffusers_order")(_flow_sigma_table)
implements("flow_sigma_table", "production", kernel="numpy_fp32.diffusers_order")(
    _flow_sigma_table
)
flow_sigma_table = _flow_sigma_table
"""Direct (un-traced) access; inside a run use ``call(rt, "flow_sigma_table", ...)``."""


TIMESTEP_POLICIES = ("sigma_fp32", "pipeline_bf16", "t_div_1000_fp32")
"""Timestep encodings τ of a step with sigma σ (numerics §3.4, §5 trap 2):

* ``"sigma_fp32"``: τ = fp32 σ (the table value itself).
* ``"pipeline_bf16"``: diffusers' QwenImagePipeline: t = fp32(σ)·1000 (fp32), τ =
  bf16(bf16(t) / 1000) — t is cast to bf16 *before* the division (989.70 → 988 → 0.98828125);
  up to 2.9e-3 away from σ over 50 steps at 1024².
* ``"t_div_1000_fp32"``: Flow-GRPO training's ``compute_log_prob``: τ = fp32(t) / 1000 in fp32.

The trainer must use the rollout's policy; a mismatch changes every step's model input.
"""


def timestep_input(sigma: float | torch.Tensor, policy: str) -> torch.Tensor:
    """Encode sigma as the model's timestep input τ under ``policy`` (see ``TIMESTEP_POLICIES``).

    Args:
        sigma: a sigma (python float, 0-dim or [B] tensor); converted to fp32 first.
        policy: ``"sigma_fp32"`` | ``"pipeline_bf16"`` | ``"t_div_1000_fp32"``.

    Returns:
        τ as an fp32 tensor of ``sigma``'s shape (for ``"pipeline_bf16"`` the values are bf16
        values held exactly in fp32), unitless (≈ σ ∈ [0, 1]).

    Raises:
        ValueError: unknown policy.
    """
    s = torch.as_tensor(sigma, dtype=torch.float32)
    if policy == "sigma_fp32":
        return s.clone()
    t = s * 1000  # fp32, as diffusers' timesteps = sigmas * num_train_timesteps
    if policy == "pipeline_bf16":
        return (t.to(torch.bfloat16) / 1000).to(torch.float32)
    if policy == "t_div_1000_fp32":
        return t / 1000
    raise ValueError(f"unknown timestep policy {policy!r}; expected one of {TIMESTEP_POLICIES}")


def _check_dtype(name: str, what: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise UnsupportedConfigError(
            f"{name}: {what} has dtype {t.dtype}, strict supports {tuple(allowed)}"
        )


# ---------------------------------------------------------------------------------------------
# CFG combine + per-token renorm (numerics §3.4, §5 trap 12)


def _check_cfg_inputs(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> None:
    if v_cond.shape != v_uncond.shape:
        raise ValueError(
            f"cfg_combine_renorm: v_cond {tuple(v_cond.shape)} and v_uncond "
            f"{tuple(v_uncond.shape)} differ"
        )
    if v_cond.dim() < 1 or v_cond.shape[-1] < 1:
        raise ValueError("cfg_combine_renorm: inputs need a non-empty channel axis")
    if isinstance(scale, torch.Tensor) or not math.isfinite(float(scale)):
        raise ValueError(f"cfg_combine_renorm: scale must be a finite python float, got {scale!r}")


class _CFGRenorm(torch.autograd.Function):
    """Strict CFG combine + renorm with a fixed-order backward (all FP32, per token; the two
    channel sums are the pairwise tree over C):

    t = Σ_C g·comb; k_comb = ((t·ratio)/‖comb‖)/‖comb‖; k_c = (t/‖comb‖)/‖c‖;
    dcomb = g·ratio − comb·k_comb; dd = s·dcomb; dc = dd + c·k_c; du = dcomb − dd.
    """

    @staticmethod
    def forward(ctx, v_cond, v_uncond, scale):
        c = v_cond.to(torch.float32)
        u = v_uncond.to(torch.float32)
        s = torch.tensor(scale, dtype=torch.float32, device=c.device)
        comb = u + s * (c - u)  # [B, N, C]
        c_norm = sqrt32(tree_sum(c * c))  # [B, N]
        comb_norm = sqrt32(tree_sum(comb * comb))  # [B, N]
        ratio = c_norm / comb_norm  # [B, N]
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(c, comb, c_norm, comb_norm, ratio, s)
            ctx.dtypes = (v_cond.dtype, v_uncond.dtype)
        return comb * ratio.unsqueeze(-1)  # [B, N, C]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gv):
        c, comb, c_norm, comb_norm, ratio, s = ctx.saved_tensors
        g = gv.contiguous().to(torch.float32)
        t = tree_sum(g * comb)  # [B, N]
        k_comb = ((t * ratio) / comb_norm) / comb_norm
        k_c = (t / comb_norm) / c_norm
        dcomb = g * ratio.unsqueeze(-1) - comb * k_comb.unsqueeze(-1)
        dd = s * dcomb
        dc = dd + c * k_c.unsqueeze(-1)
        du = dcomb - dd
        return dc.to(ctx.dtypes[0]), du.to(ctx.dtypes[1]), None


@implements("cfg_combine_renorm", "strict", kernel="torch.fp32.pairwise_tree_norm")
def cfg_combine_renorm_strict(
    v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float
) -> torch.Tensor:
    """CFG combine and per-token renorm, strict (numerics §3.4).

    Args:
        v_cond: [B, N, C] conditional velocity (fp32 or bf16; bf16 is upcast exactly).
        v_uncond: [B, N, C] unconditional (negative-prompt) velocity, same shape.
        scale: guidance scale s (python float; rounded once to fp32).

    Returns:
        v [B, N, C] fp32: comb = u + s·(c − u); v = comb · (‖c‖ / ‖comb‖), 2-norms per token over
        the last (channel) axis, no epsilon (‖comb‖ = 0 gives inf/NaN, propagated, not hidden).

    Arithmetic (fp32, one rounding per op, no FMA): d = c − u; comb = u + (s·d);
    ‖a‖ = sqrt32(tree_sum(a·a)) (FP64 sqrt rounded once) with the pairwise tree over the C channels; ratio = ‖c‖ / ‖comb‖;
    v = comb · ratio. Byte-invariant to batch size, batch position and token count. Backward: a
    fixed per-token order (``_CFGRenorm``), gradients cast once to the input dtypes.

    Raises:
        UnsupportedConfigError: a dtype other than fp32/bf16.
        ValueError: shape mismatch, empty channel axis, non-finite or tensor scale.
    """
    _check_cfg_inputs(v_cond, v_uncond, scale)
    for what, t in (("v_cond", v_cond), ("v_uncond", v_uncond)):
        _check_dtype("cfg_combine_renorm", what, t, CFG_COMBINE_RENORM.dtypes)
    return _CFGRenorm.apply(v_cond, v_uncond, float(scale))


@implements("cfg_combine_renorm", "production", device=("cpu", "cuda"), kernel="torch.native.norm")
def cfg_combine_renorm_production(
    v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float
) -> torch.Tensor:
    """CFG combine and per-token renorm as diffusers' QwenImagePipeline writes it (numerics §3.4).

    Same meaning as ``cfg_combine_renorm_strict`` but computed in the input dtype with
    ``torch.norm(dim=-1, keepdim=True)``; returns the input dtype (bf16 in a bf16 pipeline).
    """
    _check_cfg_inputs(v_cond, v_uncond, scale)
    comb = v_uncond + float(scale) * (v_cond - v_uncond)
    cond_norm = torch.norm(v_cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)


# ---------------------------------------------------------------------------------------------
# Flow-GRPO SDE step with log-probability (numerics §4, §4.1, §5 trap 9)


def _per_sample(
    value: float | torch.Tensor, batch: int, device: torch.device, what: str
) -> torch.Tensor:
    """A schedule scalar or [B] vector as an fp32 [B] tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to(torch.float32)
    else:
        t = torch.tensor(float(value), dtype=torch.float32)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(
            f"flow_sde_step_logp: {what} must be a scalar or [B={batch}], got {tuple(t.shape)}"
        )
    return t.to(device).contiguous()


def _prepare_sde(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None,
    prev_sample: torch.Tensor | None,
    strict: bool,
):
    name = "flow_sde_step_logp"
    if v.shape != x.shape or v.dim() < 2:
        raise ValueError(f"{name}: v {tuple(v.shape)} and x {tuple(x.shape)} must match, [B, ...]")
    if noise is not None and prev_sample is not None:
        raise ValueError(f"{name}: give noise (sampling) or prev_sample (replay), not both")
    for what, t in (("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name}: {what} {tuple(t.shape)} must match x {tuple(x.shape)}")
    eta = float(eta)
    if not math.isfinite(eta) or eta < 0:
        raise ValueError(f"{name}: eta must be finite and >= 0, got {eta}")
    if eta > 0 and noise is None and prev_sample is None:
        raise ValueError(f"{name}: eta > 0 needs pinned noise or prev_sample (the op draws no RNG)")
    if strict:
        for what, t in (("v", v), ("x", x), ("prev_sample", prev_sample)):
            if t is not None:
                _check_dtype(name, what, t, FLOW_SDE_STEP_LOGP.dtypes)
        if noise is not None:
            _check_dtype(name, "noise", noise, (torch.float32,))
    B = x.shape[0]
    s = _per_sample(sigma, B, x.device, "sigma")
    sn = _per_sample(sigma_next, B, x.device, "sigma_next")
    sm = _per_sample(sigma_max, B, x.device, "sigma_max")
    if not bool(((sn >= 0) & (sn < s) & (s <= 1)).all()):
        raise UnsupportedConfigError(
            f"{name}: needs 0 <= sigma_next < sigma <= 1 per sample, got sigma={s.tolist()}, "
            f"sigma_next={sn.tolist()}"
        )
    if eta > 0 and not bool(((sm > 0) & (sm < 1)).all()):
        raise UnsupportedConfigError(
            f"{name}: sigma_max (= sigmas[1]) must be in (0, 1), got {sm.tolist()}"
        )
    return v.to(torch.float32), x.to(torch.float32), s, sn, sm, eta


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B] → [B, 1, ..., 1] with ``ndim`` dims."""
    return t.view(-1, *([1] * (ndim - 1)))


def _euler(v32, x32, s, sn, prev_sample):
    """eta == 0: x + Δσ·v in fp32; logp undefined (NaN); std_t = 0."""
    dt = _bcast(sn - s, x32.dim())
    mu = x32 + dt * v32
    x_next = prev_sample.to(torch.float32) if prev_sample is not None else mu
    B = x32.shape[0]
    logp = torch.full((B,), math.nan, dtype=torch.float32, device=x32.device)
    std_t = torch.zeros(B, dtype=torch.float32, device=x32.device)
    return x_next.detach(), logp, mu, std_t


def sde_constants(s: torch.Tensor, sn: torch.Tensor, sm: torch.Tensor, eta: float):
    """The per-sample constants of the strict SDE step (η > 0), FP32 [B] on ``s``'s device, in
    ``flow_sde_step_logp_strict``'s order: (Δ, std_t, a, c, s_t, 2·(s_t·s_t), ln s_t, ln√(2π)) —
    the last a 0-dim tensor; both logs binary64 on the host, rounded once to FP32. Shared by the
    strict CUDA step, which computes them here on the CPU."""
    eta32 = torch.tensor(eta, dtype=torch.float32, device=s.device)
    dt = sn - s  # [B]
    std = sqrt32(s / (1 - torch.where(s == 1, sm, s))) * eta32  # [B]
    var = std * std
    two_s = 2 * s
    a = 1 + (var / two_s) * dt  # [B]
    c = 1 + (var * (1 - s)) / two_s  # [B]
    scale = std * sqrt32(-dt)  # [B] noise scale s_t
    log_scale = torch.tensor(
        [math.log(q) if q > 0 else (-math.inf if q == 0 else math.nan) for q in scale.tolist()],
        dtype=torch.float32, device=s.device,
    )  # [B]
    log_sqrt_2pi = torch.tensor(0.5 * math.log(2.0 * math.pi), dtype=torch.float32, device=s.device)
    two_var = 2 * (scale * scale)  # [B]
    return dt, std, a, c, scale, two_var, log_scale, log_sqrt_2pi


class _SDEStep(torch.autograd.Function):
    """The strict SDE step (arithmetic in ``flow_sde_step_logp_strict``'s docstring) with a fixed
    backward, all FP32 and elementwise per sample (x_next is detached, so only mu carries the
    gradient of logp):

    coef = g_logp / (fp32(N·C)·(s·s)); dmu = g_mu + d·coef; dx = dmu·a; dv = (dmu·c)·Δ.
    Euler steps (η = 0): dx = g_mu, dv = Δ·g_mu; logp (NaN) has no gradient.
    """

    @staticmethod
    def forward(ctx, v32, x32, s, sn, sm, eta, noise, prev_sample):
        per_sample = x32[0].numel()
        if eta == 0.0:
            x_next, logp, mu, std_t = _euler(v32, x32, s, sn, prev_sample)
            ctx.mark_non_differentiable(x_next, logp, std_t)
            ctx.save_for_backward(sn - s)
            ctx.euler = True
            return x_next, logp, mu, std_t
        nd = x32.dim()
        dt, std, a, c, scale, two_var, log_scale, log_sqrt_2pi = sde_constants(s, sn, sm, eta)
        mu = x32 * _bcast(a, nd) + (v32 * _bcast(c, nd)) * _bcast(dt, nd)  # [B, N, C]
        if prev_sample is None:
            x_next = mu + _bcast(scale, nd) * noise
        else:
            x_next = prev_sample.to(torch.float32)
        x_next = x_next.detach()
        d = x_next - mu
        elem = (-(d * d) / _bcast(two_var, nd) - _bcast(log_scale, nd)) - log_sqrt_2pi  # [B, N, C]
        total = tree_sum(elem.reshape(elem.shape[0], -1))  # [B]
        logp = total / torch.tensor(float(per_sample), dtype=torch.float32, device=x32.device)
        ctx.mark_non_differentiable(x_next, std)
        ctx.save_for_backward(dt, a, c, scale, d)
        ctx.euler, ctx.count = False, per_sample
        return x_next, logp, mu, std

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_next, g_logp, g_mu, g_std):
        nd = g_mu.dim()
        g_mu = g_mu.contiguous().to(torch.float32)
        if ctx.euler:
            (dt,) = ctx.saved_tensors
            return _bcast(dt, nd) * g_mu, g_mu, None, None, None, None, None, None
        dt, a, c, scale, d = ctx.saved_tensors
        count = torch.tensor(float(ctx.count), dtype=torch.float32, device=g_mu.device)
        coef = g_logp.to(torch.float32) / (count * (scale * scale))  # [B]
        dmu = g_mu + d * _bcast(coef, nd)
        dx = dmu * _bcast(a, nd)
        dv = (dmu * _bcast(c, nd)) * _bcast(dt, nd)
        return dv, dx, None, None, None, None, None, None


@implements("flow_sde_step_logp", "strict", kernel="torch.fp32.flowgrpo_sde.pairwise_tree_mean",
            constraints=(_rule_is("sde"),))
def flow_sde_step_logp_strict(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    rule: str = "sde",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-GRPO 'sde' transition x_t → x_{t+1} and its log-probability, strict FP32 (numerics §4).

    Args:
        v: [B, N, C] velocity (fp32, or bf16 upcast exactly) — the CFG-combined one in a rollout.
        x: [B, N, C] current latent x_t (fp32 or bf16).
        sigma: σ of this step, python float, 0-dim or [B] (per-sample schedules allowed).
        sigma_next: σ of the next step (σ' < σ; 0 at the last step).
        eta: noise level η ≥ 0 (``noise_level`` in Flow-GRPO). ``eta == 0`` (a step outside the
            SDE window) is the deterministic Euler step, see Returns.
        sigma_max: the scheduler's **second** sigma ``sigmas[1]`` (§5 trap 9), substituted for σ
            in 1 − σ when σ == 1.
        noise: [B, N, C] fp32 pinned standard-normal noise (sampling); the op draws no RNG.
        prev_sample: [B, N, C] the stored next latent (replay / training recompute); fp32 or bf16.
        rule: ``"sde"`` only (``STEP_RULES``; the other rules are production kernels, and a
            declared constraint refuses them here).

    Returns:
        ``(x_next, logp, mu, std_t)``, all fp32:
        x_next [B, N, C] (detached; ``prev_sample`` itself in replay), logp [B], mu [B, N, C]
        (differentiable in v and x), std_t [B] (the SDE std η·sqrt(σ/(1−σ̃)), not the step's
        noise scale s = std_t·sqrt(−Δ)). With ``eta == 0``: mu = x + Δ·v, x_next = mu (or
        ``prev_sample``), std_t = 0 and **logp = NaN**: the log-density of a deterministic step is
        not defined; callers must record it as absent, never as a value.

    Arithmetic (fp32, one rounding per op, no FMA, Flow-GRPO's written order), per sample:
    Δ = σ' − σ; std = sqrt(σ / (1 − σ̃)) · η with σ̃ = σ_max if σ == 1 else σ; var = std·std;
    a = 1 + (var / (2σ))·Δ; c = 1 + (var·(1 − σ)) / (2σ); mu = x·a + (v·c)·Δ;
    s = std·sqrt(−Δ); x_next = mu + s·noise (sampling) or prev_sample;
    ℓ = (−(d·d) / (2·(s·s)) − ln s) − ln√(2π) with d = x_next − mu (x_next detached);
    logp = tree_sum(ℓ over the N·C flattened elements) / fp32(N·C) (pairwise tree, module doc).
    ln s and ln√(2π) are binary64 logs rounded once to fp32 (the only transcendental; declared
    tolerance vs the FP64 reference 1e-5 abs on logp), computed per sample on the host, so
    nothing depends on the batch layout. Byte-invariant to batch size, batch position and token
    count; sampling and replay (prev_sample = the sampled x_next) give the same logp bytes.

    Backward (``_SDEStep``): only mu carries gradients (x_next, std_t and the Euler logp are not
    differentiable): dmu = g_mu + d·(g_logp / (fp32(N·C)·(s·s))); dx = dmu·a; dv = (dmu·c)·Δ,
    elementwise FP32 per sample.

    Raises:
        ValueError: shape mismatch; both or (with eta > 0) neither of noise/prev_sample; eta < 0.
        UnsupportedConfigError: unsupported dtype (noise must be fp32); sigma_next ≥ sigma,
            σ > 1 or σ' < 0; sigma_max ∉ (0, 1) with eta > 0; more than 2^24 elements per sample.
    """
    v32, x32, s, sn, sm, eta = _prepare_sde(
        v, x, sigma, sigma_next, eta, sigma_max, noise, prev_sample, strict=True
    )
    per_sample = x32[0].numel()
    if per_sample > MAX_LOGP_ELEMENTS:
        raise UnsupportedConfigError(
            f"flow_sde_step_logp: {per_sample} elements per sample exceed 2^24 (strict count)"
        )
    return _SDEStep.apply(v32, x32, s, sn, sm, eta, noise, prev_sample)


@implements("flow_sde_step_logp", "production", device=("cpu", "cuda"),
            kernel="torch.native.flowgrpo_sde.mean", constraints=(_rule_is("sde", "flow_grpo"),))
def flow_sde_step_logp_production(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    rule: str = "sde",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-GRPO's ``sde_step_with_logprob`` ('sde' branch) as written upstream (numerics §4).

    Same signature, meaning and outputs as ``flow_sde_step_logp_strict``; the expression is
    Flow-GRPO's on [B, 1, ..., 1]-shaped schedule tensors, ``torch.log`` for ln s and
    ln(sqrt(2·fp32(π))), and ``torch.mean`` over the non-batch dims for logp. ``x_next``, ``mu``
    and ``std_t`` are byte-equal to strict; ``logp`` agrees to the declared tolerance.
    The pinned ``noise`` replaces Flow-GRPO's global-RNG draw.

    ``rule="sde"`` (default): η = 0 is the FP32 Euler step (noise ignored), as strict.
    ``rule="flow_grpo"``: η = 0 runs the same expression as η > 0 (std_t = 0, so mu = x + Δσ·v
    and x_next = mu + 0·noise) and needs ``noise`` or ``prev_sample`` — Flow-GRPO's Qwen-Image
    rollout calls the step that way outside its SDE window (numerics §4.1); logp is then NaN
    (0/0), absent, as in Flow-GRPO where it is discarded.

    Raises:
        ValueError: as strict; ``rule="flow_grpo"`` without noise or prev_sample.
        UnsupportedConfigError: as strict (σ ordering, sigma_max).
    """
    v32, x32, s, sn, sm, eta = _prepare_sde(
        v, x, sigma, sigma_next, eta, sigma_max, noise, prev_sample, strict=False
    )
    if eta == 0.0 and rule == "sde":
        return _euler(v32, x32, s, sn, prev_sample)
    if noise is None and prev_sample is None:
        raise ValueError("flow_sde_step_logp: rule 'flow_grpo' draws its step noise at every step: "
                         "give noise (sampling) or prev_sample (replay)")
    nd = x32.dim()
    sigma_b = _bcast(s, nd)
    sigma_prev = _bcast(sn, nd)
    sigma_max_b = _bcast(sm, nd)
    dt = sigma_prev - sigma_b
    eta32 = torch.tensor(eta, dtype=torch.float32, device=x32.device)
    std_dev_t = torch.sqrt(sigma_b / (1 - torch.where(sigma_b == 1, sigma_max_b, sigma_b))) * eta32
    mu = x32 * (1 + std_dev_t**2 / (2 * sigma_b) * dt) + v32 * (
        1 + std_dev_t**2 * (1 - sigma_b) / (2 * sigma_b)
    ) * dt
    if prev_sample is None:
        x_next = mu + std_dev_t * torch.sqrt(-1 * dt) * noise
    else:
        x_next = prev_sample.to(torch.float32)
    x_next = x_next.detach()
    elem = (
        -((x_next - mu) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=torch.float32)))
    )
    logp = elem.mean(dim=tuple(range(1, nd)))
    return x_next, logp, mu, std_dev_t.reshape(-1)


def _sigma_scalar(value: float | torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """A sigma as a 0-dim fp32 tensor on ``device`` (the scheduler's own sigmas live on the
    execution device); a [B] tensor must hold one value."""
    t = value.detach().to(torch.float32) if isinstance(value, torch.Tensor) \
        else torch.tensor(float(value), dtype=torch.float32)
    if t.dim() > 0:
        flat = t.reshape(-1)
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            raise UnsupportedConfigError(
                f"flow_sde_step_logp (diffusers_euler): {what} must be one value for the batch "
                f"(diffusers' scheduler steps every row with one sigma), got {t.tolist()}")
        t = flat[0]
    return t.reshape(()).to(device)


@implements("flow_sde_step_logp", "production", device=("cpu", "cuda"),
            kernel="torch.native.diffusers_scheduler_step", constraints=(_rule_is("diffusers_euler"),))
def flow_euler_step_diffusers(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    rule: str = "diffusers_euler",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``FlowMatchEulerDiscreteScheduler.step`` (deterministic, numerics §3.4) as the
    ``diffusers_euler`` rule of ``flow_sde_step_logp`` (production family).

    Args:
        v: [B, N, C] velocity in the model dtype (bf16 in a bf16 pipeline; the CFG-combined one).
        x: [B, N, C] latents x_t (the pipeline keeps them in the model dtype).
        sigma, sigma_next: σ_i and σ_{i+1}: python floats, 0-dim tensors or [B] tensors holding
            one value; used as 0-dim fp32 tensors on the latents' device, as the scheduler's.
        eta: must be 0 (the pipeline's step is deterministic). sigma_max: unused.
        noise: must be None. prev_sample: the stored next latent (replay), returned as x_next.

    Returns:
        ``(x_next, logp, mu, std_t)``: mu [B, N, C] fp32 = fp32(x) + Δσ·v (the scheduler's
        ``prev_sample`` before its cast), x_next = mu.to(v.dtype) [B, N, C] (or
        ``prev_sample``), logp [B] NaN (absent: a deterministic step has no density), std_t [B]
        fp32 zeros.

    Arithmetic (diffusers' expression, verbatim): Δσ = σ_{i+1} − σ_i (0-dim fp32); the product
    Δσ·v has v's dtype by type promotion (a 0-dim tensor does not promote a dimensioned one), so
    in a bf16 pipeline it is rounded to bf16 before the FP32 addition; the sum is cast to v's
    dtype.

    Raises:
        ValueError: v and x shapes differ; noise given.
        UnsupportedConfigError: eta ≠ 0; per-row sigmas that differ; not 0 ≤ σ' < σ ≤ 1.
    """
    if v.shape != x.shape or v.dim() < 2:
        raise ValueError(f"flow_sde_step_logp: v {tuple(v.shape)} and x {tuple(x.shape)} must match, [B, ...]")
    if float(eta) != 0.0:
        raise UnsupportedConfigError(
            f"flow_sde_step_logp (diffusers_euler): diffusers' scheduler.step is deterministic, "
            f"eta must be 0, got {eta}")
    if noise is not None:
        raise ValueError("flow_sde_step_logp (diffusers_euler): the deterministic step takes no noise")
    s = _sigma_scalar(sigma, x.device, "sigma")
    sn = _sigma_scalar(sigma_next, x.device, "sigma_next")
    if not bool((sn >= 0) & (sn < s) & (s <= 1)):
        raise UnsupportedConfigError(
            f"flow_sde_step_logp: needs 0 <= sigma_next < sigma <= 1, got sigma={float(s)}, "
            f"sigma_next={float(sn)}")
    dt = sn - s  # 0-dim fp32
    mu = x.to(torch.float32) + dt * v  # dt * v in v's dtype, the addition in fp32
    x_next = mu.to(v.dtype) if prev_sample is None else prev_sample
    B = x.shape[0]
    logp = torch.full((B,), math.nan, dtype=torch.float32, device=x.device)
    std_t = torch.zeros(B, dtype=torch.float32, device=x.device)
    return x_next.detach(), logp, mu, std_t
