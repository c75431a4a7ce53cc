#!/usr/bin/env bash
# Build the vllm-omni CPU test environment in the venv $1 (default .ci-venv-vllm-omni) for the
# tests marked vllm_omni: torch 2.13.0+cpu, vllm 0.30.0 and vllm-omni 0.30.0 without their CUDA
# dependencies, diffusers 0.40.0 (vllm-omni's pin), drifttool editable from this checkout.
#   tests/adapters_vllm/build_env.sh /tmp/venv-omni
#   /tmp/venv-omni/bin/python -m pytest -q -n 0 -m vllm_omni tests/adapters_vllm
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.ci-venv-vllm-omni}"
HERE=tests/adapters_vllm
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q --no-compile torch==2.13.0      # the CPU build; first, as everywhere
"$PY" -m pip install -q --no-compile --no-deps vllm==0.30.0 vllm-omni==0.30.0  # the vllm wheel is 315 MB: no .pyc pass
# xgrammar's metadata asks for triton; vllm imports only its grammar classes
"$PY" -m pip install -q --no-deps "xgrammar>=0.2.1,<1" apache-tvm-ffi==0.1.11
"$PY" -m pip install -q -r "$HERE/requirements.txt"
"$PY" -m pip install -q --no-deps -e .
"$PY" - <<'PY'
import importlib.metadata as m
got = {p: m.version(p) for p in ("torch", "vllm", "vllm-omni", "diffusers")}
assert got["torch"].endswith("+cpu") and got["vllm"] == got["vllm-omni"] == "0.30.0" \
    and got["diffusers"] == "0.40.0", got
print("vllm-omni test environment:", ", ".join(f"{k} {v}" for k, v in got.items()))
PY
