"""Experiments: rollout/trainer backend combinations, and the Flow-GRPO loop per combination.

    >>> rows = train_rollout("exp/")        # exp/train_rollout.{arrow,json} + every artifact
    >>> [(r["combo"], r["identical"]) for r in rows]
    [('production/production', False), ('strict/production', False),
     ('production/strict', False), ('strict/strict', True)]

``train_rollout`` on the embedded default, or on a model of one's own (``checkpoint``: a pipeline
or transformer folder; ``lora``: its adapter; ``steps``, ``cfg_scale``, ``batch``: the sampler's,
as ``drifttool run`` takes them). Every combination runs the same settings (one ``RunSpec``,
only the mode differs) on matched replay inputs: each re-scores the trajectory of its rollout
from the same pinned noise and prompts.

1. one LoRA adapter used by every rollout and trainer: ``lora`` as it is, else a fresh one
   (rank 4, α 8, B ~ N(0, 0.02²) so every factor has a gradient) saved to ``DIR/lora``;
2. a strict and a production rollout (``DIR/rollout-<mode>``);
3. per combination rollout/train (production/production, strict/production, production/strict,
   strict/strict) a training recompute of that rollout (``DIR/train-<train>-on-<rollout>``) in
   the trainer's layout: autograd on, backward per SDE step with LoRA gradients digested, and —
   as Flow-GRPO's trainer — one sample (with its CFG pair) per forward, prompts trimmed to it;
4. ``drifttool diff`` of rollout vs recompute per combination: max |Δ| and rel L2 of v_t (every
   branch), max |Δ| of the transition mean μ (the latent the trainer's step predicts; the stored
   latents x_t are the same bytes in both by construction), max |Δ| of logp_t, the largest KL of
   the SDE transition, the first drift; plus the rel L2 of the LoRA gradients against the
   strict/strict trainer's, the time of rollout and recompute, and the rollout's reward: the
   mean over samples of ``training.grpo.toy_reward`` of its final latents x_N. The trainer
   re-scores the stored transitions (x_t and x_{t+1} are the rollout's bytes) and computes no
   final latents of its own, so the reward is the rollout's only; the trainer's drift on the
   way to x_N is μ's.

Under torchrun (``train_rollout(dist=, parallel=)``) every rollout and trainer runs on the
launch's ranks in its layout (TP/SP/CFG-parallel, or sample-parallel without ``parallel``):
each artifact is written by its owning ranks, the adapter and the tables by rank 0, which diffs
and returns the rows (the other ranks an empty list). A production side under TP/SP is refused
by the plan, as for ``drifttool run``: ask for ``--combos strict/strict`` there.

Results: ``train_rollout.arrow`` (Arrow IPC stream, one row per combination) and
``train_rollout.json``; ``grpo_experiment`` likewise writes ``grpo.arrow`` / ``grpo.json`` with one
row per (combination, step, inner epoch).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from drifttool.artifact.reader import open_run
from drifttool.diff.clip import check_clip_range, clip_summary
from drifttool.diff.compare import diff_runs
from drifttool.collectives import barrier
from drifttool.errors import ArtifactError, DriftToolError, FixtureError
from drifttool.fixture import DEFAULT_FIXTURE, load_fixture, sealed_above
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora, lora_parameters
from drifttool.model.lora_formats import read_adapter
from drifttool.model.lora_io import save_lora
from drifttool.runner import execute, run_device
from drifttool.setting_checks import check_mode, check_mode_device
from drifttool.settings import RunSpec, resolve
from drifttool.training.grpo import MODES, GRPOConfig, grpo_loop, toy_reward
from drifttool.training.options import RerunOptions, TrainOptions
from drifttool.training.recompute import recompute_run
from drifttool.training.stored import load_rollout
from drifttool.training.trainer import check_micro_batch, trainer_model

COMBOS = (("production", "production"), ("strict", "production"), ("production", "strict"),
          ("strict", "strict"))
"""(rollout, train) backend pairs, in report order."""

TRAIN_ROLLOUT_SCHEMA = pa.schema([
    ("combo", pa.utf8()), ("rollout", pa.utf8()), ("train", pa.utf8()), ("verdict", pa.utf8()),
    ("identical", pa.bool_()), ("v_max_abs", pa.float64()), ("v_rel_l2", pa.float64()),
    ("x_max_abs", pa.float64()), ("logp_max_abs", pa.float64()), ("kl_max", pa.float64()),
    ("grad_rel_l2", pa.float64()),
    # the rollout's toy reward (``training.grpo.toy_reward`` of its final latents, mean over samples)
    ("reward", pa.float64()),
    ("first_drift", pa.utf8()), ("first_drift_step", pa.int32()),
    ("first_drift_block", pa.int32()), ("first_drift_op", pa.utf8()),
    ("first_drift_sample", pa.int32()), ("differing_records", pa.int64()),
    ("rollout_seconds", pa.float64()), ("train_seconds", pa.float64()),
    ("rollout_dir", pa.utf8()), ("train_dir", pa.utf8()),
    # with a clip range (``clip_range``): the log-prob drift against it (``diff.clip``)
    ("clip_range", pa.float64()), ("clip_verdict", pa.utf8()), ("clip_ratio_dev_max", pa.float64()),
    ("clip_fraction", pa.float64()), ("clip_max_abs", pa.float64()), ("clip_worst", pa.utf8()),
], metadata={b"drifttool.table": b"train_rollout", b"drifttool.schema_version": b"3"})
"""Version 3 added ``reward``; version 2 the ``clip_*`` columns."""

FRESH_LORA = {"rank": 4, "alpha": 8.0, "init_b_std": 0.02, "seed": 1}
"""The fresh adapter ``train_rollout`` attaches without ``lora`` (rank, alpha defaults)."""


def _worst(report, quantity: str, attr: str = "max_abs") -> float:
    vals = [getattr(q, attr) for s in report.steps for q in s.quantities
            if q.quantity == quantity and q.identical is False and getattr(q, attr) is not None]
    return max(vals) if vals else 0.0


def _kl_max(report) -> float:
    vals = [k.kl for s in report.steps for k in s.kl if k.kl is not None]
    return max(vals) if vals else 0.0


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = sorted(set(a) & set(b))
    if not keys:
        return math.nan
    va = torch.cat([a[k].reshape(-1).to(torch.float64) for k in keys])
    vb = torch.cat([b[k].reshape(-1).to(torch.float64) for k in keys])
    den = float(vb.norm())
    return float((va - vb).norm()) / den if den else (0.0 if float((va - vb).norm()) == 0 else math.inf)


def write_table(rows: list[dict[str, Any]], schema: pa.Schema | None, out: Path, stem: str) -> None:
    """``rows`` as ``<stem>.arrow`` (IPC stream) and ``<stem>.json`` under ``out``."""
    table = pa.Table.from_pylist(rows, schema=schema)
    with open(out / f"{stem}.arrow", "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (out / f"{stem}.json").write_text(json.dumps(_plain(rows), indent=2, allow_nan=False) + "\n")


def _plain(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def launch_record(dist: Any, parallel: Any) -> dict[str, Any]:
    """Where an experiment's runs ran, for its settings file: the layout (``ParallelDims.layout``
    under a plan, ``sample_parallel`` or ``single``) and the world size."""
    world = 1 if dist is None else int(dist.world_size)
    if parallel is not None and parallel.parallel:
        return {**parallel.layout(), "world_size": world}
    return {"kind": "sample_parallel" if world > 1 else "single", "world_size": world}


EXPERIMENTS = {"train_rollout": ("rollout-*", "train-*-on-*", "lora", "train_rollout.*"), "grpo": ("grpo.*",)}
"""What each experiment writes into its folder (``train_rollout``, ``grpo_experiment``): with
``--overwrite`` an earlier one's are removed before the new ones are written, so no result of
other combinations is left beside them; another experiment's and other files are kept."""
EXPERIMENT_MARKS = {kind: f"{kind}.settings.json" for kind in EXPERIMENTS}
"""The file that says a folder holds an experiment's output, per experiment."""


def check_out_dir(out: str | Path, overwrite: bool, kind: str) -> Path:
    """Refuse an ``out`` that is (or lies under) a file, that is not empty and holds no earlier
    experiment (``EXPERIMENT_MARKS``: a drifttool run, a user's folder), or that holds an earlier
    experiment of this ``kind`` (a key of ``EXPERIMENTS``) without ``overwrite``; another
    experiment's output may stay beside this one's (read only: every rank checks alike); an
    ``out`` inside a sealed fixture (``sealed_above``).

    Raises:
        ArtifactError: naming the path.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ArtifactError(f"-o {out}: {above} is not a directory")
    sealed = sealed_above(out)
    if sealed is not None:
        raise ArtifactError(f"-o {out}: inside the sealed fixture {sealed}, whose seal the experiment's "
                            "files would break; give a path outside it")
    if out.exists() and any(out.iterdir()):
        if not any((out / m).is_file() for m in EXPERIMENT_MARKS.values()):
            what = "a drifttool run (manifest.json)" if (out / "manifest.json").exists() else "no earlier experiment"
            raise ArtifactError(f"{out} is not empty and holds {what}: --overwrite replaces an earlier "
                                f"experiment's output only ({' or '.join(EXPERIMENT_MARKS.values())}); "
                                "give another -o")
        if (out / EXPERIMENT_MARKS[kind]).is_file() and not overwrite:
            raise ArtifactError(f"{out} holds an earlier {kind.replace('_', '-')} experiment (pass --overwrite "
                                "to replace it)")
    return out


def _out_dir(out: str | Path, overwrite: bool, kind: str, keep: str | Path | None = None) -> Path:
    """``out`` checked (``check_out_dir``) and made; with ``overwrite``, an earlier ``kind``
    experiment's entries in it removed (``EXPERIMENTS``), but for the one holding ``keep`` (the
    adapter the new experiment trains, where it is the earlier one's ``lora``)."""
    out = check_out_dir(out, overwrite, kind)
    out.mkdir(parents=True, exist_ok=True)
    kept = None if keep is None else Path(keep).resolve()
    if overwrite:
        for entry in sorted({e for pattern in EXPERIMENTS[kind] for e in out.glob(pattern)}):
            if kept is not None and (kept == entry.resolve() or entry.resolve() in kept.parents):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return out


def check_adapter(lora: str | Path | None, lora_rank: int | None,
                  lora_alpha: float | None) -> tuple[int | None, float | None]:
    """The fresh adapter's (rank, alpha): the given ones, else ``FRESH_LORA``'s; (None, None)
    with an adapter ``lora`` of one's own (the command line only: nothing is read).

    Raises:
        DriftToolError: ``lora`` with a rank or alpha (the adapter is used as it is); an alpha
            that is not a finite number > 0 (its update is scaled by alpha / rank: 0 cancels it).
    """
    if lora is None:
        if lora_alpha is not None and not (math.isfinite(lora_alpha) and lora_alpha > 0):
            raise DriftToolError(f"--lora-alpha must be a finite number > 0 (the fresh adapter's update "
                                 f"is scaled by alpha / rank), got {lora_alpha:g}")  # -3, not -3.0
        return (FRESH_LORA["rank"] if lora_rank is None else lora_rank,
                FRESH_LORA["alpha"] if lora_alpha is None else lora_alpha)
    given = [o for o, v in (("--lora-rank", lora_rank), ("--lora-alpha", lora_alpha)) if v is not None]
    if given:
        raise DriftToolError(f"{' and '.join(given)} set the fresh adapter's shape; --lora {lora} is "
                             f"used as it is: drop {' and '.join(given)}")
    return None, None


FROM_FIXTURE = ("seed", "eta", "dtype", "cfg_layout", "timestep_policy")
"""Settings every combination takes from the fixture alone (the experiment has no option for
them; a preset would give some)."""


def check_experiment_fixture(fixture: str | Path | None) -> None:
    """Refuse, in the experiment's words, a fixture it cannot run: its settings would be refused
    in the words of ``drifttool run`` (``--mode``, ``--prompt-embeds``: flags the experiment
    does not have).

    Raises:
        FixtureError: a chain or edit fixture (its prompts are texts its pipeline encodes; the
            experiment runs from prompt embeddings), one with a ``preset`` (a production
            pipeline's arithmetic, which the experiment's strict sides cannot run), or one whose
            settings lack one the experiment has no option for (``FROM_FIXTURE``).
    """
    fx = load_fixture(DEFAULT_FIXTURE if fixture is None else fixture)
    kind = next((k for k in ("chain", "edit") if fx.meta.get(k) is not None), None)
    if kind is not None:
        raise FixtureError(f"--fixture {fixture}: a{'n' * (kind == 'edit')} {kind} fixture, whose "
                           "prompts are texts its pipeline encodes; the experiment runs a fixture of "
                           "prompt embeddings (as tiny-t2i)")
    if fx.settings.get("preset") is not None:
        raise FixtureError(f"--fixture {fixture}: its preset {fx.settings['preset']!r} reproduces a "
                           "production pipeline's arithmetic, which the experiment's strict sides "
                           "cannot run; it runs a fixture without a preset (as tiny-t2i)")
    missing = [k for k in FROM_FIXTURE if fx.settings.get(k) is None]
    if missing:
        raise FixtureError(f"{fx.path / 'fixture.json'}: its settings lack {', '.join(missing)}, "
                           "which the experiment takes from its fixture")


def train_rollout(
    out: str | Path,
    *,
    fixture: str | Path | None = None,
    checkpoint: str | Path | None = None,
    lora: str | Path | None = None,
    samples: list[int] | None = None,
    batch: int | None = None,
    steps: int | None = None,
    cfg_scale: float | None = None,
    capture: str = "L1",
    micro_batch: int | None = 1,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    gradient_checkpointing: bool = False,
    grad: bool = True,
    combos: tuple[tuple[str, str], ...] = COMBOS,
    overwrite: bool = False,
    progress=None,
    device: str = "cpu",
    height: int | None = None,
    width: int | None = None,
    dist: Any = None,
    parallel: Any = None,
    clip_range: float | None = None,
) -> list[dict[str, Any]]:
    """Run the four rollout/train combinations (module docstring); returns one row each.

    Args:
        fixture, checkpoint, samples, batch, steps, cfg_scale, capture: the rollouts' settings
            (``RunSpec``; ``None``: the fixture's), the same for every combination. A checkpoint
            (a diffusers transformer or pipeline folder) replaces the fixture's model; prompt
            embeddings and noise are then drawn from the seed at its widths, as for
            ``drifttool run --checkpoint``.
        lora: an adapter (peft or diffusers folder, or .safetensors: ``model.lora_io.load_lora``)
            used as it is (merged) by every rollout and trainer; without it a fresh one
            (``lora_rank``, ``lora_alpha``; default ``FRESH_LORA``) is written to ``DIR/lora``.
        device: where every rollout and trainer runs (``RunSpec.device``); a combination with a
            strict side is refused on a device without a strict family (CUDA today).
        height, width: image size in pixels (multiples of 16; default: the fixture's grid).
        micro_batch: samples per trainer forward (``micro_batched``); None = the rollout's batch.
        grad: trainer backward per SDE step (``grad_rel_l2`` is NaN without it).
        progress: optional ``callable(str)`` told what runs next.
        clip_range: a PPO clip range ε: each combination's log-prob drift (rollout vs recompute)
            is judged against it (``drifttool.diff.clip``; the row's ``clip_*`` fields, ``None``
            without one).
        dist, parallel: this process's place in a torchrun launch and its layout
            (``DistContext``, ``ParallelDims`` or None for sample-parallel), as
            ``runner.execute`` takes them; default one process. Rank 0 returns the rows, the
            other ranks ``[]``.

    Raises:
        FixtureError: a fixture the experiment cannot run (``check_experiment_fixture``).
        DriftToolError: bad settings (a layout the runs do not allow included; ``lora`` with
            ``lora_rank`` or ``lora_alpha``: ``check_adapter``); an adapter that cannot be read
            (``CheckpointError``) or does not fit the model; ``out`` not empty without
            ``overwrite``.
    """
    # every setting is checked before anything is written (each mode used, on the device)
    if clip_range is not None:
        clip_range = check_clip_range(clip_range)
    lora_rank, lora_alpha = check_adapter(lora, lora_rank, lora_alpha)
    if lora is not None:
        read_adapter(lora)  # unreadable: refused here (its fit to the model: by the first rollout)
    check_experiment_fixture(fixture)
    spec = RunSpec(fixture=fixture, checkpoint=checkpoint, samples=samples, batch=batch, steps=steps,
                   cfg_scale=cfg_scale, capture=capture, device=device, height=height, width=width)
    fx, s = resolve(spec)
    check_micro_batch(micro_batch, len(s.samples))
    for mode in dict.fromkeys(m for pair in combos for m in pair):
        check_mode_device(check_mode(MODES[mode]), s.device)
    train = TrainOptions(grad=grad, gradient_checkpointing=gradient_checkpointing,
                         micro_batch=micro_batch)
    say = progress or (lambda _: None)
    root = dist is None or dist.rank == 0
    where = dict(dist=dist, parallel=parallel)
    out = check_out_dir(out, overwrite, "train_rollout")
    if dist is not None:
        barrier()  # every rank has checked ``out`` before rank 0 writes into it
    if root and lora is None:
        model = load_checkpoint(s.checkpoint or fx.model_dir, dtype=s.torch_dtype, device=s.device)
        add_lora(model, rank=lora_rank, alpha=lora_alpha, seed=FRESH_LORA["seed"],
                 init_b_std=FRESH_LORA["init_b_std"])
        save_lora(model, _out_dir(out, overwrite, "train_rollout") / "lora")
        del model  # the rollouts load their own (at full size: no second copy in memory)
    elif root:
        _out_dir(out, overwrite, "train_rollout", keep=lora)
    if dist is not None:
        barrier()  # the adapter is written before any rank loads it
    spec = dataclasses.replace(spec, lora=out / "lora" if lora is None else lora)
    rollouts: dict[str, tuple[Path, float]] = {}
    for mode in dict.fromkeys(r for r, _ in combos):
        say(f"rollout {mode}")
        path = out / f"rollout-{mode}"
        t0 = time.perf_counter()
        execute(dataclasses.replace(spec, mode=MODES[mode]), path, overwrite=True, **where)
        rollouts[mode] = (path, time.perf_counter() - t0)
    rows, grads = [], {}
    for r_mode, t_mode in combos:
        say(f"train {t_mode} on rollout {r_mode}")
        src, t_roll = rollouts[r_mode]
        stored = load_rollout(src)
        trainer = trainer_model(stored, device=s.device if dist is None else run_device(s.device, dist))
        dst = out / f"train-{t_mode}-on-{r_mode}"
        # the seconds only: the trajectory's tensors (and, without grad, its autograd graph) go
        t_train = recompute_run(stored, dst, RerunOptions(mode=MODES[t_mode], capture=capture,
                                                          device=s.device, overwrite=True),
                                train, model=trainer, **where)["seconds"]
        if root:
            grads[(r_mode, t_mode)] = {n: p.grad.detach().clone()
                                       for n, p in lora_parameters(trainer).items() if p.grad is not None}
        del trainer  # one model in memory at a time (at full size: tens of GiB each)
        if not root:
            continue
        report = diff_runs(open_run(src), open_run(dst), clip_range=clip_range)
        fd = report.first_drift
        rows.append({
            "combo": f"{r_mode}/{t_mode}", "rollout": r_mode, "train": t_mode,
            "verdict": report.verdict.value, "identical": report.verdict.value == "identical",
            "v_max_abs": _worst(report, "v_t"), "v_rel_l2": _worst(report, "v_t", "rel_l2"),
            "x_max_abs": _worst(report, "mu"), "logp_max_abs": _worst(report, "logp_t"),
            "kl_max": _kl_max(report), "grad_rel_l2": math.nan,
            "reward": float(toy_reward(stored.latents[-1]).mean()),
            "first_drift": fd.where() if fd else "",
            "first_drift_step": fd.step if fd else None,
            "first_drift_block": fd.block if fd else None,
            "first_drift_op": fd.op if fd else None,
            "first_drift_sample": fd.sample if fd else None,
            "differing_records": sum(c.differ for c in report.counts.values()),
            "rollout_seconds": t_roll, "train_seconds": t_train,
            "rollout_dir": str(src), "train_dir": str(dst), **clip_summary(report.clip),
        })
    if not root:
        return []
    ref = grads.get(("strict", "strict"))
    if ref is not None:
        for row in rows:
            row["grad_rel_l2"] = _rel(grads[(row["rollout"], row["train"])], ref)
    write_table(rows, TRAIN_ROLLOUT_SCHEMA, out, "train_rollout")
    first = next(iter(rollouts.values()))[0]
    adapter = open_run(first).manifest.get("lora") or {}
    (out / "train_rollout.settings.json").write_text(json.dumps({
        "fixture": fx.name, "checkpoint": s.checkpoint, "samples": list(s.samples), "steps": s.steps,
        "cfg_scale": s.cfg_scale, "capture": capture, "micro_batch": micro_batch,
        "device": s.device, "img_grid": list(s.img_grid),
        "lora": ({**FRESH_LORA, "rank": lora_rank, "alpha": lora_alpha} if lora is None else {})
        | {"path": str(Path(spec.lora).resolve()), "digest": adapter.get("digest")},
        "gradient_checkpointing": gradient_checkpointing, "grad": grad, "combos": [list(c) for c in combos],
        "clip_range": clip_range,
        "launch": launch_record(dist, parallel),
    }, indent=2) + "\n")
    return rows


def grpo_experiment(
    out: str | Path,
    *,
    combos: tuple[tuple[str, str], ...] = COMBOS,
    overwrite: bool = False,
    progress=None,
    dist: Any = None,
    parallel: Any = None,
    **config: Any,
) -> list[dict[str, Any]]:
    """``grpo_loop`` once per combination (same seed, prompts and fresh adapter each time);
    rows written to ``grpo.arrow`` / ``grpo.json`` (plus ``grpo.settings.json``). Under a
    launch (``dist``, ``parallel``: ``grpo_loop``) every rank runs every loop and rank 0 writes
    the tables; every rank returns the (equal) rows."""
    out = check_out_dir(out, overwrite, "grpo")
    if dist is not None:
        barrier()  # every rank has checked ``out`` before rank 0 writes into it
    root = dist is None or dist.rank == 0
    say = progress or (lambda _: None)
    rows = []
    for r_mode, t_mode in combos:
        say(f"grpo {r_mode}/{t_mode}")
        rows += grpo_loop(GRPOConfig(rollout_mode=r_mode, train_mode=t_mode, **config),
                          dist=dist, parallel=parallel)
    if not root:
        return rows
    out = _out_dir(out, overwrite, "grpo")
    write_table(rows, None, out, "grpo")
    (out / "grpo.settings.json").write_text(json.dumps(
        {**asdict(GRPOConfig(**config)), "combos": [list(c) for c in combos],
         "launch": launch_record(dist, parallel)}, indent=2) + "\n")
    return rows
