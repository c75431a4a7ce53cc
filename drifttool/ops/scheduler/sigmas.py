"""The FP32 sigma table (``flow_sigma_table``, numerics §3.3) and the model's timestep input
(``timestep_input``, numerics §3.4, §5 trap 2).

    >>> flow_sigma_table(10, 1024)          # 512²
    tensor([1.0000, 0.9290, 0.8515, 0.7666, 0.6733, 0.5701, 0.4555, 0.3274, 0.1833, 0.0200, 0.0000])
    >>> timestep_input(0.9897, "pipeline_bf16")
    tensor(0.9883)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implements


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
    # single correctly rounded fp32 op. A table that comes out non-finite is refused below, so
    # numpy's warnings about it are silenced (the arithmetic is the same).
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        e_mu = np.float32(math.exp(mu) if mu < 709.0 else math.inf)  # fp32 inf past μ ≈ 88.7 either way
        s1 = e_mu / (e_mu + (one / s0 - one))
        if shift_terminal:
            one_minus = one - s1
            scale = one_minus[-1] / np.float32(1.0 - shift_terminal)
            s1 = one - one_minus / scale
    out = np.concatenate([s1.astype(np.float32), np.zeros(1, np.float32)])  # [N+1], trailing +0
    assert out.dtype == np.float32
    if not np.isfinite(out).all():
        why = ("e^mu overflows fp32" if not np.isfinite(e_mu) else
               "e^mu / (e^mu + 1/sigma - 1) rounds to 1 in fp32 at the last step, so the stretch to the "
               f"terminal sigma {shift_terminal:g} divides by 1 - 1 = 0; diffusers' "
               "FlowMatchEulerDiscreteScheduler computes the same NaN")
        raise UnsupportedConfigError(
            f"the scheduler's dynamic shift (mu = {mu:.4f} for {int(image_seq_len)} image tokens) makes "
            f"the {num_steps}-step sigma table non-finite ({why})")
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
        UnsupportedConfigError: ``num_steps == 1`` with a terminal stretch (0/0); a table that
            is not finite: past about 3.3e5 image tokens (3 steps; 4.0e5 at 50) e^μ/(e^μ + N − 1)
            rounds to 1 in fp32 and the terminal stretch divides by 0, where diffusers' scheduler
            returns NaN.
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

