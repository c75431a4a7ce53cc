"""The main job: run a strict (or production) trajectory and write its artifact.

    >>> summary = execute(RunSpec(mode="strict", capture="L1"), "runs/a")
    >>> summary["complete"], summary["steps"], summary["samples"]
    (True, 4, [0, 1])

``RunSpec`` holds what the CLI exposes; ``drifttool.settings.resolve`` merges it over the
fixture's settings into a validated ``RunSettings``. The artifact goes through the one life
cycle that ``replay`` and ``recompute`` share (``drifttool.lifecycle.ArtifactSession``). Every
byte-changing choice ends up in the manifest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

import drifttool.ops  # noqa: F401  (registers every operator backend)
from drifttool.distributed import DistContext, rank_samples, sample_parallel_layout
from drifttool.distributed.plan import ParallelDims, ParallelPlan, check_cfg_parallel
from drifttool.environment import environment
from drifttool.errors import DriftToolError
from drifttool.fixture_prompts import embedding_width
from drifttool.fingerprint import arch_fingerprint, check_finite, sampler_record, tensor_digest
from drifttool.lifecycle import SINGLE_LAYOUT, ArtifactSession
from drifttool.memory import check_memory
from drifttool.model.checkpoint import checked_config, load_checkpoint
from drifttool.model.checkpoint_files import index_warnings
from drifttool.model.graphs import GraphedForward, graph_use, graphable
from drifttool.model.lora import has_lora
from drifttool.model.lora_calls import check_unfused_layout
from drifttool.model.lora_io import fingerprinted, load_lora, lora_record
from drifttool.model.weights import weight_digest
from drifttool.sampling.inputs import RolloutInputs, replay_tensors
from drifttool.sampling.presets import check_conditions
from drifttool.sampling.rollout import rollout
from drifttool.sampling.step import StepOutput, sampler_model
from drifttool.settings import RunSpec, resolve


def run_device(device: str, dist: DistContext) -> torch.device:
    """The device this process runs on: ``device`` (``RunSettings.device``), or under torchrun
    the rank's own ``dist.device`` (``cuda:LOCAL_RANK``), which must be of the same type.

    Raises:
        DriftToolError: the process group's device type differs from the settings'.
    """
    want = torch.device(device)
    if not dist.distributed:
        return want
    if dist.device.type != want.type:
        raise DriftToolError(f"the run asks for device {device!r}, but the process group runs on "
                             f"{dist.device.type!r}")
    return dist.device


def check_model_device(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse a given model whose parameters are not all on ``device``.

    Raises:
        DriftToolError: naming the devices found.
    """
    found = sorted({str(p.device) for p in model.parameters()})
    want = torch.device(device)
    ok = all(torch.device(d).type == want.type and (want.index is None or torch.device(d).index in (None, want.index))
             for d in found)
    if not ok:
        raise DriftToolError(f"the given model's parameters are on {', '.join(found)}, the run asks for "
                             f"{device}; move the model there (model.to({str(device)!r}))")


def rank_layout(dist: DistContext, parallel: ParallelDims | None, inputs: RolloutInputs, config: Any,
                family: str, *, cfg_on: bool, cfg_layout: str = "batched",
                faults: tuple[str, ...] = (), capture_level: str | None = None,
                internals: bool = True) -> tuple[RolloutInputs, dict[str, Any], ParallelPlan | None]:
    """Where this rank stands in a run's layout, decided before the artifact opens (a refusal
    here reaches every rank): ``(the inputs it runs, the manifest layout, the parallel plan)``.
    A TP/SP/CFG-parallel ``parallel`` runs every sample on every rank under a plan; several
    ranks without one run sample-parallel (the batch's logical samples split contiguously);
    one process runs everything.

    Raises:
        DriftToolError: ``faults`` without a parallel layout.
        UnsupportedConfigError: the plan refuses the layout (``ParallelPlan.build``,
            ``plan.check_cfg_parallel``: CFG off, production with batched CFG).
    """
    if parallel is not None and parallel.parallel:
        plan = ParallelPlan.build(dist, parallel, config, family=family, faults=faults,
                                  capture_level=capture_level, internals=internals)
        check_cfg_parallel(parallel, family=family, cfg_on=cfg_on, cfg_layout=cfg_layout)
        return inputs, {**parallel.layout(), **dist.layout()}, plan
    if faults:
        raise DriftToolError(f"parallel faults {', '.join(faults)} need a TP/SP/CFG-parallel layout")
    if dist.distributed:
        layout = {**sample_parallel_layout(inputs.sample_ids, dist.world_size), **dist.layout()}
        return inputs.select(rank_samples(inputs.sample_ids, dist.rank, dist.world_size)), layout, None
    return inputs, SINGLE_LAYOUT, None


def execute(
    spec: RunSpec,
    out: str | Path,
    *,
    overwrite: bool = False,
    on_step: Callable[[StepOutput], Any] | None = None,
    max_steps: int | None = None,
    model: torch.nn.Module | None = None,
    replay_inputs: tuple[RolloutInputs, dict[str, Any]] | None = None,
    manifest_extra: dict[str, Any] | None = None,
    dist: DistContext | None = None,
    parallel: ParallelDims | None = None,
    faults: tuple[str, ...] = (),
    stages: Any = None,
) -> dict[str, Any]:
    """Run one trajectory and write its artifact to ``out``.

    ``replay_inputs`` = (inputs, noise record) replaces the inputs drawn from the fixture (a
    replay of a stored artifact, ``drifttool.training.replay.replay_run``); ``manifest_extra`` is
    merged into the manifest. A model without an adapter gets ``spec.lora`` loaded.

    ``dist`` places this process in a multi-rank run (``drifttool.distributed.init_distributed``
    under ``torchrun``; default one process). Several ranks run **sample-parallel**: the batch's
    logical samples are split contiguously over the ranks (``distributed.rank_samples``), every
    rank builds the same manifest and replay inputs for the whole batch, runs its own samples and
    writes its own records into the one artifact (``layout.kind = "sample_parallel"``); strict
    arithmetic is batch-invariant, so the artifact diffs identical to one process.

    ``parallel`` (with ``dist`` launched on the mesh ``plan.MESH_DIMS`` of its shape) runs every
    sample on every rank under a parallel plan instead: TP shards heads and MLP channels, SP image
    rows, CFG-parallel one branch per rank (``drifttool.distributed.plan``); each record is
    written by its owning rank (``layout.kind = "parallel"``). ``faults`` plants distributed
    probe faults in that plan (``plan.FAULTS``; recorded in the manifest's ``variants``).

    ``model`` replaces the checkpoint's ``MMDiT`` with another implementation of the same call
    (``config``, ``dtype``, named parameters under the checkpoint's names, and
    ``model(x, txt, txt_mask, tau, img_grid, rt)``), e.g. the diffusers capture adapter
    (``drifttool.adapters.diffusers_qwenimage``); its ``source`` attribute goes to the manifest.

    Device (``RunSettings.device``): the checkpoint loads straight onto it
    (``load_checkpoint(device=)``); the replay inputs are built (or taken from ``replay_inputs``)
    on the CPU, checked, digested and stored from there, then moved to it. Under torchrun the
    rank's ``dist.device`` (``cuda:LOCAL_RANK``) is used, and must be of the settings' type. A
    given ``model`` must already be on the run's device. A mode whose family cannot run on the
    device (strict on CUDA) was refused by ``resolve`` before anything was loaded.

    ``stages`` runs stages of the same artifact around the trajectory (the full chain,
    ``drifttool.chain``): its ``external`` (in-memory ``ExternalInputs``) replaces the settings'
    file inputs, ``opened(session)`` runs once the artifact is open, before the trajectory, and
    ``finished(session, traj)`` after it, before the artifact closes (its dict is merged into
    the manifest). Its ``record`` goes into the manifest from the start (``images`` empty until
    ``finished``), so that a stopped run is still recorded as the chain it was.

    A failure after the artifact was opened closes it with ``complete=false`` (finished steps
    stay readable) and re-raises.

    Returns:
        A summary: out, complete, steps, samples, mode, capture, records.
    Raises:
        DriftToolError (or subclasses): bad settings, checkpoint, fixture, strict configuration
            or artifact location; one process whose run does not fit in memory
            (``memory.check_memory``, before the model loads).
    """
    fx, s = resolve(spec)
    if stages is not None:
        s = dataclasses.replace(s, external=stages.external)
    dtype = s.torch_dtype
    dist = dist or DistContext()
    device = run_device(s.device, dist)
    source = getattr(model, "source", None) if model is not None else None
    warnings: list[str] = []
    if stages is None and not dist.distributed:  # a chain or edit run checked it before its stages
        config = checked_config(s.checkpoint or fx.model_dir, s.variant) if model is None else model.config
        check_memory(s, config)  # before the model loads
    if model is None:
        warnings = index_warnings(s.checkpoint or fx.model_dir, s.variant)
        model = load_checkpoint(s.checkpoint or fx.model_dir, dtype=dtype, variant=s.variant,
                                device=device, lora=s.lora, lora_mode=s.lora_mode or "merged")
    elif model.dtype != dtype:
        raise DriftToolError(f"the given model is {model.dtype}, the run asks for {s.dtype}")
    else:
        check_model_device(model, device)
    model.config.check_rollout()  # before the artifact opens
    sampler = s.sampler()
    if s.lora and not has_lora(model):
        load_lora(model, s.lora, mode=s.lora_mode)
    check_finite(dict(model.state_dict()), "checkpoint weights")
    if replay_inputs is not None:
        inputs, noise_rec = replay_inputs
    else:
        inputs, noise_rec = s.inputs(fx, model.config)
    if s.preset is not None:  # the condition images its pipeline takes, before the artifact opens
        check_conditions(s.preset, inputs.cond_grids)
    tensors = replay_tensors(inputs)
    check_finite(tensors, "replay inputs")
    mine, layout, plan = rank_layout(dist, parallel, inputs, model.config, s.mode.family,
                                     cfg_on=s.cfg_branches == 2, cfg_layout=s.cfg_layout, faults=faults,
                                     capture_level=s.capture if s.mode.captures else None,
                                     internals=s.internals)
    check_unfused_layout(model, None if plan is None else plan.dims)
    mine = mine.to(device)  # drawn, checked and digested on the CPU; run on the device
    session = ArtifactSession(mode=s.mode, level=s.capture, cfg_layout=s.cfg_layout, internals=s.internals,
                              unavailable=set(spec.unavailable), variants=dict(spec.variants),
                              rank=dist.rank, world_size=dist.world_size, layout=layout, plan=plan)
    sigmas = session.sigma_table(sampler, inputs.img_grid)
    fingerprint = arch_fingerprint(
        arch=model.config.arch_fields(), img_grid=inputs.img_grid,
        weights=weight_digest(fingerprinted(model)),
        dtype=dtype, mode=s.mode.value, sampler=sampler_record(sampler, sigmas),
        noise_record=noise_rec,
    )
    manifest = {
        "kind": "rollout",
        "fingerprint": fingerprint,
        "settings": s.record(),
        "environment": environment(device),
        "replay": {"noise": noise_rec, "inputs": "inputs.safetensors",
                   "prompt_lengths": inputs.txt_mask.sum(-1).tolist() if inputs.txt_mask is not None
                   else [inputs.txt.shape[1]] * inputs.batch,
                   "input_digests": {k: tensor_digest(v) for k, v in tensors.items()}},
        "variants": sorted([f"{op}={name}" for op, (name, _) in spec.variants.items()]
                           + [f"parallel={fault}" for fault in faults]),
    }
    if source is not None:
        manifest["model_source"] = source
    if warnings:
        manifest["checkpoint_warnings"] = warnings
    if has_lora(model):
        manifest["lora"] = lora_record(model)
    manifest.update(manifest_extra or {})
    if stages is not None:  # known before the trajectory: a stopped run keeps its stages' record
        manifest[stages.manifest_key] = {**stages.record, "images": []}
    with session.open(out, manifest, overwrite=overwrite):
        session.write_inputs(tensors)
        if stages is not None:
            stages.opened(session)
        fwd = rollout_forward(model, device)
        traj = rollout(sampler_model(fwd), mine, sampler, session.rt, callback=on_step,
                       max_steps=max_steps)
        session.finish(complete=traj.complete,
                       **(stages.finished(session, traj) if stages is not None else {}))
    nonfinite = sum(int((~torch.isfinite(t)).sum()) for t in (traj.latents, traj.velocities))
    return {"out": str(out), "complete": traj.complete, "steps": len(traj.steps),
            "samples": inputs.sample_ids, "mode": s.mode.value,
            "capture": s.capture if s.mode.captures else "none (mode off)", "nonfinite": nonfinite,
            "lora": manifest.get("lora"), "warnings": warnings,
            "notes": (stand_in_prompt_notes(fx, s, model.config) if replay_inputs is None else [])
            + empty_prompt_notes(inputs),
            "fault_effects": {} if plan is None else dict(plan.fault_effects), "cuda_graphs": graph_use(fwd)}


def rollout_forward(model: torch.nn.Module, device: torch.device):
    """The model call a rollout makes: on a GPU a graphable model (``model.graphs.graphable``)
    replays CUDA graphs (``GraphedForward``: the same kernels, bytes, trace and records; what it
    did goes into the summary, ``graph_use``); elsewhere the model itself."""
    return GraphedForward(model) if device.type == "cuda" and graphable(model) else model


def stand_in_prompt_notes(fx, s, config) -> list[str]:
    """One line when the run took its prompts from the fixture and the fixture's embeddings are
    of another width than the model's text input (``config.joint_attention_dim``: an external
    checkpoint): ``Fixture.prompts`` then drew seeded N(0, 1) embeddings at the fixture's
    lengths instead, which the replay inputs hold but no setting names."""
    source = fx.path / "prompts.safetensors"
    if (s.external is not None and s.external.txt is not None) or not source.is_file():
        return []
    width = embedding_width(source)  # the file was read and checked for the inputs
    if width == config.joint_attention_dim:
        return []
    return [f"the fixture's prompt embeddings are {width} wide and the model's text input "
            f"{config.joint_attention_dim}: the prompts are seeded N(0, 1) embeddings at the fixture's "
            f"lengths (seed {s.seed}); --prompt-embeds gives real ones"]


def empty_prompt_notes(inputs) -> list[str]:
    """One line per prompt (positive or negative) whose mask masks every text token: the model
    then sees no prompt at all (its text keys are all masked), which is rarely meant."""
    out = []
    for what, mask in (("prompt", inputs.txt_mask), ("negative prompt", inputs.neg_mask)):
        if mask is None:
            continue
        empty = [sid for sid, row in zip(inputs.sample_ids, mask) if not bool(row.any())]
        if empty:
            out.append(f"the {what} mask of sample(s) {empty} masks every text token: the model "
                       "sees no prompt there")
    return out
