#!/usr/bin/env bash
# The training tolerance profile: how far a strict CUDA trainer's v_t, logp_t, operator outputs and
# LoRA gradients lie from a strict CPU trainer's, both recomputing the same stored rollout.
#
#   bash tools/train_profile.sh [WORK_DIR]                # on a machine with a CUDA GPU
#   B_DEVICE=cpu B_MODE=auto bash tools/train_profile.sh /tmp/tp   # a CPU dry run (strict vs production)
#
# PYTHON: the interpreter with drifttool installed (default python3: run it inside your venv).
# B_DEVICE, B_MODE: run B's trainer (default cuda, strict). FACTOR: the bounds' multiple (4).
# PROFILE_OUT: the profile's path (default WORK_DIR/<name>.json); its name is
# strict-cuda1-vs-cpu-train for the default pair, else train-<B_MODE>-<B_DEVICE>-vs-strict-cpu.
#
# 1. a random adapter for the embedded tiny-t2i transformer (rank 4, every adapter target, B drawn
#    non-zero so the gradients of A are too), written as peft writes one;
# 2. a strict CPU rollout with it (seed 0, L2, the default 4 steps, `--lora-mode unfused-fp32`);
# 3. its training recompute with gradients on the CPU in strict mode (run A, the baseline) and on
#    B_DEVICE in B_MODE (run B; default cuda, strict): the same stored latents, so every difference
#    is the trainer's arithmetic; both at L2 without the attention's internals (the strict CUDA
#    attention's decomposition into them is forward only);
# 4. `tools/tolerance_profile.py A B` derives the profile (each bound FACTOR x the measured
#    maximum, 0 where the pair is byte-equal; gradient records are judged by their parameter's
#    name, `attn.to_q.lora_A`, as operators are) into PROFILE_OUT (ship the GPU pair's by copying
#    it to drifttool/diff/profiles/);
# 5. `drifttool diff A B --tolerance PROFILE_OUT` judges the pair within it (exit 0: every
#    differing record within the profile).
# Exits non-zero at the first command that fails.
set -euo pipefail
cd "$(dirname "$0")/.."
W="${1:-/tmp/drifttool-train-profile}"
B_DEVICE="${B_DEVICE:-cuda}"
B_MODE="${B_MODE:-strict}"
FACTOR="${FACTOR:-4}"
if [ "$B_DEVICE" = cuda ] && [ "$B_MODE" = strict ]; then NAME=strict-cuda1-vs-cpu-train
else NAME="train-$B_MODE-${B_DEVICE//:/}-vs-strict-cpu"; fi
PROFILE_OUT="${PROFILE_OUT:-$W/$NAME.json}"
mkdir -p "$W"
PY="${PYTHON:-python3}"
dt() { "$PY" -m drifttool "$@"; }

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
dt run --seed 0 --capture L2 --lora "$W/adapter" --lora-mode unfused-fp32 -o "$W/rollout" --overwrite
dt recompute "$W/rollout" --grad --no-internals --device cpu -o "$W/train-a" --overwrite
dt recompute "$W/rollout" --grad --no-internals --device "$B_DEVICE" --mode "$B_MODE" -o "$W/train-b" --overwrite
"$PY" tools/tolerance_profile.py "$W/train-a" "$W/train-b" --factor "$FACTOR" \
  --name "$(basename "$PROFILE_OUT" .json)" \
  --description "trainer on $B_DEVICE ($B_MODE) against the strict CPU trainer, both recomputing one strict CPU rollout of the embedded tiny-t2i fixture (seed 0, L2, unfused-fp32 rank-4 adapter) with gradients; bounds ${FACTOR}x the measured maxima" \
  -o "$PROFILE_OUT"
dt diff "$W/train-a" "$W/train-b" --tolerance "$PROFILE_OUT"
echo "profile: $PROFILE_OUT"
