#!/usr/bin/env bash
# Build the xfuser (xDiT) CPU test environment in the venv $1 (default .ci-venv-xfuser) for the
# tests marked xfuser: torch 2.13.0+cpu first, then xfuser 0.7.0 with its own dependencies (none of
# them asks for another torch: checked with pip install --dry-run), diffusers 0.42.1 (the release
# drifttool's diffusers adapter and xfuser's Qwen-Image wrapper share), triton 3.6.0 (xfuser's
# import needs it), drifttool editable from this checkout, and the test runner.
#   tests/adapters_xfuser/build_env.sh /tmp/venv-xfuser
#   /tmp/venv-xfuser/bin/python -m pytest -q -n 0 -m xfuser tests/adapters_xfuser
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.ci-venv-xfuser}"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0                   # the CPU build; first, as everywhere
# one resolve, so that drifttool's own caps (typer, numpy for Triton's interpreter) hold
"$PY" -m pip install -q xfuser==0.7.0 diffusers==0.42.1 triton==3.6.0 "numpy>=1.24,<2.4" \
    "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100" -e .
"$PY" - <<'PY'
import importlib.metadata as m
got = {p: m.version(p) for p in ("torch", "xfuser", "diffusers", "triton")}
assert got["torch"].endswith("+cpu") and got["xfuser"] == "0.7.0" \
    and got["diffusers"] == "0.42.1", got
print("xfuser test environment:", ", ".join(f"{k} {v}" for k, v in got.items()))
PY
