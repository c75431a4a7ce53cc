"""Independent FP64 reference math for the sampler operators, written from the numerics spec.

    >>> flow_sigma_table_ref(10, 1024)[:3]
    array([1.        , 0.92896964, 0.85148479])

Plain numpy, binary64 by default; used only to judge accuracy (tolerances are declared by the
tests). This module never imports ``drifttool.ops`` or ``drifttool.model``, and it deliberately
uses the algebraically simplified forms of the spec rather than the operators' written order:

* sigma table (numerics §3.3): μ = 0.5 + 0.4·(n − 256)/(8192 − 256); σ¹ = e^μ/(e^μ + 1/σ⁰ − 1);
  σ = 1 − (1 − σ¹)·(1 − 0.02)/(1 − σ¹_last); trailing 0. ``dtype=np.float32`` instead evaluates
  the spec's numpy-fp32 recipe op by op (that one is bit-equal to diffusers).
* CFG (§3.4): comb = u + s(c − u), v = comb·‖c‖/‖comb‖ per token over the channel axis.
* SDE step (§4): μ = x + Δv + Δ·(std²/(2σ))·(x + (1 − σ)v), std = η·sqrt(σ/(1 − σ̃)),
  s = std·sqrt(−Δ), logp = mean over non-batch dims of the Gaussian log-density.
"""

from __future__ import annotations

import math

import numpy as np


def flow_shift_mu_ref(
    image_seq_len: int,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
) -> float:
    """μ of the dynamic shift, linear in the image token count, not clamped (binary64)."""
    return base_shift + (max_shift - base_shift) * (image_seq_len - base_seq_len) / (
        max_seq_len - base_seq_len
    )


def flow_sigma_table_ref(
    num_steps: int,
    image_seq_len: int,
    *,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
    shift_terminal: float | None = 0.02,
    dtype=np.float64,
) -> np.ndarray:
    """Sigma table [N+1] (numerics §3.3).

    ``dtype=np.float64``: every step in binary64 from the float64 linspace (the accuracy oracle).
    ``dtype=np.float32``: the spec's recipe evaluated op by op in numpy fp32 (σ⁰ cast to fp32,
    e^μ rounded to fp32), i.e. what the scheduler computes.
    """
    if dtype not in (np.float64, np.float32):
        raise ValueError("dtype must be np.float64 or np.float32")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    mu = image_seq_len * m + (base_shift - m * base_seq_len) if dtype is np.float32 else (
        flow_shift_mu_ref(image_seq_len, base_shift, max_shift, base_seq_len, max_seq_len)
    )
    base = np.linspace(1.0, 1.0 / num_steps, num_steps)
    if dtype is np.float64:
        e = math.exp(mu)
        shifted = e / (e + (1.0 / base - 1.0))
        if shift_terminal:
            shifted = 1.0 - (1.0 - shifted) * (1.0 - shift_terminal) / (1.0 - shifted[-1])
        return np.append(shifted, 0.0)
    f = np.float32
    s0 = base.astype(f)
    e = f(math.exp(mu))
    shifted = np.divide(e, np.add(e, np.subtract(np.divide(f(1), s0), f(1))))
    if shift_terminal:
        omz = np.subtract(f(1), shifted)
        r = np.divide(omz[-1], f(1.0 - shift_terminal))
        shifted = np.subtract(f(1), np.divide(omz, r))
    return np.append(shifted.astype(f), f(0)).astype(f)


def cfg_combine_renorm_ref(v_cond, v_uncond, scale: float) -> np.ndarray:
    """CFG combine + per-token renorm in binary64 (numerics §3.4); inputs any float array
    [..., C], returned float64 of the same shape. No epsilon."""
    c = np.asarray(v_cond, dtype=np.float64)
    u = np.asarray(v_uncond, dtype=np.float64)
    comb = u + float(scale) * (c - u)
    nc = np.sqrt(np.sum(c * c, axis=-1, keepdims=True))
    nm = np.sqrt(np.sum(comb * comb, axis=-1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        return comb * (nc / nm)


def flow_sde_step_logp_ref(
    v,
    x,
    sigma,
    sigma_next,
    *,
    eta: float,
    sigma_max: float,
    noise=None,
    prev_sample=None,
):
    """Flow-GRPO 'sde' step and log-prob in binary64 (numerics §4).

    Args: as the operator (arrays [B, ...], sigma/sigma_next scalars or [B]).
    Returns: ``(x_next, logp [B], mu, std_t [B])`` float64. With ``eta == 0``: Euler x + Δv,
    std_t 0 and logp NaN (undefined).
    """
    v = np.asarray(v, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    B = x.shape[0]
    shape = (B,) + (1,) * (x.ndim - 1)
    s = np.broadcast_to(np.asarray(sigma, dtype=np.float64), (B,))
    sn = np.broadcast_to(np.asarray(sigma_next, dtype=np.float64), (B,))
    dt = sn - s
    if eta == 0:
        mu = x + dt.reshape(shape) * v
        x_next = mu if prev_sample is None else np.asarray(prev_sample, dtype=np.float64)
        return x_next, np.full(B, np.nan), mu, np.zeros(B)
    s_tilde = np.where(s == 1.0, float(sigma_max), s)
    std = eta * np.sqrt(s / (1.0 - s_tilde))
    k = (std * std / (2.0 * s)).reshape(shape)
    sb, dtb = s.reshape(shape), dt.reshape(shape)
    mu = x + dtb * v + dtb * k * (x + (1.0 - sb) * v)
    scale = (std * np.sqrt(-dt)).reshape(shape)
    if prev_sample is None:
        x_next = mu + scale * np.asarray(noise, dtype=np.float64)
    else:
        x_next = np.asarray(prev_sample, dtype=np.float64)
    dens = -((x_next - mu) ** 2) / (2.0 * scale**2) - np.log(scale) - 0.5 * np.log(2.0 * np.pi)
    logp = dens.reshape(B, -1).mean(axis=1)
    return x_next, logp, mu, std
