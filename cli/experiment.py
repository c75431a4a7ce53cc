"""``drifttool experiment train-rollout|grpo``: rollout/trainer backend combinations.

    drifttool experiment train-rollout -o exp/
    drifttool experiment train-rollout --checkpoint Qwen-Image --lora my-lora --device cuda \
        --height 1024 --width 1024 --steps 10 --cfg-scale 4 -o exp-full/
    torchrun --standalone --nproc-per-node 2 -m drifttool experiment train-rollout --tp 2 \
        --combos strict/strict -o exp-tp2/

``train-rollout`` runs under torchrun in the launch's layout (``--tp/--sp/--sp-attention/
--cfg-parallel``, each combination's modes checked against it before any rank starts,
``cli._layout``; without them sample-parallel); ``grpo`` in a TP/SP/CFG-parallel layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from drifttool.cli import _checkpoint, _completion, _layout, _paths
from drifttool.cli._command import Command, Group
from drifttool.cli._console import console
from drifttool.cli._errors import alike_on_every_rank, user_errors
from drifttool.cli._threads import threaded
from drifttool.errors import DriftToolError
from drifttool.exit_codes import EXIT_HELP

app = typer.Typer(cls=Group, help="Train-rollout experiments: rollout/train backend combinations.",
                  epilog=EXIT_HELP,
                  no_args_is_help=True)


def _num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "-"
    return "=" if x == 0 else f"{x:.{digits}g}"


_SHORT = {"production": "prod", "strict": "strict"}


def _label(r) -> str:
    rollout, train = r["combo"].split("/")
    return f"{_SHORT[rollout]}/{_SHORT[train]}"


def _combos(text: Optional[str]):
    from drifttool.training.experiment import COMBOS  # lazy: keeps torch out of `drifttool --help`

    if text is None:
        return COMBOS
    if not text.strip():
        raise typer.BadParameter("--combos is empty: give rollout/train pairs, e.g. strict/strict,prod/strict",
                                 param_hint="--combos")
    out = []
    for part in text.split(","):
        pair = tuple({"prod": "production"}.get(p.strip(), p.strip()) for p in part.split("/"))
        if len(pair) != 2 or any(p not in ("strict", "production") for p in pair):
            raise typer.BadParameter(f"combination {part!r}: expected rollout/train, each strict or production (prod)",
                                     param_hint="--combos")
        if pair in out:  # it would run twice, the second run's artifacts replacing the first's
            raise typer.BadParameter(f"combination {'/'.join(pair)} is named twice", param_hint="--combos")
        out.append(pair)
    return tuple(out)


def _samples(text: Optional[str]):
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}",
                                 param_hint="--samples") from None


@app.command("train-rollout", cls=Command, epilog=EXIT_HELP)
@threaded
def train_rollout_cmd(
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path,
                           help="Directory for the artifacts and the result table."),
    fixture: Optional[str] = typer.Option(None, autocompletion=_completion.fixtures, help="Fixture (default tiny-t2i)."),
    checkpoint: Optional[Path] = _checkpoint.option("Replaces the fixture's model in every rollout and trainer."),
    lora: Optional[Path] = typer.Option(
        None, parser=_paths.adapter, help="LoRA adapter (peft folder or .safetensors) used as it is by every rollout and "
                   "trainer (default: a fresh one, --lora-rank/--lora-alpha, written to OUT/lora)."),
    steps: Optional[int] = typer.Option(None, help="Denoising steps N (2 to 1000; default: the fixture's)."),
    cfg_scale: Optional[float] = typer.Option(None, help="True-CFG scale, a finite number >= 0 (CFG on when > 1; default: the fixture's)."),
    batch: Optional[int] = typer.Option(None, min=1, help="Run logical samples 0..B-1 as one batch."),
    samples: Optional[str] = typer.Option(None, help="Comma-separated logical sample ids (default: the fixture's)."),
    capture: str = typer.Option("L1", autocompletion=_completion.levels, help="Capture level of every artifact."),
    micro_batch: int = typer.Option(1, min=0, help="Samples per trainer forward, prompts trimmed to them, at most the rollout's batch (0: the whole batch)."),
    lora_rank: Optional[int] = typer.Option(None, min=1, help="Rank of the fresh adapter (default 4; not with --lora)."),
    lora_alpha: Optional[float] = typer.Option(None, help="Alpha of the fresh adapter, a finite number > 0 (default 8; not with --lora)."),
    gradient_checkpointing: bool = typer.Option(False, help="Trainer recomputes block activations in the backward."),
    grad: bool = typer.Option(True, help="Trainer backward per SDE step, LoRA gradients compared."),
    combos: Optional[str] = typer.Option(None, help="e.g. strict/strict,production/strict (rollout/train; default all four)."),
    device: str = typer.Option("cpu", autocompletion=_completion.devices, help="cpu | cuda | cuda:N (strict on CUDA: the Triton family, sm_90, and its backward for the trainer)."),
    height: Optional[int] = typer.Option(None, help="Image height in pixels, a multiple of 16 (default: the fixture's)."),
    width: Optional[int] = typer.Option(None, help="Image width in pixels, a multiple of 16 (default: the fixture's)."),
    overwrite: bool = typer.Option(False, help="Replace an earlier train-rollout experiment in OUT (its files; a grpo experiment's and other files are kept). A run or another folder is refused."),
    clip_range: Optional[float] = typer.Option(
        None, "--clip-range", metavar="EPS",
        help="Also report each combination's log-prob drift (rollout vs recompute) against a PPO "
             "clip range (e.g. 1e-4), as `drifttool diff --clip-range` does: the worst step's "
             "max |exp(Δlogp_t) − 1| as a share of EPS, below or above the clip noise floor "
             "(clip_* columns in train_rollout.arrow/.json)."),
    tp: int = _layout.tp_option(),
    sp: int = _layout.sp_option(),
    sp_attention: Optional[str] = _layout.sp_attention_option(),
    cfg_parallel: int = _layout.cfg_parallel_option(),
) -> None:
    """Rollout/train combinations on matched replay inputs: v, latent (μ) and logp drift, SDE KL,
    first drift, the rollout's toy reward and time; writes train_rollout.arrow and
    train_rollout.json to OUT. Every combination runs the same settings: the fixture's, or a
    model of one's own (--checkpoint, --lora, --steps, --cfg-scale, --batch, --height/--width,
    as `drifttool run` takes them). Under torchrun every rollout and trainer runs in the
    launch's layout (a production side has no TP/SP layout: --combos strict/strict there)."""
    kwargs = dict(fixture=fixture, checkpoint=checkpoint, lora=lora, samples=_samples(samples),
                  batch=batch, steps=steps, cfg_scale=cfg_scale, capture=capture,
                  micro_batch=micro_batch or None, lora_rank=lora_rank, lora_alpha=lora_alpha,
                  gradient_checkpointing=gradient_checkpointing, grad=grad, combos=_combos(combos),
                  overwrite=overwrite, device=device, height=height, width=width,
                  clip_range=clip_range)
    from drifttool.training.experiment import train_rollout  # lazy: keeps torch out of `drifttool --help`

    spec = {k: kwargs[k] for k in ("fixture", "checkpoint", "lora", "samples", "batch", "steps",
                                   "cfg_scale", "capture", "device", "height", "width")}
    _command("experiment train-rollout", train_rollout, _print_train_rollout, out,
             (tp, sp, sp_attention, cfg_parallel), kwargs, sample_parallel=True, spec=spec)


def _print_train_rollout(rows: list, out: Path) -> None:
    from drifttool.artifact.manifest import read_manifest  # lazy: likewise
    from drifttool.artifact.schema import block_name, label, model_blocks, step_name  # lazy: keeps pyarrow out of `--help`

    t = Table(title="train-rollout: rollout vs training recompute ('=' bitwise identical)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("rollout/\ntrain", no_wrap=True, min_width=13)
    for col in ("v_t\nmax|Δ|", "v_t\nrel L2", "μ\nmax|Δ|", "logp_t\nmax|Δ|", "KL\nmax", "grad\nrel L2",
                "reward"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(_label(r), _num(r["v_max_abs"], 2), _num(r["v_rel_l2"], 2), _num(r["x_max_abs"], 2),
                  _num(r["logp_max_abs"], 2), _num(r["kl_max"], 2), _num(r["grad_rel_l2"], 2),
                  f"{r['reward']:.4g}", style=None if r["identical"] else "red")
    console.print(t)
    console.print("worst over steps, samples and branches; μ: the transition mean the trainer "
                  "predicts; grad: rel L2 of the LoRA gradients vs the strict/strict trainer's; "
                  "reward: the toy reward of the rollout's final latents (mean of latent channel 0, "
                  "mean over samples; the trainer re-scores those latents)", highlight=False)
    f = Table(title="first drift", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    f.add_column("rollout/\ntrain", no_wrap=True, min_width=13)
    for col in ("verdict", "step", "block", "op", "sample"):
        f.add_column(col, justify="left" if col in ("verdict", "op") else "right", no_wrap=True)
    for r in rows:
        if r["first_drift"]:
            block = r["first_drift_block"]  # none for a step record
            blocks = None if block is None else model_blocks(read_manifest(r["rollout_dir"]), None)
            f.add_row(_label(r), r["verdict"], step_name(r["first_drift_step"]),
                      "-" if block is None else block_name(block, blocks),
                      r["first_drift_op"], label(r["first_drift_sample"]))
        else:
            f.add_row(_label(r), r["verdict"], "-", "-", "-", "-")
    console.print(f)
    if rows and rows[0].get("clip_range") is not None:
        _print_clip(rows)
    console.print("time (s), rollout + training recompute: " + ", ".join(
        f"{_label(r)} {r['rollout_seconds']:.1f}+{r['train_seconds']:.1f}" for r in rows), highlight=False)
    first = f" (e.g. {_label(rows[0])}: drifttool diff {out}/rollout-{rows[0]['rollout']} " \
        f"{out}/train-{rows[0]['train']}-on-{rows[0]['rollout']})" if rows else ""
    console.print(f"wrote {out}/train_rollout.arrow, {out}/train_rollout.json; per combination: "
                  f"drifttool diff {out}/rollout-<r> {out}/train-<t>-on-<r>, <r> and <t> strict or "
                  f"production{first}", highlight=False, markup=False)


def _print_clip(rows: list) -> None:
    """Each combination's log-prob drift against the clip range (``diff.clip``)."""
    from drifttool.diff.clip import percent  # lazy: keeps torch out of `drifttool --help`

    eps = rows[0]["clip_range"]
    t = Table(title=f"log-prob drift against the clip range {eps:g} (worst step)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("rollout/\ntrain", no_wrap=True, min_width=13)
    for col in ("max\n|Δlogp|", "max\n|exp(Δ)−1|", "of clip\nrange", "where", "clip noise\nfloor"):
        t.add_column(col, justify="left" if col in ("where", "clip noise\nfloor") else "right",
                     no_wrap=True)
    for r in rows:
        if r["clip_fraction"] is None:
            t.add_row(_label(r), "-", "-", "-", "-", r["clip_verdict"])
            continue
        t.add_row(_label(r), _num(r["clip_max_abs"], 2), _num(r["clip_ratio_dev_max"], 2),
                  percent(r["clip_fraction"]), r["clip_worst"], r["clip_verdict"],
                  style="red" if r["clip_verdict"] == "above" else None)
    console.print(t)


@app.command("grpo", cls=Command, epilog=EXIT_HELP)
@threaded
def grpo_cmd(
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path,
                           help="Directory for grpo.arrow / grpo.json."),
    steps: int = typer.Option(2, min=1, help="Policy-gradient steps per combination."),
    groups: int = typer.Option(2, min=1, help="Prompts (groups) per step."),
    group_size: int = typer.Option(2, min=2, help="Samples per prompt."),
    inner_epochs: int = typer.Option(2, min=1, help="Training passes over each rollout."),
    lr: float = typer.Option(3e-2, help="AdamW learning rate (LoRA parameters only)."),
    clip_range: float = typer.Option(0.2, help="PPO clip range ε."),
    micro_batch: int = typer.Option(1, min=0, help="Samples per trainer forward, at most a rollout's groups x group size (0: the whole batch)."),
    combos: Optional[str] = typer.Option(None, help="e.g. strict/strict,production/production (default all four)."),
    device: str = typer.Option("cpu", autocompletion=_completion.devices, help="cpu | cuda | cuda:N (strict on CUDA: the Triton family, sm_90, and its backward for the trainer)."),
    height: Optional[int] = typer.Option(None, help="Image height in pixels, a multiple of 16 (default: the fixture's)."),
    width: Optional[int] = typer.Option(None, help="Image width in pixels, a multiple of 16 (default: the fixture's)."),
    overwrite: bool = typer.Option(False, help="Replace an earlier grpo experiment in OUT (its files; a train-rollout experiment's and other files are kept). A run or another folder is refused."),
    tp: int = _layout.tp_option(),
    sp: int = _layout.sp_option(),
    sp_attention: Optional[str] = _layout.sp_attention_option(),
    cfg_parallel: int = _layout.cfg_parallel_option(),
) -> None:
    """A small Flow-GRPO loop (toy reward, per-group advantages, PPO clipped ratio, LoRA only)
    per rollout/train combination: ratio, KL, clip fraction and reward per step and inner epoch.
    Under torchrun with --tp/--sp/--cfg-parallel every rollout, recompute and optimizer step
    runs in that layout (a production side has no TP/SP layout: --combos strict/strict there)."""
    kwargs = dict(combos=_combos(combos), overwrite=overwrite, steps=steps, groups=groups,
                  group_size=group_size, inner_epochs=inner_epochs, lr=lr, clip_range=clip_range,
                  train_micro_batch=micro_batch or None, device=device, height=height, width=width)
    from drifttool.training.experiment import grpo_experiment  # lazy: keeps torch out of `drifttool --help`

    _command("experiment grpo", grpo_experiment, _print_grpo, out,
             (tp, sp, sp_attention, cfg_parallel), kwargs, sample_parallel=False,
             spec=dict(device=device, height=height, width=width))


def _command(command: str, fn, show, out: Path, layout: tuple, kwargs: dict, *,
             sample_parallel: bool, spec: dict) -> None:
    """An experiment command: ``_experiment`` under ``user_errors`` (one line per error, ranks
    allowed), then ``show(rows, out)`` on rank 0. ``spec``: the ``RunSpec`` fields its runs
    take from the command line (for the layout checks)."""
    rows = user_errors(_experiment, command=command, ranks=True)(
        command, fn, out, layout, kwargs, sample_parallel=sample_parallel, spec=spec)
    if rows is not None:  # None: a rank other than 0 of a launch
        show(rows, out)


def _check_combos(dims, kwargs: dict, spec: dict, command: str, launch) -> None:
    """Refuse, alike on every rank, a layout the combinations' modes cannot run in (and a launch
    of another size) with the runs' settings ``spec`` (``RunSpec`` fields); nothing for one
    process."""
    from drifttool.setting_checks import check_mode  # lazy: keeps torch out of `drifttool --help`
    from drifttool.settings import RunSpec, resolve  # lazy: likewise
    from drifttool.training.grpo import MODES  # lazy: likewise

    if launch is None and not dims.parallel:
        return
    fx, s = resolve(RunSpec(**spec))
    for mode in dict.fromkeys(m for pair in kwargs["combos"] for m in pair):
        try:
            _layout.check_layout(dims, model_dir=s.checkpoint or fx.model_dir,
                                 mode=check_mode(MODES[mode]), level=kwargs.get("capture") or "L1",
                                 cfg_branches=s.cfg_branches, cfg_layout=s.cfg_layout)
        except DriftToolError as e:  # the plan's words for run; an experiment picks its modes by --combos
            why = str(e).replace(": use --mode strict)", ")")
            hint = "" if mode == "strict" else "; give --combos strict/strict"
            raise DriftToolError(f"the {mode} runs under {_layout.describe(dims)}: {why}{hint}") from None
    _layout.check_launch(dims, launch, command)


def _on_launch(dims, device: str, call):
    """``call(progress, dist=, parallel=)`` on torchrun's ranks in ``dims`` (sample-parallel
    when it is one process), a spinner on rank 0; rank 0's result, None on the other ranks."""
    from drifttool.distributed import close_distributed  # lazy: keeps torch out of `drifttool --help`

    dist = _layout.start(dims, device)
    try:
        where = dict(dist=dist, parallel=dims if dims.parallel else None)
        if dist.rank != 0:
            call(None, **where)
            return None
        with console.status("starting") as status:
            return call(lambda msg: status.update(msg), **where)
    finally:
        close_distributed(dist)


def _experiment(command: str, fn, out: Path, layout: tuple, kwargs: dict, *,
                sample_parallel: bool, spec: dict):
    """``fn(out, progress=, **kwargs)`` (``train_rollout``, ``grpo_experiment``) in one process,
    or on torchrun's ranks in the layout of the options (``_check_combos``; without layout
    options sample-parallel, where ``sample_parallel`` allows it); rank 0's rows, None on the
    other ranks."""
    from drifttool.distributed import launch_env  # lazy: keeps torch out of `drifttool --help`
    from drifttool.training.experiment import check_out_dir  # lazy: likewise

    launch = launch_env()
    with alike_on_every_rank():  # the command line and the fixture only: one line for the launch
        dims = _layout.layout_dims(*layout)
        if not sample_parallel and launch is not None and launch.world_size > 1 and not dims.parallel:
            raise DriftToolError(f"{command} under torchrun runs a TP/SP/CFG-parallel layout (--tp, "
                                 "--sp or --cfg-parallel); its loop has no sample-parallel layout")
        if kwargs.get("clip_range") is not None:
            from drifttool.diff.clip import check_clip_range  # lazy: keeps torch out of `--help`

            check_clip_range(kwargs["clip_range"])
        if "lr" in kwargs:
            from drifttool.training.grpo import check_lr  # lazy: likewise

            check_lr(kwargs["lr"])
        if "lora" in kwargs:  # train-rollout: its adapter, or the fresh one's shape
            from drifttool.training.experiment import check_adapter  # lazy: likewise

            check_adapter(kwargs["lora"], kwargs["lora_rank"], kwargs["lora_alpha"])
        _check_combos(dims, kwargs, spec, command, launch)
        check_out_dir(out, kwargs["overwrite"], command.split()[-1].replace("-", "_"))  # its kind
    call = lambda progress, **where: fn(out, progress=progress, **kwargs, **where)  # noqa: E731
    if launch is None:
        with console.status("starting") as status:
            return call(lambda msg: status.update(msg))
    return _on_launch(dims, kwargs["device"], call)


def _print_grpo(rows: list, out: Path) -> None:
    for combo in dict.fromkeys(r["combo"] for r in rows):
        t = Table(title=f"Flow-GRPO {_label({'combo': combo})} (rollout/train; epoch 0: the parameters "
                        "that sampled)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("step", "epoch", "reward", "ratio\nmean", "ratio\nmin", "ratio\nmax", "ratio\n≡ 1",
                    "clip\nfrac", "KL"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            if r["combo"] == combo:
                t.add_row(str(r["step"]), str(r["epoch"]), f"{r['reward_mean']:.3f}",
                          f"{r['ratio_mean']:.5f}", f"{r['ratio_min']:.4f}", f"{r['ratio_max']:.4f}",
                          "yes" if r["ratio_exactly_one"] else "no", f"{r['clip_fraction']:.2f}",
                          _num(r["kl"], 2))
        console.print(t)
    console.print("KL: of the SDE transition, rollout vs trainer (mean over steps and samples); "
                  "approx_kl, loss and timings are in grpo.json", highlight=False)
    console.print(f"wrote {out}/grpo.arrow, {out}/grpo.json", highlight=False)
