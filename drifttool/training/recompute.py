"""Training recompute of a stored rollout: phase ``train``, autograd on, from the stored latents.

    >>> recompute_run("runs/a", "runs/a-train")            # phase "train", autograd on
    >>> diff_runs(open_run("runs/a"), open_run("runs/a-train")).verdict   # strict/strict
    <Verdict.IDENTICAL: 'identical'>

**Pinned policy.** The recompute takes from the rollout manifest, and records in its own under
``policy``: the timestep encoding (``timestep_policy``, numerics §3.4/§5.2), the CFG execution
layout and scale, the SDE settings and sigma table, and the stored-latent dtype: logp_t is
evaluated on the stored bytes of x_t and x_{t+1} (numerics §5.3; ``prev_sample`` = the stored next
latent), never on a re-rounded copy.

**Recompute artifact.** ``kind: "recompute"``; its step and op records use phase ``train`` with
the rollout's identities otherwise, so ``drifttool diff ROLLOUT RECOMPUTE`` aligns phase
``train`` of the recompute with phase ``rollout`` (``drifttool.diff.compare``) and names the first
drifting operator, block, step and row. With ``grad=True`` (needs a LoRA adapter in the rollout)
each SDE step runs ``(−mean_b logp_t).backward()`` right after its forward (Flow-GRPO's per-step
backward, gradients accumulated over steps; in strict mode by the canonical reduction of
``training.ledger``, so micro-batching, CFG layout and checkpointing change no byte) and the
accumulated LoRA gradients are digested
(role ``grad_weight``) after each step, so two training runs diff at the gradient level. On a
GPU the training steps' forwards and backwards replay CUDA graphs
(``model.graphs_train.GraphedTraining``: the same bytes, records and ledger atoms). The
artifact goes through the life cycle every run shares (``drifttool.lifecycle.ArtifactSession``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

from drifttool.artifact.levels import captures_internals
from drifttool.distributed import DistContext
from drifttool.distributed.plan import ParallelDims
from drifttool.environment import environment
from drifttool.errors import DriftToolError
from drifttool.fingerprint import arch_fingerprint, sampler_record
from drifttool.lifecycle import ArtifactSession
from drifttool.model.graphs import graph_use
from drifttool.model.graphs_train import GraphedTraining
from drifttool.memory import check_canonical_gradient
from drifttool.model.lora import has_lora, lora_mode, lora_modules, lora_parameters
from drifttool.model.lora_calls import check_unfused_layout
from drifttool.model.lora_io import capture_lora_grads, fingerprinted, lora_record
from drifttool.model.mmdit import MMDiT
from drifttool.model.weights import weight_digest
from drifttool.ops.scheduler import timestep_input
from drifttool.sampling.inputs import replay_tensors
from drifttool.sampling.rollout import recompute
from drifttool.sampling.step import StepOutput, cfg_enabled, sampler_model
from drifttool.runner import check_model_device, rank_layout
from drifttool.setting_checks import check_level, check_mode, check_mode_device
from drifttool.training.ledger import GradLedger
from drifttool.training.options import RerunOptions, TrainOptions
from drifttool.training.stored import (StoredRollout, load_rollout, refuse_same_dir,
                                       source_record)
from drifttool.training.trainer import micro_batched, prepare_trainer, rerun_device


NO_ADAPTER = ("gradients (recompute --grad) need trainable LoRA parameters, and the rollout ran "
              "without an adapter: roll out with one (drifttool run --lora ADAPTER) and recompute that run")


def policy_record(stored: StoredRollout, tau: torch.Tensor | None = None) -> dict[str, Any]:
    """The arithmetic policy shared by rollout and recompute (module docstring)."""
    s = stored.sampler
    out = {"timestep_policy": s.timestep_policy, "cfg_layout": s.cfg_layout, "cfg_scale": s.cfg_scale,
           "eta": s.eta, "sde_window": None if s.sde_window is None else list(s.sde_window),
           "stored_latent_dtype": stored.latent_dtype,
           "logp_evaluated_on": "stored x_t and stored x_{t+1} bytes (prev_sample), upcast exactly to fp32",
           "sigma_table_digest": stored.manifest["fingerprint"]["scheduler"].get("sigma_table_digest")}
    if tau is not None:
        out["timesteps"] = [float(v) for v in tau.tolist()]
    return out


def _settings(stored: StoredRollout, mode: str, level: str, device: str,
              internals: bool = True) -> dict[str, Any]:
    """The recompute's ``settings``: the rollout's, with the trainer's mode, capture level,
    device and internals (``device`` only when not ``cpu``, ``internals`` only when an L2
    capture leaves them out, as ``RunSettings.record``)."""
    out = {**stored.settings, "mode": mode, "capture": level}
    out.pop("device", None)
    out.pop("internals", None)
    if device != "cpu":
        out["device"] = device
    if not internals and captures_internals(level):
        out["internals"] = False
    return out


def _train_record(train: TrainOptions, mode_family: str) -> dict[str, Any]:
    return {"phase": "train", "autograd": True, "grad": bool(train.grad),
            "loss": "per SDE step: -mean over samples of logp_t, backward per step, "
                    "gradients accumulated" if train.grad else None,
            "gradient_reduction": ("canonical: per step the tree over (sample, branch) atoms, steps "
                                   "in order (training.ledger)") if train.grad and mode_family == "strict"
                                  else ("autograd accumulation" if train.grad else None),
            "gradient_checkpointing": bool(train.gradient_checkpointing),
            "micro_batch": train.micro_batch,
            "trim_padding": bool(train.trim_padding and train.micro_batch)}


def _drop_history(o: StepOutput) -> None:
    """Detach a finished step's tensors: the trajectory keeps their values, and the forward's
    autograd graph (its saved activations; a graphed step's pending replay, ``model.graphs_train``)
    goes now rather than at the end of the run, also for a step without a backward (outside the
    SDE window, or ``grad`` off)."""
    for f in dataclasses.fields(o):
        t = getattr(o, f.name)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            setattr(o, f.name, t.detach())


@contextlib.contextmanager
def _memory_hint(train: TrainOptions, family: str, mode: str | None):
    """Turn the device running out of memory in the recompute's steps into one ``DriftToolError``
    line naming what a trainer can change: gradient checkpointing first (without it every
    block's activations are kept for the backward), then a merged adapter's strict gradients
    (``memory.canonical_gradient_bytes``), then fewer samples."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        hints = []
        if train.grad and not train.gradient_checkpointing:
            hints.append("--gradient-checkpointing keeps one block's activations for the backward "
                         "instead of every block's")
        if train.grad and family == "strict" and mode == "merged":
            hints.append("a merged adapter's strict gradients keep an FP32 [out, in] partial per "
                         "adapted weight and row: roll out with --lora-mode unfused-fp32")
        hints.append("fewer samples fit in less")
        raise DriftToolError(f"out of device memory in the training recompute: {first} ("
                             + "; ".join(hints) + ")") from None


def recompute_run(
    source: str | Path | StoredRollout,
    out: str | Path,
    options: RerunOptions = RerunOptions(),
    train: TrainOptions = TrainOptions(),
    *,
    model=None,
    on_step: Callable[[StepOutput], Any] | None = None,
    dist: DistContext | None = None,
    parallel: ParallelDims | None = None,
) -> dict[str, Any]:
    """Recompute a stored rollout in phase ``train`` and write a ``kind: "recompute"`` artifact.

    Layouts (``dist``, ``parallel``) as ``runner.execute``: several ranks without a plan recompute
    sample-parallel (each its samples; the loss of a step is −Σ logp_t / B over the whole batch),
    ``--cfg-parallel 2`` one CFG branch per rank, TP/SP (AG/RS, Ulysses or Ring attention) shard the
    forward and backward of the LoRA-adapted model (``ParallelPlan.check_training``). Strict gradients are the canonical ones of
    ``training.ledger``, each rank's atoms gathered before the reduction, so every layout
    writes the one-process gradient bytes (the root rank records them).

    Args:
        source: rollout artifact directory (or an already loaded ``StoredRollout``).
        options: mode, capture level, device (default: the rollout's), model overrides,
            overwrite. The stored inputs and latents are moved to the device; shapes are the
            artifact's.
        train: backward per SDE step (``grad``), gradient checkpointing, micro-batching.
        model: a ready trainer model (still fingerprint-checked).
        on_step: called with each step's ``StepOutput`` after its backward.
        dist: this process's place among ranks (``distributed.init_distributed``; default one).
        parallel: a CFG-parallel layout on ``dist``'s mesh (``plan.MESH_DIMS``).

    Returns:
        Summary: out, complete, steps, samples, mode, capture, grad_records, seconds, trajectory.

    Raises:
        ArtifactError: the source is incomplete, tampered or unreadable; the output location.
        DriftToolError: fingerprint mismatch, bad mode, level or device, ``grad`` without an
            adapter, a given model on another device.
        UnsupportedConfigError: a mode whose family cannot run on the device (strict on CUDA).
    """
    refuse_same_dir(source, out)
    stored = source if isinstance(source, StoredRollout) else load_rollout(source)
    m = check_mode(options.mode or stored.settings.get("mode", "strict"))
    dist = dist or DistContext()
    if dist.distributed and dist.device.type == rerun_device(stored, options).split(":")[0]:
        options = dataclasses.replace(options, device=str(dist.device))  # this rank's own device
    device = rerun_device(stored, options)
    check_mode_device(m, device)  # before the model loads or the artifact opens
    model = prepare_trainer(stored, options, model)
    check_model_device(model, torch.device(device))
    level = check_level(options.capture or stored.manifest.get("capture_level") or "L1")
    internals = options.rerun_internals(stored.settings)
    if train.grad and not lora_parameters(model):
        raise DriftToolError(NO_ADAPTER)
    sampler = stored.sampler
    mine, layout, plan = rank_layout(dist, parallel, stored.inputs, model.config, m.family,
                                     cfg_on=cfg_enabled(stored.inputs, sampler),
                                     cfg_layout=sampler.cfg_layout, capture_level=level,
                                     internals=internals)
    check_unfused_layout(model, None if plan is None else plan.dims)
    if plan is not None and train.grad:  # only a backward needs the ledger's parameters
        plan.check_training(model)
    if train.grad and m.family == "strict" and lora_mode(model) == "merged":
        branches = 2 if cfg_enabled(stored.inputs, sampler) and (parallel is None or parallel.cfg == 1) else 1
        check_canonical_gradient([tuple(mod.weight.shape) for mod in lora_modules(model).values()],
                                 len(mine.sample_ids) * branches, device)  # before any step
    session = ArtifactSession(mode=m, level=level, cfg_layout=sampler.cfg_layout, internals=internals,
                              rank=dist.rank, world_size=dist.world_size, layout=layout, plan=plan)
    sig = session.sigma_table(sampler, stored.inputs.img_grid, phase="train")
    tau = timestep_input(sig[:-1], sampler.timestep_policy)
    fingerprint = arch_fingerprint(
        arch=model.config.arch_fields(), img_grid=stored.inputs.img_grid, weights=weight_digest(fingerprinted(model)),
        dtype=model.dtype, mode=m.value, sampler=sampler_record(sampler, sig),
        noise_record=stored.noise_record,
    )
    manifest = {
        "kind": "recompute",
        "fingerprint": fingerprint,
        "settings": _settings(stored, m.value, level, device, internals),
        "environment": environment(device),
        "source": source_record(stored),
        "policy": policy_record(stored, tau),
        "train": _train_record(train, m.family),
        "replay": dict(stored.manifest.get("replay") or {}),
    }
    if has_lora(model):
        manifest["lora"] = lora_record(model)
    n_grad = 0
    t0 = time.perf_counter()
    group = plan.groups.get("cfg") if plan is not None else (torch.distributed.group.WORLD if dist.distributed else None)
    ledger = GradLedger(model, group=group, plan=plan) if train.grad and m.family == "strict" else None
    batch = stored.inputs.batch  # the whole batch's mean, on every layout
    records_grads = plan.is_root if plan is not None else dist.rank == 0  # equal on every rank
    rows = [stored.inputs.sample_ids.index(sid) for sid in mine.sample_ids]

    def step_done(o: StepOutput) -> None:
        nonlocal n_grad
        if train.grad and o.in_window:
            (-o.logp.sum() / batch).backward()
            if ledger is not None:
                ledger.finish_step(o.step)
            if records_grads:
                n_grad += capture_lora_grads(model, session.recorder, phase="train", step=o.step,
                                             sigma=o.sigma, rank=dist.rank)
        if on_step is not None:
            on_step(o)
        _drop_history(o)

    # on a GPU, each training step's forward and backward replay CUDA graphs: the same kernels,
    # bytes, trace, records and ledger atoms
    graphed = (GraphedTraining(model) if train.grad and torch.device(device).type == "cuda"
               and isinstance(model, MMDiT) else None)
    with session.open(out, manifest, overwrite=options.overwrite):
        try:
            session.rt.grad_ledger = ledger
            model.gradient_checkpointing = bool(train.gradient_checkpointing)
            session.write_inputs(replay_tensors(stored.inputs))
            with torch.enable_grad(), _memory_hint(train, m.family, lora_mode(model)):
                fwd = micro_batched(sampler_model(graphed or model), train.micro_batch,
                                    trim_padding=train.trim_padding)
                traj = recompute(fwd, mine.to(device), stored.latents[:, rows].to(device), sampler,
                                 session.rt, phase="train", callback=step_done)
        finally:
            model.gradient_checkpointing = False
            if ledger is not None:
                ledger.close()
            if graphed is not None:
                graphed.reset()  # the graphs' memory pools
        seconds = time.perf_counter() - t0
        session.finish(complete=traj.complete, seconds=round(seconds, 3))
    return {"out": str(out), "complete": traj.complete, "steps": len(traj.steps),
            "samples": mine.sample_ids, "mode": m.value, "capture": level,
            "grad_records": n_grad, "seconds": seconds, "trajectory": traj, "cuda_graphs": graph_use(graphed)}
