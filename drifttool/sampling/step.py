"""One denoising step of the sampler: the model forward(s) per CFG branch, the CFG combine, the
SDE step with its logp, and the step records.

    >>> out = run_step(sampler_model(model), rt, inputs, cfg, cfg_on=True, phase="rollout", i=3,
    ...                sigmas=sigmas, tau_all=tau, x=x_3, prev_sample=None)
    >>> out.x_next.shape, out.logp.shape          # x_4 [B, N, Cp] and logp_3 [B]
    (torch.Size([2, 1024, 64]), torch.Size([2]))

Per step i (numerics §3.4, §4, §4.1), inside ``rt.scope(phase, step=i, sigma=σ_i, ...)``:

1. τ = ``timestep_input(σ_i, cfg.timestep_policy)`` for every row.
2. The model per CFG branch: ``cfg_layout="batched"`` runs one forward on [cond; uncond] (rows
   ``sample_ids + sample_ids``, prompts right-padded to a common length with a key mask, scope
   ``branch`` = a tuple with one entry per row: ``("cond",)*B + ("uncond",)*B``; scope
   ``txt_lens``/``txt_starts`` = each row's valid prompt rows, read from the padded mask the
   model receives);
   ``"sequential"`` runs two forwards (scope branch ``"cond"`` then ``"uncond"``). Condition
   latents (edit runs, ``RolloutInputs.cond``) go to every forward of both branches as
   ``model(..., cond=, cond_grids=)``, with scope ``cond_grids``. With a
   batch-invariant, padding-invariant (strict) model both give the same bytes. Under a
   CFG-parallel plan each rank runs its own branch and the velocities are gathered.
3. ``call(rt, "cfg_combine_renorm", v_c, v_u, s)`` under branch ``"cfg"`` (CFG on iff
   ``cfg_scale > 1`` and negative prompt embeddings are given; else v = v_cond). It, the sigma
   table and the SDE step run under block ``SAMPLER_BLOCK``: the sampler sits outside the model.
4. ``call(rt, "flow_sde_step_logp", v, x, σ_i, σ_{i+1}, eta=η_i, sigma_max=σ_1, noise=ε_i)``
   with η_i = ``cfg.eta`` inside the SDE window and 0 outside (deterministic Euler, logp absent);
   a recompute passes ``prev_sample`` = the stored next latent instead of noise.
5. ``rt.recorder.record_step(...)`` per logical sample (docs/architecture.md "Step records"):
   the step record under branch ``"cfg"`` (``"cond"`` when CFG is off) holds x_t, v_t, x_next,
   mu, std_t and — only inside the SDE window — logp_t; with CFG on, ``"cond"`` and
   ``"uncond"`` records hold the branch velocities. Then ``rt.recorder.flush()``, so an
   interrupted run keeps every finished step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

import drifttool.ops.scheduler  # noqa: F401  (registers the sampler operators)
from drifttool.distributed.canonical import gather_list_replicated
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.runtime import Runtime
from drifttool.sampling.config import SAMPLER_BLOCK, SamplerConfig
from drifttool.sampling.inputs import RolloutInputs


@dataclass(kw_only=True)
class StepOutput:
    """What one sampler step produced (batched); passed to the step callback. x and x_next are
    in ``SamplerConfig.latents_dtype`` (fp32 by default), the velocities in the model dtype or
    fp32, mu, std_t and logp fp32."""

    step: int
    sigma: float
    sigma_next: float
    in_window: bool
    x: torch.Tensor  # [B, N, Cp] x_t
    v: torch.Tensor  # [B, N, Cp] velocity used by the step (CFG-combined when CFG is on)
    v_cond: torch.Tensor  # [B, N, Cp]
    v_uncond: torch.Tensor | None  # [B, N, Cp] or None
    x_next: torch.Tensor  # [B, N, Cp] the stored next latent (in the latents dtype)
    mu: torch.Tensor  # [B, N, Cp]
    std_t: torch.Tensor  # [B]
    logp: torch.Tensor  # [B], NaN outside the window


StepCallback = Callable[[StepOutput], Any]


def cfg_enabled(inputs: RolloutInputs, cfg: SamplerConfig) -> bool:
    """Whether the sampler runs CFG (two branches per step): scale > 1 and a negative prompt."""
    return cfg.cfg_scale > 1 and inputs.neg_txt is not None


def txt_rows(txt: torch.Tensor, mask: torch.Tensor | None) -> dict[str, list[int] | None]:
    """Scope fields ``txt_lens`` and ``txt_starts`` (None when every prompt starts at row 0) of
    [B, L, D] prompts from their [B, L] bool mask: the valid tokens of a row are one run of
    ``txt_lens[b]`` rows from ``txt_starts[b]`` (right- or left-padded prompts).

    Raises:
        UnsupportedConfigError: a mask whose valid tokens are not one contiguous run.
    """
    B, L = txt.shape[:2]
    if mask is None:
        return {"txt_lens": [int(L)] * B, "txt_starts": None}
    mask = mask.detach().to("cpu", torch.bool)  # one host read; the rest is host work
    lens = [int(n) for n in mask.sum(dim=1).tolist()]
    starts = [int(torch.argmax(row.to(torch.uint8))) if n else 0 for row, n in zip(mask, lens)]
    for b, (t0, n) in enumerate(zip(starts, lens)):
        if not bool(mask[b, t0:t0 + n].all()):
            raise UnsupportedConfigError(
                f"prompt mask of batch row {b} has gaps: its valid tokens must be one contiguous "
                "run (right- or left-padded prompts)")
    return {"txt_lens": lens, "txt_starts": starts if any(starts) else None}


def _prompt_rows(inputs: RolloutInputs, negative: bool) -> dict[str, list[int] | None]:
    """``txt_rows`` of the prompts (or negative prompts) of ``inputs``, read from the mask once
    per rollout: the masks do not change between steps, and reading a device mask is a host
    synchronisation. The memo is keyed by the mask's identity and version counter."""
    txt, mask = (inputs.neg_txt, inputs.neg_mask) if negative else (inputs.txt, inputs.txt_mask)
    key = (negative, id(txt), tuple(txt.shape), id(mask), None if mask is None else mask._version)
    memo = inputs.__dict__.setdefault("_txt_rows_memo", {})
    if key not in memo:
        if len(memo) >= 4:
            memo.clear()
        memo[key] = (txt, mask, txt_rows(txt, mask))  # holding them: their ids stay theirs
    return memo[key][2]


def _stacked_rows(rows_c: dict, rows_u: dict) -> dict[str, list[int] | None]:
    """``txt_rows`` of [cond; uncond] prompts right-padded to one length: each row's valid run
    is unchanged by the padding, so the fields are the two branches' fields concatenated."""
    starts = [*(rows_c["txt_starts"] or [0] * len(rows_c["txt_lens"])),
              *(rows_u["txt_starts"] or [0] * len(rows_u["txt_lens"]))]
    return {"txt_lens": [*rows_c["txt_lens"], *rows_u["txt_lens"]],
            "txt_starts": starts if any(starts) else None}


def _pad_txt(txt: torch.Tensor, mask: torch.Tensor | None, length: int):
    """Right-pad [B, L, D] prompts (zeros) and masks (False) to ``length``."""
    B, L, D = txt.shape
    if mask is None:
        mask = torch.ones(B, L, dtype=torch.bool, device=txt.device)
    if L == length:
        return txt, mask
    txt = torch.cat([txt, txt.new_zeros(B, length - L, D)], dim=1)  # [B, length, D]
    mask = torch.cat([mask, mask.new_zeros(B, length - L)], dim=1)  # [B, length]
    return txt, mask

def sampler_model(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The model as the sampler calls it: latents stay FP32 between steps; they and the prompt
    embeddings are cast to the model dtype W at the model input (the cast point of the
    pipeline), and the velocity comes back in W (the SDE step upcasts it, numerics §4).
    Condition latents (``cond=``, with ``cond_grids=``) are cast to W likewise."""
    w = model.dtype

    def forward(x, txt, txt_mask, tau, img_grid, rt, **conditions):
        if conditions.get("cond") is not None:
            conditions = {**conditions, "cond": conditions["cond"].to(w)}
        return model(x.to(w), txt.to(w), txt_mask, tau, img_grid, rt, **conditions)

    return forward

def _velocities(model, rt, x, tau, inputs, cfg, cfg_on, scope):
    """Model forward(s) and CFG combine; returns (v, v_cond, v_uncond)."""
    B = inputs.batch
    ids = list(inputs.sample_ids)
    grid = tuple(inputs.img_grid)
    kw = inputs.model_kwargs()  # condition latents (edit runs), else empty
    if kw and rt.plan is not None and rt.plan.dims.sp > 1:
        raise UnsupportedConfigError("condition images under sequence parallelism (sp > 1) are not "
                                     "supported: run an edit rollout with sp = 1")
    sampler_scope, scope = scope, {**scope, "cond_grids": tuple(inputs.cond_grids) or None}
    rows_c = _prompt_rows(inputs, negative=False)
    if not cfg_on:
        with rt.scope(**scope, branch="cond", samples=ids, **rows_c):
            v_c = model(x, inputs.txt, inputs.txt_mask, tau, grid, rt, **kw)
        return v_c, v_c, None
    rows_u = _prompt_rows(inputs, negative=True)
    plan = rt.plan
    if plan is not None and plan.dims.cfg > 1:
        # CFG-parallel: this rank runs its branch's forward (the identities of sequential CFG),
        # then the branch velocities are gathered in branch order on every CFG rank
        mine = ("cond", "uncond")[plan.coords["cfg"]]
        runs = ("uncond", "cond")[plan.coords["cfg"]] if "cfg_branch_swap" in plan.faults else mine
        txt, mask, rows = ((inputs.txt, inputs.txt_mask, rows_c) if runs == "cond"
                           else (inputs.neg_txt, inputs.neg_mask, rows_u))
        with rt.scope(**scope, branch=mine, samples=ids, **rows):
            v_mine = model(x, txt, mask, tau, grid, rt, **kw)
        v_c, v_u = gather_list_replicated(v_mine, plan.groups["cfg"])  # differentiable
    elif cfg.cfg_layout == "batched":
        L = max(inputs.txt.shape[1], inputs.neg_txt.shape[1])
        if inputs.txt_mask is None and inputs.neg_mask is None and inputs.txt.shape[1] == L \
                and inputs.neg_txt.shape[1] == L:
            txt2, mask2 = torch.cat([inputs.txt, inputs.neg_txt]), None  # [2B, L, D]
        else:
            tc, mc = _pad_txt(inputs.txt, inputs.txt_mask, L)
            tu, mu_ = _pad_txt(inputs.neg_txt, inputs.neg_mask, L)
            txt2, mask2 = torch.cat([tc, tu]), torch.cat([mc, mu_])  # [2B, L, D], [2B, L]
        branches = ("cond",) * B + ("uncond",) * B
        # right padding keeps every prompt's valid run where it was: the rows of [cond; uncond]
        rows = _stacked_rows(rows_c, rows_u)
        with rt.scope(**scope, branch=branches, samples=ids + ids, **rows):
            v2 = model(torch.cat([x, x]), txt2, mask2, torch.cat([tau, tau]), grid, rt,
                       **inputs.model_kwargs(repeat=2))
            # v2: [2B, N, Cp]
        v_c, v_u = v2[:B], v2[B:]
    else:
        with rt.scope(**scope, branch="cond", samples=ids, **rows_c):
            v_c = model(x, inputs.txt, inputs.txt_mask, tau, grid, rt, **kw)
        with rt.scope(**scope, branch="uncond", samples=ids, **rows_u):
            v_u = model(x, inputs.neg_txt, inputs.neg_mask, tau, grid, rt, **kw)
    with rt.scope(**sampler_scope, branch="cfg", block=SAMPLER_BLOCK, samples=ids, txt_lens=None):
        v = call(rt, "cfg_combine_renorm", v_c, v_u, float(cfg.cfg_scale),
                 stream="img", layout="BS.")
    return v, v_c, v_u


def _record(rt: Runtime, phase: str, out: StepOutput, ids: list[int], cfg_on: bool) -> None:
    rec = rt.recorder
    if rec is None or not rt.mode.captures or (rt.plan is not None and not rt.plan.is_root):
        return  # under a parallel plan every rank holds the step's tensors; the root records them
    step_branch = "cfg" if cfg_on else "cond"
    common = dict(phase=phase, step=out.step, sigma=out.sigma, sigma_next=out.sigma_next,
                  rank=int(rt.rank))
    for b, sid in enumerate(ids):
        q = {"x_t": out.x[b].detach(), "v_t": out.v[b].detach(), "x_next": out.x_next[b].detach(),
             "mu": out.mu[b].detach(), "std_t": out.std_t[b].detach()}
        if out.in_window:
            q["logp_t"] = out.logp[b].detach()
        rec.record_step(**common, sample=sid, branch=step_branch, quantities=q)
        if cfg_on:
            rec.record_step(**common, sample=sid, branch="cond",
                            quantities={"v_t": out.v_cond[b].detach()})
            rec.record_step(**common, sample=sid, branch="uncond",
                            quantities={"v_t": out.v_uncond[b].detach()})


def _rank_noise(plan: Any, noise: torch.Tensor, step: int) -> torch.Tensor:
    """Probe fault ``noise_per_rank``: a rank other than the root draws its own noise (seeded
    by its global rank and the step) instead of the logical samples' pinned noise."""
    if plan.is_root:
        return noise
    g = torch.Generator().manual_seed(7919 * plan.mesh_rank + step)
    return torch.randn(noise.shape, generator=g).to(dtype=noise.dtype, device=noise.device)


def run_step(model: Callable[..., torch.Tensor], rt: Runtime, inputs: RolloutInputs,
             cfg: SamplerConfig, cfg_on: bool, phase: str, i: int, sigmas: torch.Tensor,
             tau_all: torch.Tensor, x: torch.Tensor, prev_sample: torch.Tensor | None) -> StepOutput:
    """Step ``i`` (see the module docstring): forward(s), CFG, the SDE step, step records, flush.

    Args:
        model: as ``rollout.rollout`` takes it (``sampler_model``).
        cfg_on: ``cfg_enabled(inputs, cfg)``.
        phase: scope phase, ``"rollout"`` or the recompute's (``"train"``).
        sigmas: [num_steps + 1] fp32 sigma table, on the CPU (its scalars are read and checked on
            the host: a device table would cost host synchronisations every step);
            tau_all: [num_steps] fp32 model timesteps, on the model's device.
        x: [B, N, Cp] x_t in ``cfg.latents_dtype``.
        prev_sample: ``None`` to sample x_next with the pinned noise of ``inputs``; a recompute
            passes the stored x_{t+1} [B, N, Cp] (its logp is then the transition's).

    Returns:
        ``StepOutput`` with x_next cast to ``cfg.latents_dtype``.

    Raises:
        UnsupportedConfigError: from the operators (strict checks, missing backend).
    """
    ids = list(inputs.sample_ids)
    s_i, s_n = sigmas[i], sigmas[i + 1]
    in_win = cfg.in_window(i)
    scope = dict(phase=phase, step=i, sigma=float(s_i), img_grid=tuple(inputs.img_grid))
    tau = tau_all[i].expand(inputs.batch).contiguous()  # [B] fp32
    v, v_c, v_u = _velocities(model, rt, x, tau, inputs, cfg, cfg_on, scope)
    noise = inputs.noise_at(i) if (cfg.noise_at_step(i) and prev_sample is None) else None
    if noise is not None and rt.plan is not None and "noise_per_rank" in rt.plan.faults:
        noise = _rank_noise(rt.plan, noise, i)
    rule = {} if cfg.step_rule == "sde" else {"rule": cfg.step_rule}
    with rt.scope(**scope, branch="cfg" if cfg_on else "cond", block=SAMPLER_BLOCK, samples=ids,
                  txt_lens=None):
        x_next, logp, mu, std_t = call(
            rt, "flow_sde_step_logp", v, x, s_i, s_n, eta=cfg.eta_at(i), sigma_max=sigmas[1],
            noise=noise, prev_sample=prev_sample, stream="img", layout=("BS.", "B", "BS.", "B"),
            **rule,
        )
    # the stored latent: Flow-GRPO casts its FP32 x' back to the latents dtype (logp was taken
    # on the FP32 x'); diffusers' step already returns it (a no-op cast by default)
    x_next = x_next.to(cfg.latents_torch_dtype)
    out = StepOutput(step=i, sigma=float(s_i), sigma_next=float(s_n), in_window=in_win, x=x, v=v,
                     v_cond=v_c, v_uncond=v_u, x_next=x_next, mu=mu, std_t=std_t, logp=logp)
    _record(rt, phase, out, ids, cfg_on)
    if rt.recorder is not None:
        rt.recorder.flush()
    return out
