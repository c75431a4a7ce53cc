"""Derive a tolerance profile (``drifttool diff --tolerance``) from a pair of runs.

    python tools/tolerance_profile.py RUN_A RUN_B --name strict-cuda1-vs-cpu \\
        --description "strict CUDA (cuda1) against strict CPU (v2), tiny fixture" \\
        -o drifttool/diff/profiles/strict-cuda1-vs-cpu.json

Run A is the baseline (e.g. strict on the CPU), run B the other arithmetic (strict on CUDA).
Every bound is ``--factor`` × the largest measure seen over the pair's differing records of that
operator or step quantity (``drifttool.diff.tolerance.measure``); what never differed gets 0. The
raw maxima, both runs' settings and the host are kept in the profile under ``measured_on``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

from drifttool.artifact import open_run
from drifttool.diff.compare import aligned_tables, diff_runs
from drifttool.diff.tolerance import PROFILE_SCHEMA, PROFILE_VERSION, load_profile, measure
from drifttool.errors import DriftToolError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path, help="the baseline run (e.g. strict on the CPU)")
    ap.add_argument("run_b", type=Path, help="the same program computed the other way (e.g. strict on CUDA)")
    ap.add_argument("--name", required=True, help="the profile's name (diff --tolerance NAME once shipped)")
    ap.add_argument("--description", default="", help="one line on what was measured")
    ap.add_argument("--factor", type=float, default=4.0,
                    help="each bound = FACTOR x the largest measure seen (default: %(default)s; > 0)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the profile JSON to write (its folder is made)")
    args = ap.parse_args(argv)
    if not (args.factor > 0 and math.isfinite(args.factor)):
        print(f"error: --factor {args.factor:g}: give a finite number > 0 (the bounds' multiple of the "
              "measured maxima)", file=sys.stderr)
        return 2
    try:
        return _write(args)
    except DriftToolError as e:  # bad input: one line, exit 2 (as drifttool's commands)
        print(f"error: {e}", file=sys.stderr)
        return 2


def _write(args: argparse.Namespace) -> int:
    ra, rb = open_run(args.run_a), open_run(args.run_b)
    diff = diff_runs(ra, rb)
    if diff.verdict.value in ("incomparable", "inconclusive") or diff.input_differences:
        raise DriftToolError(f"{args.run_a} and {args.run_b} are not one program's two arithmetics "
                             f"({diff.verdict.value}: {diff.reason}): no profile is derived")
    derived = measure(ra, rb, *aligned_tables(ra, rb), factor=args.factor)

    def side(run):
        s = run.manifest.get("settings", {})
        return {k: s.get(k) for k in ("mode", "device", "dtype", "capture", "steps", "fixture") if k in s}

    profile = {
        "schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "name": args.name,
        "description": args.description,
        "applies_to": {"a": side(ra), "b": side(rb)},
        "derivation": f"each bound = {args.factor:g} x the largest measure over the pair's differing "
                      "records of that operator / step quantity, rounded up to 2 significant digits; "
                      "0 = byte-equal in the measured pair",
        "measured_on": {"date": datetime.date.today().isoformat(), "host": platform.node(),
                        "python": platform.python_version(), "runs": [str(args.run_a), str(args.run_b)],
                        "maxima": derived["measured"]},
        "ops": derived["ops"], "steps": derived["steps"],
    }
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(profile, indent=1) + "\n")
    except OSError as e:
        raise DriftToolError(f"{args.out}: cannot write the profile ({e.strerror or e})") from None
    load_profile(args.out)  # what we wrote must load
    grads = sum(n.endswith((".lora_A", ".lora_B", ".lora_magnitude_vector")) for n in profile["ops"])
    print(f"wrote {args.out}: {len(profile['ops']) - grads} operators, {grads} LoRA gradients, "
          f"{len(profile['steps'])} step quantities")
    if diff.verdict.value == "identical":
        print("note: the two runs are bitwise identical: every bound is 0 (byte-equal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
