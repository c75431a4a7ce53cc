r"""What a user's full-size jobs cost, side by side in one run: the CLI's commands, timed.

    $ python benchmarks/full_size_table.py [--work /dev/shm/drifttool-table] [--layers 60] \
          [--shapes 1024x1024,1328x1328,1664x928] [--batches 1] [--steps 10] [--device cuda] \
          [--parts run,replay,recompute,localize,diffusers]

A random full-width pipeline folder with ``--layers`` blocks and a random LoRA adapter is written
once under ``--work`` (``make_random_checkpoint.py``; reused when present; its layer count is
the folder's, whatever ``--layers`` says later). Then, per shape
(height × width) and batch (``drifttool run --batch``: logical samples, each with both CFG
branches batched, so the transformer's batch is twice it), the commands of ``--parts``, each
through ``measure_cli.py`` (the ``diffusers`` part: ``diffusers_jobs.py``) in a fresh process:

* ``run``: strict ``--steps``-step CFG/SDE trajectories with the adapter (``--lora-mode``, by
  default ``unfused-fp32``: W stays bf16 and the FP32 factors run beside it, a trainer's peft
  layout; a ``merged`` adapter's strict gradients hold an FP32 [out, in] per adapted weight and
  (sample, CFG branch) until the step's end, and their running sum: for this adapter (eight
  3072 × 3072 projections a block) 16.9 GiB a row, 51 GiB at batch 1 with CFG, which an 80 GiB GPU
  cannot hold beside the weights) at capture L0, L1 and L2, and one in production mode (``--mode auto``) at L0 and at L2;
* ``replay``: the L1 trajectory replayed, and diffed against it (expected identical);
* ``recompute``: its training recompute with gradients, without and with gradient
  checkpointing (``--checkpointing off|on|both``, default both: on an 80 GiB GPU only ``on``
  fits a full-size recompute), each diffed against the trajectory (expected identical), and
  with both, the two diffed against each other (their LoRA gradients too: expected identical);
* ``localize``: the strict and production L0 trajectories diffed with ``--localize`` (the first
  drifting step re-run at L2) beside the plain diff of the two L2 trajectories, which costs the
  L2 runs themselves;
* ``diffusers``: the same jobs as diffusers and peft run them (``diffusers_jobs.py``, timed the
  same way): an unmodified ``QwenImagePipeline`` trajectory with the adapter loaded, and a peft
  LoRA training recompute with and without gradient checkpointing (``--checkpointing``), for
  the time and peak memory beside drifttool's.

Each shape and batch writes under ``WORK/<shape>-b<batch>-<lora mode>-s<steps>/`` (with
``-<device>`` after it for a device other than ``cuda``), so calls with another mode, step count
or device never reuse each other's rollouts. Each row: the command, its exit
status, its verdict (the first IDENTICAL, DRIFT, WITHIN, ... or error line it printed), wall seconds (the command's own, imports not counted;
loading, weight digest and capture included), the peak GPU memory torch's allocator held and
the peak host resident memory. The table is printed and appended, one JSON object a row, to
``WORK/table.jsonl`` with the hardware, versions and date. The transformer forward alone
beside diffusers' is ``bench_gpu_forward.py``'s; the load beside diffusers' ``from_pretrained``
is ``bench_load.py``'s. Runs on the CPU too (``--device cpu``; small ``--layers`` and shapes
then, e.g. ``--layers 2 --shapes 256x256 --steps 2``), to try the commands. Needs diffusers 0.42
(the ``[test]`` extra) to write the random folder. Exit status: 0 when every command exited as
expected (each row's ``expected_rc``), 1 when one did not, 2 for a bad argument (one line on
stderr, before anything runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from drifttool.diff.report import Verdict  # noqa: E402
from drifttool.model.lora import LORA_MODES  # noqa: E402

VERDICT_WORDS = {*(v.value.upper() for v in Verdict), "WITHIN", "BEYOND", "error"}
"""The words a command's verdict line starts with: diff's verdicts, a tolerance profile's, an error."""

PARTS = ("run", "replay", "recompute", "localize", "diffusers")
DIFFUSERS = "diffusers_jobs.py"
"""An argv starting with this runs ``benchmarks/diffusers_jobs.py`` (diffusers' own job), not the CLI."""
RECOMPUTES = {"off": ("recompute --grad", []), "on": ("recompute --grad, checkpointing", ["--gradient-checkpointing"])}
CHECKPOINTING = {"off": ("off",), "on": ("on",), "both": ("off", "on")}
"""``--checkpointing``: which of ``RECOMPUTES`` run (without gradient checkpointing, with it)."""


def measured(argv: list[str], log: Path) -> dict:
    """``drifttool argv`` in a fresh process (``measure_cli.py``), or ``diffusers_jobs.py`` when
    ``argv`` starts with ``DIFFUSERS``: its rc, wall s, peak GPU GiB and peak host GiB
    (``os.wait4``); its output goes to ``log``."""
    script, args = (DIFFUSERS, argv[1:]) if argv[0] == DIFFUSERS else ("measure_cli.py", argv)
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    text = log.read_text(encoding="utf-8", errors="replace")
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("MEASURED ")), None)
    row = {"rc": os.waitstatus_to_exitcode(status), "wall_s": None, "peak_gpu_gib": None}
    if line is not None:
        row.update(json.loads(line[len("MEASURED "):]))
    row["peak_host_gib"] = round(usage.ru_maxrss / 2**20, 2)  # ru_maxrss: KiB on Linux
    row["result"] = _verdict(text)
    row["command"] = (f"python benchmarks/{DIFFUSERS} " + shlex.join(args) if script == DIFFUSERS
                      else "drifttool " + shlex.join(argv))
    return row


def case_dir(work: Path, shape: str, batch: int, args) -> Path:
    """Where one shape and batch's artifacts and logs go: the LoRA mode and step count in the name,
    so a later call with others never reuses (or labels as its own) an earlier call's rollouts."""
    device = "" if args.device == "cuda" else "-" + re.sub(r"[^A-Za-z0-9]", "", args.device)
    return work / f"{shape}-b{batch}-{args.lora_mode}-s{args.steps}{device}"


def cases(args, work: Path, shape: str, batch: int):
    """(label, drifttool argv, expected exit status or None) of one shape and batch, in order."""
    h, w = _shape(shape)
    tag = case_dir(work, shape, batch, args)
    lora = ["--lora", str(work / "lora"), "--device", args.device]
    run = ["--checkpoint", str(work / "qwen"), *lora, "--lora-mode", args.lora_mode, "--height", str(h),
           "--width", str(w), "--steps", str(args.steps), "--batch", str(batch), "--overwrite"]
    parts = set(args.parts.split(","))
    if "run" in parts:
        for mode, level in (("strict", "L0"), ("strict", "L1"), ("strict", "L2"), ("auto", "L0"), ("auto", "L2")):
            yield (f"run {mode} {level}", ["run", *run, "--mode", mode, "--capture", level,
                                             "-o", str(tag / f"{mode}-{level}")], 0)
    rollout = str(tag / "strict-L1")
    if "replay" in parts:
        yield ("replay (L1)", ["replay", rollout, "--device", args.device, "-o", str(tag / "replay"),
                               "--overwrite"], 0)
        yield ("diff rollout / replay", ["diff", rollout, str(tag / "replay")], 0)
    if "recompute" in parts:
        outs = []
        for name, extra in (RECOMPUTES[c] for c in CHECKPOINTING[args.checkpointing]):
            outs.append(str(tag / _slug(name)))
            yield (name, ["recompute", rollout, *lora, "--grad", *extra, "-o", outs[-1], "--overwrite"], 0)
            yield (f"diff rollout / {name}", ["diff", rollout, outs[-1]], 0)
        if len(outs) == 2:  # checkpointing off against on: v_t, logp_t and the LoRA gradients
            yield ("diff recompute / checkpointing", ["diff", *outs], 0)
    if "localize" in parts:
        yield ("diff --localize, L0 pair", ["diff", str(tag / "strict-L0"), str(tag / "auto-L0"), "--localize",
                                            "--checkpoint", str(work / "qwen")], 1)
        yield ("diff, L2 pair", ["diff", str(tag / "strict-L2"), str(tag / "auto-L2")], 1)
    if "diffusers" in parts:
        job = ["--checkpoint", str(work / "qwen"), "--lora", str(work / "lora"), "--height", str(h), "--width",
               str(w), "--steps", str(args.steps), "--batch", str(batch), "--device", args.device]
        yield ("diffusers trajectory, adapter loaded", [DIFFUSERS, "trajectory", *job], 0)
        for name, extra in (RECOMPUTES[c] for c in CHECKPOINTING[args.checkpointing]):
            yield (f"diffusers + peft {name}", [DIFFUSERS, "recompute", *job, *extra], 0)


def _shape(text: str) -> tuple[int, int]:
    """``HEIGHTxWIDTH`` in pixels as (height, width); ``SystemExit`` with one line otherwise."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 and int(p) % 16 == 0 for p in parts):
        _refuse(f"--shapes {text!r}: give HEIGHTxWIDTH in pixels, multiples of 16, "
                 f"e.g. 1024x1024")
    return int(parts[0]), int(parts[1])


def _refuse(message: str) -> NoReturn:
    """One line on stderr, exit status 2 (a bad argument or a missing library: nothing ran)."""
    print(f"full_size_table.py: {message}", file=sys.stderr)
    sys.exit(2)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _verdict(text: str) -> str | None:
    """The first verdict word a command printed at the start of a line (IDENTICAL, DRIFT,
    WITHIN, ...; ``error`` for an error line), None if none."""
    for line in text.splitlines():
        word = line.strip().split(" ", 1)[0].rstrip(":")
        if word in VERDICT_WORDS:
            return word
    return None


def _slug(label: str) -> str:
    """A case label as a file name: letters, digits and underscores ("recompute --grad, checkpointing"
    → "recompute_grad_checkpointing")."""
    return "_".join(re.findall(r"[A-Za-z0-9]+", label))


def _shown(value) -> str:
    """A measured number as printed, "–" where none was measured (no CUDA, no MEASURED line)."""
    return "–" if value is None else f"{value}"


def environment(device: str) -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    return {"date": datetime.date.today().isoformat(), "device": gpu or platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/drifttool-table"),
                    help="the pipeline folder, adapter, artifacts, logs and table.jsonl (default: %(default)s; "
                         "an existing folder keeps its block count)")
    ap.add_argument("--layers", type=int, default=60, help="blocks of a new pipeline folder (default: %(default)s)")
    ap.add_argument("--shapes", default="1024x1024,1328x1328,1664x928",
                    help="comma-separated HEIGHTxWIDTH in pixels (default: %(default)s)")
    ap.add_argument("--batches", default="1", help="comma-separated logical samples per run (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="denoising steps (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    ap.add_argument("--lora-mode", default="unfused-fp32", choices=LORA_MODES,
                    help="the rollouts' adapter mode (drifttool run --lora-mode; the recomputes take the "
                         "rollout's; default: %(default)s, a trainer's peft layout)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--checkpointing", default="both", choices=CHECKPOINTING,
                    help="the recomputes: without gradient checkpointing, with it, or both (default: "
                         "%(default)s; on an 80 GiB GPU a full-size recompute fits only with it)")
    args = ap.parse_args()
    bad = sorted(set(args.parts.split(",")) - set(PARTS))
    if bad:
        _refuse(f"unknown parts {bad}: choose from {', '.join(PARTS)}")
    for shape in args.shapes.split(","):
        _shape(shape)
    if not all(b.isdigit() and int(b) > 0 for b in args.batches.split(",")):
        _refuse(f"--batches {args.batches!r}: give positive integers, e.g. 1,2")
    if not 2 <= args.steps <= 1000:
        _refuse(f"--steps {args.steps}: a trajectory takes 2 to 1000 steps")
    if args.device.startswith("cuda") and not _cuda():
        _refuse(f"--device {args.device}: this machine has no CUDA device "
                 f"(--device cpu with small --layers and shapes tries the commands)")
    try:
        import diffusers  # noqa: F401  (make_random_checkpoint.py writes the folder with it)
    except ImportError:
        _refuse("needs diffusers 0.42 to write the random pipeline folder "
                 "(pip install -e '.[test]')")
    args.work.mkdir(parents=True, exist_ok=True)
    if not ((args.work / "qwen" / "model_index.json").exists() and (args.work / "lora").exists()):
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_random_checkpoint.py"), "--layers",
                        str(args.layers), "--out", str(args.work / "qwen"), "--lora", str(args.work / "lora"),
                        "--device", args.device], check=True, cwd=ROOT)
    env = environment(args.device)
    layers = json.loads((args.work / "qwen" / "transformer" / "config.json").read_text())["num_layers"]
    rows = []
    for shape in args.shapes.split(","):
        for batch in map(int, args.batches.split(",")):
            case_dir(args.work, shape, batch, args).mkdir(exist_ok=True)
            for label, argv, expect in cases(args, args.work, shape, batch):
                log = case_dir(args.work, shape, batch, args) / f"{_slug(label)}.log"
                row = {**env, "layers": layers, "shape": shape, "batch": batch, "steps": args.steps,
                       "lora_mode": args.lora_mode, "case": label, "expected_rc": expect, **measured(argv, log)}
                rows.append(row)
                flag = "" if expect is None or row["rc"] == expect else f"  (expected exit {expect}: see {log})"
                print(f"{shape} b{batch} {label}: rc {row['rc']}, {_shown(row['result'])}, {_shown(row['wall_s'])} s, "
                      f"GPU {_shown(row['peak_gpu_gib'])} GiB, host {row['peak_host_gib']} GiB{flag}", flush=True)
                with open(args.work / "table.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{layers} blocks, {args.steps} steps, CFG batched, LoRA {args.lora_mode} — {env['date']} — "
                        f"{env['device']}, "
                        f"torch {env['torch']}")
    for col in ("shape", "batch", "case", "rc", "result", "wall s", "peak GPU GiB", "peak host GiB"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        rc = f"{r['rc']}" if r["expected_rc"] is None or r["rc"] == r["expected_rc"] else f"{r['rc']} (≠{r['expected_rc']})"
        table.add_row(r["shape"], str(r["batch"]), r["case"], rc, _shown(r["result"]), _shown(r["wall_s"]),
                      _shown(r["peak_gpu_gib"]),
                      _shown(r["peak_host_gib"]))
    Console(width=140).print(table)
    return 0 if all(r["expected_rc"] is None or r["rc"] == r["expected_rc"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
