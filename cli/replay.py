"""``drifttool replay`` and ``drifttool recompute``: re-execute or re-score a stored rollout.

    drifttool replay runs/a -o runs/a-replay              # same inputs, same settings, same model
    drifttool diff runs/a runs/a-replay                    # strict: identical
    drifttool recompute runs/a -o runs/a-train             # phase "train", autograd on
    drifttool diff runs/a runs/a-train                     # aligns train <-> rollout

    torchrun --standalone --nproc-per-node 2 -m drifttool replay runs/a --tp 2 -o runs/a-tp2
    drifttool diff runs/a runs/a-tp2                       # strict: identical in any layout

``replay`` and ``recompute`` run under torchrun as ``run`` does (sample-parallel, or
``--tp/--sp/--sp-attention/--cfg-parallel``, checked before any rank starts: ``cli._layout``), in
the layout they are given, whatever the stored run's was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from drifttool.cli import _checkpoint, _completion, _json, _layout, _paths
from drifttool.cli._console import console, notice
from drifttool.cli._errors import alike_on_every_rank
from drifttool.cli._summary import graph_rows, graph_warning, internals_note, settings_rows, shown
from drifttool.errors import DriftToolError

_DEVICE_HELP = "cpu | cuda | cuda:N (default: the run's). Shapes come from the artifact."


def _branches(stored) -> int:
    """CFG branches per step of a stored rollout (2 with CFG on, else 1: ``sampling.rollout``)."""
    return 2 if stored.sampler.cfg_scale > 1 and stored.inputs.neg_txt is not None else 1


def _summary(title: str, rows: list[tuple[str, object]], summary: dict) -> None:
    """The command's summary table, and the warning of a refused CUDA graph capture."""
    table = Table(title=title, show_header=False)
    for k, v in rows:
        table.add_row(k, shown(v))
    console.print(table)
    if (line := graph_warning(summary)) is not None:
        notice("warning", line)


def _one_process(stored, dims) -> None:
    """Refuse a parallel layout for a run a replay re-runs in one process (a captured diffusers
    pipeline, a prompt run or an edit run from images: ``replay_run``'s own refusals), before
    any torchrun advice."""
    from drifttool.training.chain_replay import chain_section  # lazy: likewise
    from drifttool.training.pipeline_replay import is_pipeline_capture  # lazy: likewise

    if not dims.parallel:
        return
    section = chain_section(stored.manifest)
    if section is not None:
        raise DriftToolError(f"{stored.path}: a replay of a {section} run re-runs every stage in one "
                             "process (no torchrun, --tp, --sp or --cfg-parallel)")
    if is_pipeline_capture(stored.manifest):
        raise DriftToolError(f"{stored.path}: a captured diffusers pipeline replays in one "
                             "process (no torchrun, --tp, --sp or --cfg-parallel)")


def replay(
    run_dir: Path = typer.Argument(..., parser=_paths.input_path, help="Rollout artifact to replay."),
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path, help="Artifact directory to create."),
    mode: Optional[str] = typer.Option(None, autocompletion=_completion.modes, help="strict | audit | auto | off (default: the run's)."),
    capture: Optional[str] = typer.Option(None, autocompletion=_completion.levels, help="L0 | L1 | L2 (default: the run's)."),
    internals: Optional[bool] = typer.Option(None, "--internals/--no-internals", show_default=False, help="At L2, capture the fused attention's internals or not (default: as the run did)."),
    fixture: Optional[str] = typer.Option(None, autocompletion=_completion.fixtures, help="Fixture holding the model, if the manifest's name does not resolve."),
    checkpoint: Optional[Path] = _checkpoint.option("Overrides the manifest's model (fingerprint-checked); needed for a captured diffusers pipeline (its pipeline folder)."),
    lora: Optional[Path] = typer.Option(None, parser=_paths.adapter, help="LoRA adapter overriding the manifest's (fingerprint-checked)."),
    device: Optional[str] = typer.Option(None, autocompletion=_completion.devices, help=_DEVICE_HELP),
    tp: int = _layout.tp_option(),
    sp: int = _layout.sp_option(),
    sp_attention: Optional[str] = _layout.sp_attention_option(),
    cfg_parallel: int = _layout.cfg_parallel_option(),
    overwrite: bool = typer.Option(False, help="Replace an existing artifact directory."),
    as_json: bool = _json.option(),
) -> None:
    """Re-execute a trajectory from its artifact's replay inputs.

    Uses the stored x0, SDE noise, prompts and masks with the manifest's settings and model
    (fingerprint-checked). `drifttool diff RUN_DIR OUT` is identical in strict mode. Under
    torchrun the ranks replay sample-parallel, or under `--tp/--sp/--cfg-parallel` (their product
    = the number of ranks), whatever layout the stored run had; the replay still diffs identical.

    A captured diffusers pipeline call (capture_pipeline) is re-executed through an unmodified
    QwenImagePipeline around the transformer of --checkpoint (its pipeline folder or hub id,
    weights checked), with the recorded scheduler, in one process.

    A prompt run (run --prompt) or an edit run from condition images re-runs every stage (text
    encoder or VAE encode, trajectory, VAE decode; the image is written beside OUT) from the
    pipeline folder its manifest names, or --checkpoint, in one process on the CPU.
    """
    from drifttool.distributed import launch_env  # lazy: keeps torch out of `drifttool --help`
    from drifttool.settings import resolve  # lazy: likewise
    from drifttool.training.options import RerunOptions  # lazy: likewise
    from drifttool.training.pipeline_replay import is_pipeline_capture  # lazy: likewise
    from drifttool.training.replay import replay_run, replay_spec  # lazy: likewise
    from drifttool.training.stored import load_rollout  # lazy: likewise
    from drifttool.training.trainer import rerun_device  # lazy: likewise

    with alike_on_every_rank():  # the command line and the stored run only: one line for the launch
        options = RerunOptions(mode=mode, capture=capture, internals=internals, fixture=fixture,
                               checkpoint=checkpoint, lora=lora, device=device, overwrite=overwrite)
        dims = _layout.layout_dims(tp, sp, sp_attention, cfg_parallel)
        stored = load_rollout(run_dir, need_latents=False)
        pipeline = is_pipeline_capture(stored.manifest)  # replay_run's refusals, its device
        _one_process(stored, dims)
        if not pipeline:
            fx, settings = resolve(replay_spec(stored, options))
            _layout.check_layout(dims, **{**_layout.settings_layout(fx, settings),
                                          "cfg_branches": _branches(stored)},
                                 capture_from="the stored run's level" if capture is None else "")
    launch = launch_env()
    with alike_on_every_rank():
        _layout.check_launch(dims, launch, "replay")
    where = rerun_device(stored, options) if pipeline else settings.device
    dist, s = _layout.on_ranks(dims, where, "replay", stored.sampler.num_steps,
                               stored.inputs.batch, _branches(stored),
                               lambda **kw: replay_run(run_dir, out, options, **kw), quiet=as_json)
    if dist.rank != 0:
        return
    if as_json:
        _json.emit("replay", {**s, "source": str(run_dir), "ranks": _layout.ranks_data(dims, dist),
                              "compare": ["drifttool", "diff", str(run_dir), str(out)]})
        return
    rows = [(k, s[k]) for k in ("mode", "capture", "steps", "samples", "complete")]
    if (ranks := _layout.ranks_row(dims, dist)) is not None:
        rows.append(("ranks", ranks))
    rows += settings_rows(stored.settings if pipeline else settings.record()) + graph_rows(s)
    _summary(f"drifttool replay {run_dir} → {out}", rows, s)
    for line in (s.get("note"), internals_note(internals, s["mode"], s["capture"])):
        if line:
            notice("note", line)
    console.print(f"compare: drifttool diff {run_dir} {out}", highlight=False)


def recompute(
    run_dir: Path = typer.Argument(..., parser=_paths.input_path, help="Complete rollout artifact to re-score."),
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path,
                           help="Artifact directory to create (kind: recompute)."),
    mode: Optional[str] = typer.Option(None, autocompletion=_completion.modes, help="Trainer mode: strict | audit | auto | off (default: the run's)."),
    capture: Optional[str] = typer.Option(None, autocompletion=_completion.levels, help="L0 | L1 | L2 (default: the run's)."),
    internals: Optional[bool] = typer.Option(None, "--internals/--no-internals", show_default=False, help="At L2, capture the fused attention's internals or not (default: as the run did)."),
    grad: bool = typer.Option(False, help="Backward of -mean logp_t per SDE step; digest the LoRA gradients."),
    gradient_checkpointing: bool = typer.Option(False, help="Recompute block activations in the backward instead of keeping every block's (a full-size --grad needs it on an 80 GiB GPU)."),
    micro_batch: Optional[int] = typer.Option(None, min=1, help="Samples per trainer forward, 1 to the rollout's batch (default: the whole batch)."),
    trim_padding: bool = typer.Option(True, help="With --micro-batch: trim prompts to each micro-batch."),
    fixture: Optional[str] = typer.Option(None, autocompletion=_completion.fixtures, help="Fixture holding the model, if the manifest's name does not resolve."),
    checkpoint: Optional[Path] = _checkpoint.option("Trainer model (must match the rollout's fingerprint)."),
    lora: Optional[Path] = typer.Option(None, parser=_paths.adapter, help="LoRA adapter (must match the rollout's; it runs in the rollout's --lora-mode)."),
    device: Optional[str] = typer.Option(None, autocompletion=_completion.devices, help=_DEVICE_HELP),
    tp: int = _layout.tp_option(),
    sp: int = _layout.sp_option(),
    sp_attention: Optional[str] = _layout.sp_attention_option(),
    cfg_parallel: int = _layout.cfg_parallel_option(),
    overwrite: bool = typer.Option(False, help="Replace an existing artifact directory."),
    as_json: bool = _json.option(),
) -> None:
    """Training recompute of a stored rollout (phase train, autograd on).

    Every step is re-run from the stored latents (prev_sample = the stored next latent) under the
    rollout's pinned policy (timestep encoding, stored-latent dtype, CFG layout). `drifttool diff
    RUN_DIR OUT` aligns train with rollout and names the first drifting operator, block, step, row.
    Under torchrun the ranks recompute sample-parallel, or under `--tp/--sp/--cfg-parallel`
    (whatever layout the rollout had).
    """
    from drifttool.distributed import launch_env  # lazy: keeps torch out of `drifttool --help`
    from drifttool.training.options import RerunOptions, TrainOptions  # lazy: likewise
    from drifttool.training.recompute import NO_ADAPTER, recompute_run  # lazy: likewise
    from drifttool.training.stored import load_rollout  # lazy: likewise
    from drifttool.training.trainer import check_micro_batch, rerun_device  # lazy: likewise

    if not trim_padding and micro_batch is None:  # a no-op that looks like a setting
        raise typer.BadParameter("--no-trim-padding goes with --micro-batch (without it every forward "
                                 "takes the whole batch, its prompts as stored)", param_hint="--no-trim-padding")
    with alike_on_every_rank():  # the command line and the stored run only: one line for the launch
        options = RerunOptions(mode=mode, capture=capture, internals=internals, fixture=fixture,
                               checkpoint=checkpoint, lora=lora, device=device, overwrite=overwrite)
        train = TrainOptions(grad=grad, gradient_checkpointing=gradient_checkpointing,
                             micro_batch=micro_batch, trim_padding=trim_padding)
        dims = _layout.layout_dims(tp, sp, sp_attention, cfg_parallel)
        stored = load_rollout(run_dir)
        check_micro_batch(micro_batch, stored.inputs.batch)
        device = rerun_device(stored, options)
        if dims.parallel:
            _layout.check_layout(dims, **_trainer_layout(stored, options), cfg_branches=_branches(stored),
                                 cfg_layout=stored.sampler.cfg_layout,
                                 capture_from="the stored run's level" if capture is None else "")
            if grad and not (stored.manifest.get("lora") or lora):  # recompute_run's refusal, once
                raise DriftToolError(NO_ADAPTER)
    launch = launch_env()
    with alike_on_every_rank():
        _layout.check_launch(dims, launch, "recompute")
    dist, s = _layout.on_ranks(dims, device, "train recompute", stored.sampler.num_steps,
                               stored.inputs.batch, _branches(stored),
                               lambda **kw: recompute_run(stored, out, options, train, **kw),
                               quiet=as_json)
    if dist.rank != 0:
        return
    if as_json:
        _json.emit("recompute", {**{k: v for k, v in s.items() if k != "trajectory"}, "source": str(run_dir), "ranks": _layout.ranks_data(dims, dist),
                                 "timestep_policy": stored.sampler.timestep_policy,
                                 "cfg_layout": stored.sampler.cfg_layout,
                                 "stored_latents": stored.latent_dtype,
                                 "compare": ["drifttool", "diff", str(run_dir), str(out)]})
        return
    rows = [(k, s[k]) for k in ("mode", "capture", "steps", "samples", "complete", "grad_records")]
    if (ranks := _layout.ranks_row(dims, dist)) is not None:
        rows.append(("ranks", ranks))
    rows += settings_rows(stored.settings, skip=("cfg_layout",))  # the rollout's, re-scored as it ran
    rows += [("timestep_policy", stored.sampler.timestep_policy), ("cfg_layout", stored.sampler.cfg_layout),
             ("stored latents", stored.latent_dtype), ("seconds", f"{s['seconds']:.2f}")] + graph_rows(s)
    _summary(f"drifttool recompute {run_dir} → {out}", rows, s)
    if (line := internals_note(internals, s["mode"], s["capture"])) is not None:
        notice("note", line)
    console.print(f"compare: drifttool diff {run_dir} {out}", highlight=False)


def _trainer_layout(stored, options) -> dict:
    """``check_layout``'s model, mode, level and LoRA mode for a recompute of ``stored``: the
    trainer's (``training.trainer.trainer_model``, ``recompute_run``), not a re-resolved
    rollout's."""
    from drifttool.fixture import load_fixture  # lazy: keeps torch out of `drifttool --help`
    from drifttool.setting_checks import check_level, check_mode  # lazy: likewise

    s = stored.settings
    model_dir = options.checkpoint or s.get("checkpoint")
    if model_dir is None:
        name = options.fixture or s.get("fixture")
        if name is None:
            raise DriftToolError(f"{stored.path}: the manifest names no fixture or checkpoint; pass one")
        model_dir = load_fixture(name).model_dir
    return dict(model_dir=model_dir, mode=check_mode(options.mode or s.get("mode", "strict")),
                level=check_level(options.capture or stored.manifest.get("capture_level") or "L1"),
                internals=options.rerun_internals(s),
                lora_mode=s.get("lora_mode"))  # the trainer's adapter runs as the rollout's did
