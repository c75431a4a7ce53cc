r"""Where a ``drifttool recompute --grad`` spends its time, by phase of its steps.

    $ python benchmarks/profile_recompute.py ROLLOUT [--lora ADAPTER] [--gradient-checkpointing] \
          [--device cuda] [--checkpoint FOLDER] [-o OUT]

Runs the CLI's ``recompute ROLLOUT --grad`` in this process (the user's path: loading, CUDA
graphs, the canonical gradient ledger, the gradient records) with a timer around each phase of a
step, the device synchronised at each phase's start and end (so each phase's own kernels are
counted in it; the overlap of one phase's kernels with the next one's host work is lost, so the
phases' sum can exceed the recompute's own time without the timers):

* ``forward``: the model calls of a step (the sampler's ``fwd``: both CFG branches, capture
  included);
* ``backward``: ``Tensor.backward`` of the step's loss (``−mean_b logp_t``);
* ``ledger``: ``GradLedger.finish_step`` (strict: the step's canonical gradient reduction);
* ``grad records``: ``capture_lora_grads`` (the accumulated LoRA gradients digested and filed);
* ``the rest``: the recompute's seconds less these (the SDE step and logp, the step's records,
  the first call's CUDA graph captures are in ``forward``/``backward``).

Prints the recompute's own summary, then one table: each phase's total seconds, calls and
seconds a call, the first step apart from the others (compilation, graph capture). Exit status:
the recompute's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from measure_cli import cli_exit  # noqa: E402

PHASES = ("forward", "backward", "ledger", "grad records")


class Phases:
    """Seconds and calls per phase, the first call of each apart."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.rest: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.depth = 0

    def timed(self, phase: str, fn):
        def run(*args, **kwargs):
            if self.depth:  # a phase inside another (a backward inside a forward's graph capture)
                return fn(*args, **kwargs)
            self.depth += 1
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                dt = time.perf_counter() - t0
                self.depth -= 1
                if phase in self.first:
                    self.rest[phase] += dt
                else:
                    self.first[phase] = dt
                self.calls[phase] += 1
        return run


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def instrument(phases: Phases) -> None:
    """Wrap the recompute's phases (``drifttool.training.recompute``'s names) in ``phases``."""
    import drifttool.training.recompute as rec

    rec.capture_lora_grads = phases.timed("grad records", rec.capture_lora_grads)
    finish = rec.GradLedger.finish_step
    rec.GradLedger.finish_step = lambda self, step: phases.timed("ledger", finish)(self, step)
    batched = rec.micro_batched
    rec.micro_batched = lambda *a, **k: phases.timed("forward", batched(*a, **k))
    backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: phases.timed("backward", backward)(self, *a, **k)


def table(phases: Phases, seconds: float) -> str:
    """The phases as a markdown table, with the rest of the recompute's ``seconds``."""
    lines = ["| phase | total s | calls | first call s | later calls, s each |", "|---|---:|---:|---:|---:|"]
    total = 0.0
    for p in PHASES:
        n = phases.calls[p]
        if not n:
            lines.append(f"| {p} | – | 0 | – | – |")
            continue
        t = phases.first[p] + phases.rest[p]
        total += t
        later = f"{phases.rest[p] / (n - 1):.3f}" if n > 1 else "–"
        lines.append(f"| {p} | {t:.3f} | {n} | {phases.first[p]:.3f} | {later} |")
    lines.append(f"| the rest | {seconds - total:.3f} | | | |")
    lines.append(f"| recompute (its `seconds`) | {seconds:.3f} | | | |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="profile_recompute.py", description=__doc__.splitlines()[0])
    ap.add_argument("rollout", type=Path)
    ap.add_argument("--lora", default=None, help="the adapter to train (the rollout's when not given)")
    ap.add_argument("--checkpoint", default=None, help="the model folder (the rollout's when not given)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("-o", "--out", type=Path, default=None,
                    help="the recompute's artifact, a new folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    phases = Phases()
    instrument(phases)
    import drifttool.training.recompute as rec

    seconds: list[float] = []
    run = rec.recompute_run

    def recorded(*a, **k):
        summary = run(*a, **k)
        seconds.append(summary["seconds"])
        return summary

    rec.recompute_run = recorded
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "recompute"
        cmd = ["recompute", str(args.rollout), "--grad", "-o", str(out), *(["--overwrite"] if args.out is None else [])]
        for flag, value in (("--lora", args.lora), ("--checkpoint", args.checkpoint), ("--device", args.device)):
            if value is not None:
                cmd += [flag, str(value)]
        if args.gradient_checkpointing:
            cmd.append("--gradient-checkpointing")
        rc = cli_exit(cmd)
    if seconds:  # the recompute ran (a refusal printed its one line)
        print(table(phases, seconds[0]))
        if args.out is None:
            print("(the recompute's artifact was temporary and is removed: -o OUT keeps it for the "
                  "`compare:` line above)")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
