#!/usr/bin/env bash
# The training tolerance profile: how far a strict CUDA trainer's v_t, logp_t, operator outputs and
# LoRA gradients lie from a strict CPU trainer's, both recomputing the same stored rollouts.
#
#   bash tools/train_profile.sh [WORK_DIR]                # on a machine with a CUDA GPU
#   B_DEVICE=cpu B_MODE=auto bash tools/train_profile.sh /tmp/tp   # a CPU dry run (strict vs production)
#
# PYTHON: the interpreter with drifttool installed (default python3: run it inside your venv).
# B_DEVICE, B_MODE: run B's trainer (default cuda, strict). FACTOR: the bounds' multiple (4).
# SEEDS: the rollouts' seeds the profile is derived from (default "0 1 2"); CHECK_SEEDS: seeds
# whose pairs are then judged within it, held out of the derivation (default "3 4"; "" for none).
# PROFILE_OUT: the profile's path (default WORK_DIR/<name>.json); its name is
# strict-cuda1-vs-cpu-train for the default pair, else train-<B_MODE>-<B_DEVICE>-vs-strict-cpu.
# HOST: the hardware and versions recorded in the profile (default: the GPU's name, torch, Triton).
#
# 1. a random adapter for the embedded tiny-t2i transformer (rank 4, every adapter target, B drawn
#    non-zero so the gradients of A are too), written as peft writes one;
# 2. per seed, a strict CPU rollout with it (L2, the default 4 steps, `--lora-mode unfused-fp32`);
# 3. its training recompute with gradients on the CPU in strict mode (run A, the baseline) and on
#    B_DEVICE in B_MODE (run B; default cuda, strict): the same stored latents, so every difference
#    is the trainer's arithmetic; both at L2 without the attention's internals (the strict CUDA
#    attention's decomposition into them is forward only);
# 4. `tools/tolerance_profile.py A0 B0 A1 B1 ...` derives the profile from the SEEDS' pairs (each
#    bound FACTOR x the largest measure over them, 0 where every pair is byte-equal; gradient
#    records are judged by their parameter's name, `attn.to_q.lora_A`, as operators are) into
#    PROFILE_OUT (to ship a GPU profile, copy it to drifttool/diff/profiles/);
# 5. `drifttool diff A B --tolerance PROFILE_OUT` judges every pair: the SEEDS' and the held-out
#    CHECK_SEEDS'; one line each (the whole report in WORK_DIR/s<seed>/judged.txt); exit 0 only
#    if every pair is within the profile.
# Each command's output goes to WORK_DIR/s<seed>/<step>.log; the script stops at the first command
# that fails, with the end of its log.
set -euo pipefail
cd "$(dirname "$0")/.."
W="${1:-/tmp/drifttool-train-profile}"
B_DEVICE="${B_DEVICE:-cuda}"
B_MODE="${B_MODE:-strict}"
FACTOR="${FACTOR:-4}"
SEEDS="${SEEDS-0 1 2}"
CHECK_SEEDS="${CHECK_SEEDS-3 4}"
if [ "$B_DEVICE" = cuda ] && [ "$B_MODE" = strict ]; then NAME=strict-cuda1-vs-cpu-train
else NAME="train-$B_MODE-${B_DEVICE//:/}-vs-strict-cpu"; fi
PROFILE_OUT="${PROFILE_OUT:-$W/$NAME.json}"
[ -n "$SEEDS" ] || { echo "error: SEEDS is empty: the profile is derived from at least one seed" >&2; exit 2; }
mkdir -p "$W"
PY="${PYTHON:-python3}"
dt() { "$PY" -m drifttool "$@"; }
# the preflight (drifttool importable; a CUDA device for a CUDA run B), printing this host's line
FOUND_HOST="$("$PY" - "$B_DEVICE" <<'PY'
import platform
import sys
try:
    import torch
    import drifttool  # noqa: F401
except ImportError as e:
    sys.exit(f"error: {sys.executable} cannot import {e.name}: run inside the environment drifttool is "
             "installed in, or set PYTHON to its interpreter")
if sys.argv[1].startswith("cuda") and not torch.cuda.is_available():
    sys.exit("error: no CUDA device here: run B is the CUDA trainer (B_DEVICE=cuda); on a CPU, "
             "B_DEVICE=cpu B_MODE=auto makes the dry run")
try:
    import triton
    tv = f", Triton {triton.__version__}"
except ImportError:
    tv = ""
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"
print(f"{dev}, torch {torch.__version__}{tv}; the strict CPU trainer on the same host")
PY
)" || exit 2
HOST="${HOST:-$FOUND_HOST}"

"$PY" - "$W/adapter" <<'PY'
import sys
from drifttool.fixture import locate
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.model.lora_io import save_lora

m = load_checkpoint(locate("tiny-t2i") / "transformer")
add_lora(m, rank=4, alpha=8, init_b_std=0.05, seed=0)
save_lora(m, sys.argv[1])
print(f"wrote {sys.argv[1]}")
PY
quiet() {  # LOG CMD...: run CMD into LOG; on failure show the log's end and stop
  local log="$1"; shift
  "$@" > "$log" 2>&1 || { echo "error: $* failed; the end of $log:" >&2; tail -n 15 "$log" >&2; exit 1; }
}
pair() {  # seed → $W/s<seed>/{rollout,train-a,train-b}
  local d="$W/s$1"
  mkdir -p "$d"
  echo "seed $1: strict CPU rollout, strict CPU trainer (A), $B_MODE $B_DEVICE trainer (B)"
  quiet "$d/rollout.log" dt run --seed "$1" --device cpu --capture L2 --lora "$W/adapter" --lora-mode unfused-fp32 \
    -o "$d/rollout" --overwrite
  quiet "$d/train-a.log" dt recompute "$d/rollout" --grad --no-internals --device cpu -o "$d/train-a" --overwrite
  quiet "$d/train-b.log" dt recompute "$d/rollout" --grad --no-internals --device "$B_DEVICE" --mode "$B_MODE" \
    -o "$d/train-b" --overwrite
}
RUNS=()
for s in $SEEDS; do pair "$s"; RUNS+=("$W/s$s/train-a" "$W/s$s/train-b"); done
"$PY" tools/tolerance_profile.py "${RUNS[@]}" --factor "$FACTOR" \
  --name "$(basename "$PROFILE_OUT" .json)" --host "$HOST" \
  --description "trainer on $B_DEVICE ($B_MODE) against the strict CPU trainer, both recomputing strict CPU rollouts of the embedded tiny-t2i fixture (seeds ${SEEDS// /, }; L2 without the attention's internals, unfused-fp32 rank-4 adapter) with gradients; bounds ${FACTOR}x the measured maxima" \
  -o "$PROFILE_OUT"
for s in $CHECK_SEEDS; do pair "$s"; done
bad=0
for s in $SEEDS $CHECK_SEEDS; do
  rc=0; dt diff "$W/s$s/train-a" "$W/s$s/train-b" --tolerance "$PROFILE_OUT" > "$W/s$s/judged.txt" 2>&1 || rc=$?
  case " $CHECK_SEEDS " in *" $s "*) what="held out";; *) what=derived;; esac
  echo "seed $s ($what): $(grep -m1 -E '^(WITHIN|BEYOND|NOT JUDGED|IDENTICAL)' "$W/s$s/judged.txt" || tail -n 1 "$W/s$s/judged.txt")"
  [ "$rc" = 0 ] || bad=1
done
if [ "$bad" = 1 ]; then
  echo "error: a pair is not within $PROFILE_OUT (its report: $W/s<seed>/judged.txt)" >&2; exit 1
fi
echo "profile: $PROFILE_OUT (derived from seeds $SEEDS; every pair within it${CHECK_SEEDS:+, held-out seeds $CHECK_SEEDS included})"
