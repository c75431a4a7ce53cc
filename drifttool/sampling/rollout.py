"""Rollout (sampling) and training recompute of a Qwen-Image CFG/SDE trajectory.

    >>> traj = rollout(model, inputs, SamplerConfig(num_steps=10, cfg_scale=4.0, eta=1.2), rt)
    >>> traj.latents.shape, traj.logp.shape        # x_0..x_10, logp per step (NaN outside window)
    (torch.Size([11, 2, 1024, 64]), torch.Size([10, 2]))
    >>> re = recompute(model, inputs, traj.latents, cfg, rt)   # phase="train"
    >>> torch.equal(re.logp[:9].view(torch.int32), traj.logp[:9].view(torch.int32))   # strict
    True

Per step i (numerics §3.4, §4, §4.1), inside ``rt.scope(phase, step=i, sigma=σ_i, ...)``:

1. τ = ``timestep_input(σ_i, cfg.timestep_policy)`` for every row.
2. The model per CFG branch: ``cfg_layout="batched"`` runs one forward on [cond; uncond] (rows
   ``sample_ids + sample_ids``, prompts right-padded to a common length with a key mask, scope
   ``branch`` = a tuple with one entry per row: ``("cond",)*B + ("uncond",)*B``; scope
   ``txt_lens``/``txt_starts`` = each row's valid prompt rows, read from the padded mask the
   model receives);
   ``"sequential"`` runs two forwards (scope branch ``"cond"`` then ``"uncond"``). With a
   batch-invariant, padding-invariant (strict) model both give the same bytes.
3. ``call(rt, "cfg_combine_renorm", v_c, v_u, s)`` under branch ``"cfg"`` (CFG on iff
   ``cfg_scale > 1`` and negative prompt embeddings are given; else v = v_cond). It, the sigma
   table and the SDE step run under block ``SAMPLER_BLOCK``: the sampler sits outside the model.
4. ``call(rt, "flow_sde_step_logp", v, x, σ_i, σ_{i+1}, eta=η_i, sigma_max=σ_1, noise=ε_i)``
   with η_i = ``cfg.eta`` inside the SDE window and 0 outside (deterministic Euler, logp absent).
5. ``rt.recorder.record_step(...)`` per logical sample (docs/architecture.md "Step records"):
   the step record under branch ``"cfg"`` (``"cond"`` when CFG is off) holds x_t, v_t, x_next,
   mu, std_t and — only inside the SDE window — logp_t; with CFG on, ``"cond"`` and
   ``"uncond"`` records hold the branch velocities. Then ``rt.recorder.flush()`` if present,
   so an interrupted run keeps every finished step.

Latents stay fp32 between steps (``SamplerConfig.latents_dtype``; a production preset,
``drifttool.sampling.presets``, keeps them in the model dtype as the pipelines do: the step's
x_next is cast to it before it is stored and fed to the next step, while logp_t is computed on
the step's own FP32 x_next). ``SamplerConfig.step_rule`` picks the step's arithmetic
(``ops.scheduler.STEP_RULES``). ``recompute`` re-runs steps from stored latents with
``prev_sample`` = the stored next latent (Flow-GRPO's ``compute_log_prob``), gradients enabled,
under ``SamplerConfig.train_timestep_policy`` when one is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

import drifttool.ops.scheduler  # noqa: F401  (registers the sampler operators)
from drifttool.distributed.canonical import gather_list_replicated
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.ops.scheduler import STEP_RULES, TIMESTEP_POLICIES, timestep_input
from drifttool.runtime import Runtime
from drifttool.sampling.inputs import RolloutInputs

CFG_LAYOUTS = ("batched", "sequential")
LATENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes the latents may be kept in between steps (``SamplerConfig.latents_dtype``)."""
"""CFG execution layouts (``manifest_schema.CFG_LAYOUTS`` repeats them; a test checks they agree)."""
SAMPLER_BLOCK = -2
"""``block`` scope of the sampler operators (``flow_sigma_table``, ``cfg_combine_renorm``,
``flow_sde_step_logp``): outside the model. ``schema.SAMPLER_BLOCK`` repeats it for the torch-free
reader and diff (tests/sampling/test_layering.py checks they agree)."""


@dataclass(kw_only=True)
class SamplerConfig:
    """Sampler settings (one config per concept; every byte-changing choice is here).

    Attributes:
        num_steps: N denoising steps (the sigma table has N + 1 entries).
        cfg_scale: true-CFG scale s; CFG runs when s > 1 **and** negative prompt embeddings are
            given (diffusers' rule). Default 4.0 (pipeline default and Flow-GRPO's config).
        eta: SDE noise level η inside the window (Flow-GRPO ``noise_level``; 1.2 in
            ``pickscore_qwenimage``). 0 everywhere gives the deterministic Euler sampler.
        sde_window: half-open step range [start, end) where η applies; ``None`` = (0, N − 1):
            every step but the last (Flow-GRPO with window size 0, numerics §4.1).
        timestep_policy: model timestep encoding, see ``ops.scheduler.TIMESTEP_POLICIES``;
            training recompute must use the rollout's policy.
        cfg_layout: ``"batched"`` (one forward on [cond; uncond], as Flow-GRPO) or
            ``"sequential"`` (two forwards, as diffusers).
        image_seq_len: token count used for the dynamic shift; ``None`` = h·w of the grid.
        latents_dtype: dtype of the latents between steps (``LATENT_DTYPES``): x0 is cast to
            it, and every step's x_next is cast to it before it is stored and fed on.
        step_rule: the step's arithmetic, ``ops.scheduler.STEP_RULES`` (``"sde"``: drifttool's
            default; ``"flow_grpo"``/``"diffusers_euler"``: production kernels of the presets).
        train_timestep_policy: the timestep policy of ``recompute`` when it differs from the
            rollout's (Flow-GRPO's trainer: ``"t_div_1000_fp32"``); ``None`` = the same.
        preset: the ``drifttool.sampling.presets`` name these fields were set from (recorded;
            the rollout reads the fields, not the name); ``None`` = no preset.
    """

    num_steps: int
    cfg_scale: float = 4.0
    eta: float = 1.2
    sde_window: tuple[int, int] | None = None
    timestep_policy: str = "sigma_fp32"
    cfg_layout: str = "batched"
    image_seq_len: int | None = None
    latents_dtype: str = "float32"
    step_rule: str = "sde"
    train_timestep_policy: str | None = None
    preset: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 2:
            raise ValueError(f"num_steps must be an int >= 2, got {self.num_steps!r}")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.timestep_policy not in TIMESTEP_POLICIES:
            raise ValueError(f"timestep_policy {self.timestep_policy!r} not in {TIMESTEP_POLICIES}")
        if self.cfg_layout not in CFG_LAYOUTS:
            raise ValueError(f"cfg_layout {self.cfg_layout!r} not in {CFG_LAYOUTS}")
        if self.latents_dtype not in LATENT_DTYPES:
            raise ValueError(f"latents_dtype {self.latents_dtype!r} not in {tuple(LATENT_DTYPES)}")
        if self.step_rule not in STEP_RULES:
            raise ValueError(f"step_rule {self.step_rule!r} not in {STEP_RULES}")
        if self.step_rule == "diffusers_euler" and self.eta != 0:
            raise ValueError(f"step_rule 'diffusers_euler' is deterministic: eta must be 0, got {self.eta}")
        if self.train_timestep_policy is not None and self.train_timestep_policy not in TIMESTEP_POLICIES:
            raise ValueError(f"train_timestep_policy {self.train_timestep_policy!r} not in "
                             f"{TIMESTEP_POLICIES}")
        start, end = self.window()
        if not 0 <= start <= end <= self.num_steps:
            raise ValueError(f"sde_window {self.sde_window} outside [0, {self.num_steps}]")

    def window(self) -> tuple[int, int]:
        """The resolved SDE window [start, end)."""
        if self.sde_window is None:
            return (0, self.num_steps - 1)
        return (int(self.sde_window[0]), int(self.sde_window[1]))

    def in_window(self, step: int) -> bool:
        """Whether step ``step`` is stochastic (η > 0 applies and logp_t is defined)."""
        start, end = self.window()
        return start <= step < end and self.eta > 0

    def eta_at(self, step: int) -> float:
        return float(self.eta) if self.in_window(step) else 0.0

    @property
    def latents_torch_dtype(self) -> torch.dtype:
        """``latents_dtype`` as a torch dtype."""
        return LATENT_DTYPES[self.latents_dtype]

    def policy(self, phase: str) -> str:
        """The timestep policy of ``phase``: ``train_timestep_policy`` (if set) for a recompute,
        else ``timestep_policy``."""
        if phase != "rollout" and self.train_timestep_policy is not None:
            return self.train_timestep_policy
        return self.timestep_policy

    def noise_at_step(self, step: int) -> bool:
        """Whether a sampling step takes its pinned noise: inside the SDE window, or at every
        step under ``step_rule="flow_grpo"`` (Flow-GRPO draws one at every step)."""
        if self.step_rule == "diffusers_euler":
            return False
        return self.step_rule == "flow_grpo" or self.in_window(step)


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


@dataclass(kw_only=True)
class Trajectory:
    """Per-step results of a rollout or recompute (step axis first, batch rows = sample_ids).

    Attributes:
        phase: ``"rollout"`` or the recompute phase (``"train"``).
        sample_ids: logical sample id per batch row.
        cfg: whether CFG ran.
        sigmas: [num_steps + 1] fp32 sigma table; ``tau``: [num_steps] fp32 model timesteps.
        steps: indices of the steps held, in order (all of them unless stopped early or a
            subset was recomputed); the per-step tensors below follow this list.
        in_window, eta: per held step.
        latents: rollout: [len(steps) + 1, B, N, Cp] x_0 … x_k; recompute: the stored latents.
        velocities, v_cond, mu: [len(steps), B, N, Cp]; v_uncond likewise or None.
        std_t, logp: [len(steps), B]; logp is NaN outside the SDE window (absent, not a value).
        complete: every step 0 … num_steps − 1 is held.
    """

    phase: str
    sample_ids: list[int]
    cfg: bool
    sigmas: torch.Tensor
    tau: torch.Tensor
    steps: list[int]
    in_window: list[bool]
    eta: list[float]
    latents: torch.Tensor
    velocities: torch.Tensor
    v_cond: torch.Tensor
    v_uncond: torch.Tensor | None
    mu: torch.Tensor
    std_t: torch.Tensor
    logp: torch.Tensor
    complete: bool


StepCallback = Callable[[StepOutput], Any]


# ---------------------------------------------------------------------------------------------


def cfg_enabled(inputs: RolloutInputs, cfg: SamplerConfig) -> bool:
    """Whether the sampler runs CFG (two branches per step): scale > 1 and a negative prompt."""
    return cfg.cfg_scale > 1 and inputs.neg_txt is not None


def _txt_rows(txt: torch.Tensor, mask: torch.Tensor | None) -> dict[str, list[int] | None]:
    """Scope fields ``txt_lens`` and ``txt_starts`` (None when every prompt starts at row 0) of
    [B, L, D] prompts from their [B, L] bool mask: the valid tokens of a row are one run of
    ``txt_lens[b]`` rows from ``txt_starts[b]`` (right- or left-padded prompts).

    Raises:
        UnsupportedConfigError: a mask whose valid tokens are not one contiguous run.
    """
    B, L = txt.shape[:2]
    if mask is None:
        return {"txt_lens": [int(L)] * B, "txt_starts": None}
    lens = [int(n) for n in mask.sum(dim=1).tolist()]
    starts = [int(torch.argmax(row.to(torch.uint8))) if n else 0 for row, n in zip(mask, lens)]
    for b, (t0, n) in enumerate(zip(starts, lens)):
        if not bool(mask[b, t0:t0 + n].all()):
            raise UnsupportedConfigError(
                f"prompt mask of batch row {b} has gaps: its valid tokens must be one contiguous "
                "run (right- or left-padded prompts)")
    return {"txt_lens": lens, "txt_starts": starts if any(starts) else None}


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


def check_family(rt: Runtime, cfg: SamplerConfig) -> None:
    """A preset's sampler (or any non-default ``step_rule``/``latents_dtype``) reproduces a
    production pipeline's arithmetic: it runs under the production family only.

    Raises:
        UnsupportedConfigError: ``rt`` requests another family (strict, audit), one line.
    """
    custom = cfg.preset is not None or cfg.step_rule != "sde" or cfg.latents_dtype != "float32"
    if custom and rt.family != "production":
        what = f"preset {cfg.preset!r}" if cfg.preset else (
            f"step_rule {cfg.step_rule!r} with {cfg.latents_dtype} latents")
        raise UnsupportedConfigError(
            f"{what} reproduces a production pipeline's arithmetic (bf16 latents, its scheduler "
            f"step): mode {rt.mode.value!r} runs the {rt.family!r} family; use mode auto or off")


def _rank(rt: Runtime) -> int:
    return int(rt.rank)


def sigma_table(rt: Runtime, cfg: SamplerConfig, img_grid: tuple[int, int],
                phase: str = "rollout") -> torch.Tensor:
    """The [num_steps + 1] fp32 sigma table of ``cfg`` at ``img_grid``: one ``flow_sigma_table``
    call under ``rt`` (phase ``phase``, step −1, block ``SAMPLER_BLOCK``), so the table follows
    ``rt``'s mode, fallbacks and variants. ``rollout`` and ``recompute`` take their table from
    here, and so does the manifest (``drifttool.lifecycle.manifest_sigma_table``, on a silent
    runtime of the run's settings).

    Raises:
        UnsupportedConfigError: no backend of ``rt``'s mode (the operator's own checks).
    """
    h, w = img_grid
    seq = cfg.image_seq_len if cfg.image_seq_len is not None else h * w
    with rt.scope(phase=phase, step=-1, sigma=float("nan"), branch="none", block=SAMPLER_BLOCK,
                  samples=None, txt_lens=None, img_grid=tuple(img_grid)):
        return call(rt, "flow_sigma_table", cfg.num_steps, seq, stream="none", layout=".")


def sampler_model(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The model as the sampler calls it: latents stay FP32 between steps; they and the prompt
    embeddings are cast to the model dtype W at the model input (the cast point of the
    pipeline), and the velocity comes back in W (the SDE step upcasts it, numerics §4)."""
    w = model.dtype

    def forward(x, txt, txt_mask, tau, img_grid, rt):
        return model(x.to(w), txt.to(w), txt_mask, tau, img_grid, rt)

    return forward


def _velocities(model, rt, x, tau, inputs, cfg, cfg_on, scope):
    """Model forward(s) and CFG combine; returns (v, v_cond, v_uncond)."""
    B = inputs.batch
    ids = list(inputs.sample_ids)
    grid = tuple(inputs.img_grid)
    rows_c = _txt_rows(inputs.txt, inputs.txt_mask)
    if not cfg_on:
        with rt.scope(**scope, branch="cond", samples=ids, **rows_c):
            v_c = model(x, inputs.txt, inputs.txt_mask, tau, grid, rt)
        return v_c, v_c, None
    rows_u = _txt_rows(inputs.neg_txt, inputs.neg_mask)
    plan = rt.plan
    if plan is not None and plan.dims.cfg > 1:
        # CFG-parallel: this rank runs its branch's forward (the identities of sequential CFG),
        # then the branch velocities are gathered in branch order on every CFG rank
        mine = ("cond", "uncond")[plan.coords["cfg"]]
        runs = ("uncond", "cond")[plan.coords["cfg"]] if "cfg_branch_swap" in plan.faults else mine
        txt, mask, rows = ((inputs.txt, inputs.txt_mask, rows_c) if runs == "cond"
                           else (inputs.neg_txt, inputs.neg_mask, rows_u))
        with rt.scope(**scope, branch=mine, samples=ids, **rows):
            v_mine = model(x, txt, mask, tau, grid, rt)
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
        # the text rows capture keeps are read from the mask the model receives (after the pad)
        rows = _txt_rows(txt2, mask2)
        with rt.scope(**scope, branch=branches, samples=ids + ids, **rows):
            v2 = model(torch.cat([x, x]), txt2, mask2, torch.cat([tau, tau]), grid, rt)
            # v2: [2B, N, Cp]
        v_c, v_u = v2[:B], v2[B:]
    else:
        with rt.scope(**scope, branch="cond", samples=ids, **rows_c):
            v_c = model(x, inputs.txt, inputs.txt_mask, tau, grid, rt)
        with rt.scope(**scope, branch="uncond", samples=ids, **rows_u):
            v_u = model(x, inputs.neg_txt, inputs.neg_mask, tau, grid, rt)
    with rt.scope(**scope, branch="cfg", block=SAMPLER_BLOCK, samples=ids, txt_lens=None):
        v = call(rt, "cfg_combine_renorm", v_c, v_u, float(cfg.cfg_scale),
                 stream="img", layout="BS.")
    return v, v_c, v_u


def _record(rt: Runtime, phase: str, out: StepOutput, ids: list[int], cfg_on: bool) -> None:
    rec = rt.recorder
    if rec is None or not rt.mode.captures or (rt.plan is not None and not rt.plan.is_root):
        return  # under a parallel plan every rank holds the step's tensors; the root records them
    step_branch = "cfg" if cfg_on else "cond"
    common = dict(phase=phase, step=out.step, sigma=out.sigma, sigma_next=out.sigma_next,
                  rank=_rank(rt))
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


def _run_step(model, rt, inputs, cfg, cfg_on, phase, i, sigmas, tau_all, x, prev_sample):
    """One step: forward(s), CFG, SDE op, step records, flush. Returns a StepOutput."""
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
    flush = getattr(rt.recorder, "flush", None) if rt.recorder is not None else None
    if flush is not None:
        flush()
    return out


def _trajectory(phase, inputs, cfg, cfg_on, sigmas, tau_all, outs, latents) -> Trajectory:
    def stack(name):
        vals = [getattr(o, name) for o in outs]
        return torch.stack(vals) if vals else torch.empty(0)

    return Trajectory(
        phase=phase, sample_ids=list(inputs.sample_ids), cfg=cfg_on, sigmas=sigmas, tau=tau_all,
        steps=[o.step for o in outs], in_window=[o.in_window for o in outs],
        eta=[cfg.eta_at(o.step) for o in outs], latents=latents, velocities=stack("v"),
        v_cond=stack("v_cond"), v_uncond=stack("v_uncond") if cfg_on else None, mu=stack("mu"),
        std_t=stack("std_t"), logp=stack("logp"),
        complete=[o.step for o in outs] == list(range(cfg.num_steps)),
    )


def rollout(
    model: Callable[..., torch.Tensor],
    inputs: RolloutInputs,
    cfg: SamplerConfig,
    rt: Runtime,
    *,
    callback: StepCallback | None = None,
    max_steps: int | None = None,
) -> Trajectory:
    """Sample a CFG/SDE trajectory from pinned inputs (see the module docstring for each step).

    Args:
        model: ``model(x [B,N,Cp], txt [B,L,D], txt_mask [B,L] bool | None, tau [B] fp32,
            img_grid (h, w), rt) -> v [B,N,Cp]`` (docs/architecture.md).
        inputs: ``RolloutInputs`` (x0, prompts, masks, pinned noise).
        cfg: ``SamplerConfig``.
        rt: the runtime (mode picks strict/production operators; recorder gets step records).
        callback: called with each step's ``StepOutput`` after its records were flushed; an
            exception it raises propagates (the recorder keeps the finished steps).
        max_steps: stop after this many steps (partial trajectory, ``complete=False``).

    Returns:
        ``Trajectory`` (phase ``"rollout"``), computed under ``torch.no_grad()``.

    Raises:
        ValueError: inconsistent inputs, or a stochastic step without noise.
        UnsupportedConfigError: a preset under a family other than production
            (``check_family``); from the operators (strict dtype/domain checks, missing backend).
    """
    inputs.validate()
    check_family(rt, cfg)
    phase = "rollout"
    cfg_on = cfg_enabled(inputs, cfg)
    n_run = cfg.num_steps if max_steps is None else max(0, min(int(max_steps), cfg.num_steps))
    with torch.no_grad():
        sigmas = sigma_table(rt, cfg, inputs.img_grid, phase).to(inputs.x0.device)  # [S+1] fp32
        tau_all = timestep_input(sigmas[:-1], cfg.policy(phase))  # [S] fp32
        x = inputs.x0.to(cfg.latents_torch_dtype)  # the pipeline's latents cast (no-op in fp32)
        latents, outs = [x], []
        for i in range(n_run):
            out = _run_step(model, rt, inputs, cfg, cfg_on, phase, i, sigmas, tau_all, x, None)
            outs.append(out)
            x = out.x_next
            latents.append(x)
            if callback is not None:
                callback(out)
    return _trajectory(phase, inputs, cfg, cfg_on, sigmas, tau_all, outs, torch.stack(latents))


def rollout_step(
    model: Callable[..., torch.Tensor],
    inputs: RolloutInputs,
    cfg: SamplerConfig,
    rt: Runtime,
    step: int,
    x: torch.Tensor,
) -> StepOutput:
    """Re-execute one rollout step ``step`` from its input latent ``x`` [B, N, Cp] (the x_t a
    rollout recorded for that step, in its stored dtype): the sigma table (one
    ``flow_sigma_table`` call, step −1), then exactly the step ``rollout`` runs — forwards, CFG,
    the SDE step with the pinned noise of ``inputs`` (``prev_sample`` None) — with its records
    written under phase ``rollout``. Used by ``drifttool diff --localize`` to re-run the first
    drifting step of a run at a finer capture level.

    Raises:
        ValueError: ``step`` outside [0, num_steps), ``x`` not shaped as ``inputs.x0``, or
            inconsistent inputs.
        UnsupportedConfigError: from the operators.
    """
    inputs.validate()
    if not 0 <= int(step) < cfg.num_steps:
        raise ValueError(f"step {step} outside [0, {cfg.num_steps})")
    if tuple(x.shape) != tuple(inputs.x0.shape):
        raise ValueError(f"x {tuple(x.shape)} must be shaped as x0 {tuple(inputs.x0.shape)}")
    cfg_on = cfg_enabled(inputs, cfg)
    with torch.no_grad():
        sigmas = sigma_table(rt, cfg, inputs.img_grid, "rollout").to(inputs.x0.device)
        tau_all = timestep_input(sigmas[:-1], cfg.policy("rollout"))
        return _run_step(model, rt, inputs, cfg, cfg_on, "rollout", int(step), sigmas, tau_all,
                         x, None)


def recompute(
    model: Callable[..., torch.Tensor],
    inputs: RolloutInputs,
    stored_latents: torch.Tensor,
    cfg: SamplerConfig,
    rt: Runtime,
    phase: str = "train",
    *,
    steps: Sequence[int] | None = None,
    callback: StepCallback | None = None,
) -> Trajectory:
    """Training-side recompute: re-score stored transitions (numerics §4.1 ``compute_log_prob``).

    Each step i runs from the stored x_i with ``prev_sample`` = stored x_{i+1}: same forwards,
    CFG and SDE arithmetic as ``rollout`` (same ``cfg`` — in particular the same timestep
    policy, unless ``cfg.train_timestep_policy`` names the trainer's own, as Flow-GRPO's
    ``compute_log_prob`` does), so in strict mode v_t and logp_t are byte-equal to the
    rollout's. Stored latents are read in ``cfg.latents_dtype`` (bf16 ones as stored). Gradients are
    enabled as the caller set them (logp is differentiable through mu and v). Step records are
    written with ``phase`` and flushed per step.

    Args:
        stored_latents: [num_steps + 1, B, N, Cp] x_0 … x_N (fp32, or bf16 upcast exactly;
            with ``latents_dtype="bfloat16"`` bf16 values).
        steps: step indices to recompute (default all, in order).
        Other arguments as ``rollout``. ``inputs.noise`` is not used.

    Returns:
        ``Trajectory`` with ``latents = stored_latents`` and per-step tensors for ``steps``.
    """
    inputs.validate()
    check_family(rt, cfg)
    S = cfg.num_steps
    if stored_latents.dim() != 4 or stored_latents.shape[0] != S + 1 \
            or stored_latents.shape[1:] != inputs.x0.shape:
        raise ValueError(
            f"stored_latents {tuple(stored_latents.shape)} must be [num_steps+1={S + 1}, "
            f"{', '.join(map(str, inputs.x0.shape))}]"
        )
    idx = list(range(S)) if steps is None else [int(i) for i in steps]
    if any(not 0 <= i < S for i in idx):
        raise ValueError(f"steps {idx} outside [0, {S})")
    cfg_on = cfg_enabled(inputs, cfg)
    with torch.no_grad():
        sigmas = sigma_table(rt, cfg, inputs.img_grid, phase).to(inputs.x0.device)
        tau_all = timestep_input(sigmas[:-1], cfg.policy(phase))
    outs = []
    ldt = cfg.latents_torch_dtype
    for i in idx:
        x = stored_latents[i].to(ldt)
        prev = stored_latents[i + 1].to(ldt)
        out = _run_step(model, rt, inputs, cfg, cfg_on, phase, i, sigmas, tau_all, x, prev)
        outs.append(out)
        if callback is not None:
            callback(out)
    return _trajectory(phase, inputs, cfg, cfg_on, sigmas, tau_all, outs, stored_latents)
