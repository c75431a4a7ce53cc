"""Sampler variants: mistakes in the sigma schedule, CFG, step precision and noise, each with the
signature of the operator it replaces (``drifttool.probes.variants.Variant``).

    >>> from drifttool.runner import RunSpec, execute
    >>> v = CfgRenormOff()
    >>> execute(RunSpec(variants={v.op: v.entry()}), "runs/cfg_renorm_off")
    # trace: cfg_combine_renorm actual="variant:cfg_renorm_off"

=========================  =====================  ====================================================
variant                    operator               the mistake (source)
=========================  =====================  ====================================================
sigma_seq_len_pixels       flow_sigma_table       dynamic shift from H'·W' latent pixels (4N) instead
                                                  of N packed tokens (§3.3)
cfg_renorm_off             cfg_combine_renorm     no rescale to ‖v_cond‖ (§3.4)
cfg_renorm_global          cfg_combine_renorm     one norm over the whole image, not per token (§5.12)
euler_bf16_product         flow_sde_step_logp     deterministic step as diffusers' scheduler: Δσ·v in
                                                  bf16, latents back to bf16 (§3.4, §5.4)
latents_bf16               flow_sde_step_logp     next latent stored in bf16 between steps (§5.3)
noise_global_rng           flow_sde_step_logp     SDE noise from one generator consumed in batch and
                                                  step order (Flow-GRPO's global RNG, §4.1), not the
                                                  pinned per-sample streams
=========================  =====================  ====================================================
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.strict_math import sqrt32, tree_sum
from drifttool.probes.variants import Variant


# ---------------------------------------------------------------------------------------------
# sigma schedule, CFG, step precision, noise


class SigmaSeqLenPixels(Variant):
    """Dynamic shift μ computed from the latent pixel count H'·W' = 4N instead of the N packed
    tokens (numerics §3.3: image_seq_len = (H/16)(W/16))."""

    op = "flow_sigma_table"
    name = "sigma_seq_len_pixels"

    def __call__(self, num_steps, image_seq_len, *args, **kwargs):
        return self.base(num_steps, 4 * int(image_seq_len), *args, **kwargs)


def _cfg_combine(v_cond, v_uncond, scale):
    c = v_cond.to(torch.float32)
    u = v_uncond.to(torch.float32)
    s = torch.tensor(float(scale), dtype=torch.float32, device=c.device)
    return c, u + s * (c - u)  # [B, N, C] fp32


class CfgRenormOff(Variant):
    """Plain CFG u + s(c − u) without the rescale to ‖v_cond‖ per token (numerics §3.4)."""

    op = "cfg_combine_renorm"
    name = "cfg_renorm_off"

    def __call__(self, v_cond, v_uncond, scale):
        return _cfg_combine(v_cond, v_uncond, scale)[1]


class CfgRenormGlobal(Variant):
    """Rescale by norms over the whole image (all N·C values of a sample) instead of per token
    over the 64 channels (numerics §5.12); pairwise-tree sums and sqrt as strict."""

    op = "cfg_combine_renorm"
    name = "cfg_renorm_global"

    def __call__(self, v_cond, v_uncond, scale):
        c, comb = _cfg_combine(v_cond, v_uncond, scale)
        c_norm = sqrt32(tree_sum((c * c).flatten(1)))  # [B]
        comb_norm = sqrt32(tree_sum((comb * comb).flatten(1)))  # [B]
        return comb * (c_norm / comb_norm)[:, None, None]


class EulerBf16Product(Variant):
    """Deterministic (η = 0) steps as diffusers' FlowMatchEulerDiscreteScheduler computes them
    in a bf16 pipeline: x' = bf16(fp32(x) + bf16(Δσ · bf16(v))) — the product Δσ·v in bf16 by
    type promotion, the latents back in bf16 (numerics §3.4, §5.4). SDE steps unchanged."""

    op = "flow_sde_step_logp"
    name = "euler_bf16_product"

    def __call__(self, v, x, sigma, sigma_next, *, eta, sigma_max, noise=None, prev_sample=None):
        if float(eta) != 0.0 or prev_sample is not None:
            return self.base(v, x, sigma, sigma_next, eta=eta, sigma_max=sigma_max, noise=noise,
                             prev_sample=prev_sample)
        dt = torch.as_tensor(sigma_next, dtype=torch.float32) - torch.as_tensor(sigma, dtype=torch.float32)
        step = dt * v.to(torch.bfloat16)  # 0-dim fp32 × bf16 tensor → bf16 (type promotion)
        x_next = (x.to(torch.float32) + step).to(torch.bfloat16).to(torch.float32)  # [B, N, C]
        B = x.shape[0]
        logp = torch.full((B,), math.nan, dtype=torch.float32, device=x.device)
        return x_next, logp, x_next.clone(), torch.zeros(B, dtype=torch.float32, device=x.device)


class LatentsBf16(Variant):
    """The sampled next latent is stored in bf16 between steps (a bf16 pipeline's latents,
    numerics §5.3); log p_t is still evaluated on the fp32 sample, as Flow-GRPO does."""

    op = "flow_sde_step_logp"
    name = "latents_bf16"

    def __call__(self, *args, **kwargs):
        x_next, logp, mu, std = self.base(*args, **kwargs)
        return x_next.to(torch.bfloat16).to(torch.float32), logp, mu, std


class NoiseGlobalRng(Variant):
    """SDE step noise from one generator for the whole batch, consumed step by step in batch
    order (Flow-GRPO draws from the global RNG without a generator, numerics §4.1), instead of
    drifttool's pinned per-sample streams. Seeded with ``seed`` once per run."""

    op = "flow_sde_step_logp"
    name = "noise_global_rng"

    def __init__(self, seed: int = 386) -> None:
        super().__init__()
        self.gen = torch.Generator(device="cpu").manual_seed(int(seed))

    def __call__(self, v, x, sigma, sigma_next, *, eta, sigma_max, noise=None, prev_sample=None):
        if noise is not None:
            noise = torch.randn(x.shape, generator=self.gen, dtype=torch.float32).to(x.device)
        return self.base(v, x, sigma, sigma_next, eta=eta, sigma_max=sigma_max, noise=noise,
                         prev_sample=prev_sample)
