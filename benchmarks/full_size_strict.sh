#!/usr/bin/env bash
# Strict mode at full size on one GPU: a random full-width Qwen-Image pipeline folder (LAYERS
# blocks), a CFG/SDE trajectory through the strict CUDA family with L1 capture, its replay, the
# batch-invariance check (--batch 3 against --samples 1) and strict against production (auto).
#
#   $ bash benchmarks/full_size_strict.sh [WORK_DIR=/dev/shm/drifttool-strict]
#   environment: STEPS=4 LAYERS=60 SIZE=1024 WIDTH=$SIZE DEVICE=cuda
#
# Every command prints its wall time and exit code; the diffs print their verdicts and first
# drifts (expected: replay IDENTICAL, batch IDENTICAL for the common sample, strict vs auto DRIFT).
set -uo pipefail
WORK=${1:-/dev/shm/drifttool-strict}
STEPS=${STEPS:-4} LAYERS=${LAYERS:-60} SIZE=${SIZE:-1024} WIDTH=${WIDTH:-$SIZE} DEVICE=${DEVICE:-cuda}
mkdir -p "$WORK"
t() {
  local s; s=$(date +%s.%N); "$@"; local rc=$?
  python3 -c "import sys, time; print(f'[{time.time() - float(sys.argv[1]):6.1f} s, rc {sys.argv[2]}]', *sys.argv[3:])" "$s" "$rc" "$@"
}
[ -d "$WORK/qwen" ] || t python3 benchmarks/make_random_checkpoint.py --layers "$LAYERS" --out "$WORK/qwen" --device "$DEVICE"
RUN=(--checkpoint "$WORK/qwen" --device "$DEVICE" --height "$SIZE" --width "$WIDTH" --steps "$STEPS" --capture L1)
t drifttool run "${RUN[@]}" --mode strict --samples 1 -o "$WORK/strict" --overwrite
t drifttool replay "$WORK/strict" --device "$DEVICE" -o "$WORK/replay" --overwrite
t drifttool diff "$WORK/strict" "$WORK/replay"
t drifttool run "${RUN[@]}" --mode strict --batch 3 -o "$WORK/strict_b3" --overwrite
t drifttool diff "$WORK/strict" "$WORK/strict_b3"
t drifttool run "${RUN[@]}" --mode auto --samples 1 -o "$WORK/auto" --overwrite
t drifttool diff "$WORK/strict" "$WORK/auto"
