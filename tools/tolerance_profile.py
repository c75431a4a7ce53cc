"""Derive a tolerance profile (``drifttool diff --tolerance``) from one or more pairs of runs.

    python tools/tolerance_profile.py RUN_A RUN_B [RUN_A2 RUN_B2 ...] --name strict-cuda1-vs-cpu \\
        --description "strict CUDA (cuda1) against strict CPU (v2), tiny fixture" \\
        -o drifttool/diff/profiles/strict-cuda1-vs-cpu.json

In each pair run A is the baseline (e.g. strict on the CPU), run B the other arithmetic (strict
on CUDA); several pairs (other seeds) measure more of what the two arithmetics do. Every bound is
``--factor`` × the largest measure seen over all pairs' differing records of that operator or
step quantity (``drifttool.diff.tolerance.measure``); what never differed in any pair gets 0.
The raw maxima, the runs, their settings and the host are kept in the profile under
``measured_on``. Pairs must share their settings (one program, other inputs).
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
from drifttool.diff.tolerance import PROFILE_SCHEMA, PROFILE_VERSION, load_profile, measure, run_scope
from drifttool.errors import DriftToolError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", metavar="RUN_A RUN_B",
                    help="pairs of runs: the baseline (e.g. strict on the CPU), then the same program "
                         "computed the other way (e.g. strict on CUDA)")
    ap.add_argument("--name", required=True, help="the profile's name (diff --tolerance NAME once shipped)")
    ap.add_argument("--description", default="", help="one line on what was measured")
    ap.add_argument("--factor", type=float, default=4.0,
                    help="each bound = FACTOR x the largest measure seen (default: %(default)s; > 0)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the profile JSON to write (its folder is made)")
    ap.add_argument("--host", default=None,
                    help="the hardware and versions measured on, for measured_on (default: this host's name)")
    args = ap.parse_args(argv)
    if len(args.runs) % 2:
        print(f"error: {len(args.runs)} runs given: give pairs (RUN_A RUN_B [RUN_A2 RUN_B2 ...])", file=sys.stderr)
        return 2
    if not (args.factor > 0 and math.isfinite(args.factor)):
        print(f"error: --factor {args.factor:g}: give a finite number > 0 (the bounds' multiple of the "
              "measured maxima)", file=sys.stderr)
        return 2
    try:
        return _write(args)
    except DriftToolError as e:  # bad input: one line, exit 2 (as drifttool's commands)
        print(f"error: {e}", file=sys.stderr)
        return 2


def _merged(into: dict, derived: dict) -> None:
    """Fold one pair's ``measure`` into ``into``: the larger value per operator / quantity and
    bound (a bound is the rounded-up multiple of its maximum, so the larger bound is the bound of
    the larger maximum)."""
    for mine, theirs in ((into["ops"], derived["ops"]), (into["steps"], derived["steps"]),
                         (into["measured"]["ops"], derived["measured"]["ops"]),
                         (into["measured"]["steps"], derived["measured"]["steps"])):
        for name, bounds in theirs.items():
            have = mine.setdefault(name, dict(bounds))
            for b, v in bounds.items():
                have[b] = max(have[b], v)


def _write(args: argparse.Namespace) -> int:
    pairs = list(zip(args.runs[0::2], args.runs[1::2]))
    derived = {"ops": {}, "steps": {}, "measured": {"ops": {}, "steps": {}}}
    identical, first = True, None
    for path_a, path_b in pairs:
        ra, rb = open_run(path_a), open_run(path_b)
        diff = diff_runs(ra, rb)
        if diff.verdict.value in ("incomparable", "inconclusive") or diff.input_differences:
            raise DriftToolError(f"{path_a} and {path_b} are not one program's two arithmetics "
                                 f"({diff.verdict.value}: {diff.reason}): no profile is derived")
        sides = {"a": run_scope(ra), "b": run_scope(rb)}
        if first is None:
            first = sides
        elif sides != first:
            off = [f"run {side.upper()} {k} {sides[side].get(k)!r} (first pair: {first[side].get(k)!r})"
                   for side in ("a", "b") for k in dict.fromkeys([*first[side], *sides[side]])
                   if sides[side].get(k) != first[side].get(k)]
            raise DriftToolError(f"{path_a} and {path_b} are another program than the first pair "
                                 f"({', '.join(off)}): a profile measures one program")
        identical = identical and diff.verdict.value == "identical"
        _merged(derived, measure(ra, rb, *aligned_tables(ra, rb), factor=args.factor))

    profile = {
        "schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "name": args.name,
        "description": args.description,
        "applies_to": first,
        "derivation": f"each bound = {args.factor:g} x the largest measure over the differing records "
                      f"of that operator / step quantity in {len(pairs)} pair(s) of runs, rounded up to "
                      "2 significant digits; 0 = byte-equal in every measured pair",
        "measured_on": {"date": datetime.date.today().isoformat(), "host": args.host or platform.node(),
                        "python": platform.python_version(), "runs": [str(r) for r in args.runs],
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
    if identical:
        print("note: every pair is bitwise identical: every bound is 0 (byte-equal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
