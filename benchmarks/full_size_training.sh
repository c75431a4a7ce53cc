#!/usr/bin/env bash
# Strict training at full size on one GPU, end to end: a random full-width Qwen-Image pipeline
# folder (LAYERS blocks) with a random LoRA adapter, a strict CFG/SDE rollout with the adapter,
# its replay, its training recomputes with gradients in three trainer layouts, the four
# rollout/train cells (strict/production × strict/production) and the Flow-GRPO first-epoch ratio.
#
#   $ bash benchmarks/full_size_training.sh [WORK_DIR=/dev/shm/drifttool-training]
#   environment: PART=all STEPS=10 LAYERS=60 SIZE=1024 DEVICE=cuda BATCH=1 CAPTURE=L1 CLIP=1e-4
#                LORA_MODE=unfused-fp32
#
# PART picks what runs: "all", or part numbers separated by commas or spaces (PART=1, PART=2,3).
# Each part resumes from what the earlier parts left in WORK_DIR and refuses, naming the missing
# artifact, when it is not there. Each part is at most three GPU commands of a few minutes each at
# the defaults (a 4-step strict L1 rollout at full size took 27 s with loading; a recompute with
# gradients runs a forward and a backward per step), so each fits a call of 10 minutes:
#   1  the checkpoint and adapter (skipped if present), the strict rollout
#   2  its replay; diff rollout/replay                                      expected IDENTICAL (0)
#   3  recompute --grad, whole batch; diff against the rollout              expected IDENTICAL (0)
#   4  recompute --grad --gradient-checkpointing; diff against the rollout
#      and against part 3's (LoRA gradients included)                       expected IDENTICAL (0)
#   5  recompute --grad --micro-batch 1 (Flow-GRPO's trainer layout: prompts trimmed to each
#      micro-batch), the strict/strict cell; diff against the rollout and part 3's   IDENTICAL (0)
#   6  a production (--mode auto) rollout; diff strict/production rollouts  expected DRIFT (1);
#      the production trainer on the strict rollout (cell strict/prod)      expected DRIFT (1)
#   7  the strict trainer on the production rollout (cell prod/strict)     expected DRIFT (1);
#      the production trainer on it (cell prod/prod)            either (0 or 1), see below
#   8  the Flow-GRPO first-epoch ratio exp(logp_train − logp_rollout) of every cell against the
#      PPO clip range CLIP (diffs only, no GPU): strict/strict exactly 1 (0); strict/prod and
#      prod/strict not 1 (1); prod/prod either
# The cells' trainers all run --micro-batch 1 as `experiment train-rollout` does by default. A
# cell with one production side drifts. production/production promises nothing: on the CPU at
# batch 1 it is identical (the same kernels on the same rows, with or without autograd); with
# BATCH > 1 the trainer's micro-batches trim the prompts and the production attention sees
# another key sequence, and on the GPU autograd may pick other kernels (docs/train-rollout.md,
# "The trainer's layout").
#
# `drifttool experiment train-rollout` now takes --checkpoint, --lora (used as it is, no fresh
# adapter), --steps, --cfg-scale and --batch besides --device, --height and --width, so the four
# cells of parts 5 to 8 are also one command, in one process (all four in one call, longer than
# a part here), with each cell's first-epoch ratio and the rollout's toy reward in its table:
#   drifttool experiment train-rollout --checkpoint "$CKPT" --lora "$LORA" --device "$DEVICE" \
#     --height "$SIZE" --width "$SIZE" --steps "$STEPS" --cfg-scale 4 --batch "$BATCH" \
#     --capture "$CAPTURE" --clip-range "$CLIP" -o "$WORK/cells"
# This script keeps its parts (each fits a call of 10 minutes, resumes from WORK_DIR, and adds
# the replay and the whole-batch and checkpointed trainer layouts): its cells are built from run,
# recompute and diff with --mode strict and --mode auto, and the first-epoch ratio (epoch 0 of
# Flow-GRPO's inner loop: the parameters that sampled) is what `diff --clip-range` reports on each
# cell. `experiment grpo` still takes only --device, --height and --width (always the embedded
# tiny-t2i fixture).
#
# The rollout: sample(s) 0..BATCH-1 of the default fixture's prompts (N(0, 1) embeddings drawn at
# the checkpoint's text width), SIZE×SIZE pixels, STEPS steps, true CFG at scale 4 (batched), the
# SDE window and η of the run's defaults (η 1.2 on steps 0..STEPS-2), bf16, the adapter applied as
# LORA_MODE: unfused-fp32 by default (W stays bf16, the adapter's FP32 branch beside it: a
# trainer's peft layout, and strict's fast backward); LORA_MODE=merged makes strict keep W' in FP32
# (its training step about 27× production's, docs/benchmarks.md). The recomputes read the mode from
# the rollout's manifest.
# CAPTURE: L1 by default (one digest per operator output, so a drift is named by operator and
# block without re-running). L1 costs about 1.5–2.2× a full-size forward (docs/benchmarks.md,
# "Full-size forward on one GPU"), seconds over a 10-step trajectory; CAPTURE=L0 keeps step
# records only (name the operator afterwards with `drifttool diff --localize`).
#
# Memory: the whole-batch recompute (part 3) keeps every block's activations of both CFG rows for
# one step's backward (about 40 GiB of weights besides); if it runs out of memory, that is a
# finding, and parts 4 and 5 still run (their diffs against part 3's are then skipped, counted).
#
# Every command prints its wall time, exit code and the code expected; the diffs print their
# verdicts and first drifts. The script ends with a count and exits 1 when any command exited
# otherwise than expected or was skipped for a missing artifact.
set -uo pipefail
WORK=${1:-/dev/shm/drifttool-training}
STEPS=${STEPS:-10} LAYERS=${LAYERS:-60} SIZE=${SIZE:-1024} DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-1} CAPTURE=${CAPTURE:-L1} CLIP=${CLIP:-1e-4} PART=${PART:-all}
LORA_MODE=${LORA_MODE:-unfused-fp32}
for p in ${PART//,/ }; do
  [[ $p =~ ^([1-8]|all)$ ]] || { echo "PART=$PART: give all, or part numbers 1 to 8 (e.g. PART=2,3)"; exit 2; }
done
mkdir -p "$WORK"
CKPT=$WORK/qwen LORA=$WORK/lora
RUN=(--checkpoint "$CKPT" --lora "$LORA" --device "$DEVICE" --height "$SIZE" --width "$SIZE"
     --steps "$STEPS" --cfg-scale 4 --batch "$BATCH" --capture "$CAPTURE" --lora-mode "$LORA_MODE")
TRAIN=(--lora "$LORA" --device "$DEVICE" --grad)
RAN=0 BAD=()

# t EXPECTED CMD...: run CMD, print its wall time and exit code; EXPECTED is a code or "0|1"
t() {
  local want=$1; shift
  local s; s=$(date +%s.%N); "$@"; local rc=$?
  local ok=" (expected $want)"
  [[ "|$want|" == *"|$rc|"* ]] || { ok=" (expected $want: UNEXPECTED)"; BAD+=("rc $rc: $*"); }
  RAN=$((RAN + 1))
  python3 -c "import sys, time; print(f'[{time.time() - float(sys.argv[1]):6.1f} s, rc {sys.argv[2]}{sys.argv[3]}]', *sys.argv[4:])" \
    "$s" "$rc" "$ok" "$@"
}
part() { [ "$PART" = all ] || [[ ",${PART//[ ]/,}," == *",$1,"* ]]; }
# have PATH...: every artifact present, else one line naming the first missing and the part
# that writes it (counted)
have() {
  local p n
  for p in "$@"; do
    [ -e "$p/manifest.json" ] || [ -e "$p/model_index.json" ] && continue
    case ${p##*/} in
      qwen|rollout) n=1 ;; train) n=3 ;; train-gc) n=4 ;; train-strict-on-strict) n=5 ;;
      rollout-prod|train-prod-on-strict) n=6 ;; *) n=7 ;;
    esac
    echo "skipped: $p is missing (PART=$n writes it)"; BAD+=("missing $p"); return 1
  done
}
diff_() { have "$2" "$3" && t "$1" drifttool diff "$2" "$3"; }
# ratio CELL ROLLOUT TRAIN: the diff's verdict, first drift, largest SDE transition KL, the
# rollout's toy reward (`experiment train-rollout`'s columns) and the first-epoch ratio line
# (exit: the diff's)
ratio() {
  drifttool diff "$2" "$3" --clip-range "$CLIP" --json | python3 -c '
import json, sys
from drifttool.training.grpo import toy_reward
from drifttool.training.stored import load_rollout
cell, eps, rollout = sys.argv[1:]
d = json.load(sys.stdin)
verdict, w, fd = d["verdict"], (d.get("clip") or {}).get("worst"), d.get("first_drift") or {}
kls = [k["kl"] for s in d["steps"] for k in s["kl"] if k["kl"] is not None]
reward = float(toy_reward(load_rollout(rollout).latents[-1]).mean())
first = "step %s block %s %s" % (fd.get("step"), fd.get("block"), fd.get("op")) if fd else "none"
print(f"{cell}: {verdict}; first drift {first}; KL max {max(kls) if kls else 0.0:.3g}; "
      f"rollout reward {reward:.6g}")
if w is None:
    sys.exit(print(f"{cell}: no log-prob to compare"))
exact = "exactly 1" if w["max_abs"] == 0 else "not 1"
where = "%s step %s %s" % (w["phase"], w["step"], w["branch"])
dev, share = w["ratio_dev_max"], 100 * w["fraction"]
print(f"{cell}: first-epoch ratio {exact}: max |ratio - 1| {dev:.3g} = {share:.3g} % "
      f"of the clip range {eps} ({where})")' "$1" "$CLIP" "$2"
}

if part 1; then
  if [ -e "$CKPT/model_index.json" ] && [ -e "$LORA/adapter_config.json" ]; then
    echo "reusing $CKPT and $LORA"
  else
    t 0 python3 benchmarks/make_random_checkpoint.py --layers "$LAYERS" --out "$CKPT" --lora "$LORA" \
      --device "$DEVICE"
  fi
  t 0 drifttool run "${RUN[@]}" --mode strict -o "$WORK/rollout" --overwrite
fi
if part 2 && have "$CKPT" "$WORK/rollout"; then
  t 0 drifttool replay "$WORK/rollout" --device "$DEVICE" -o "$WORK/replay" --overwrite
  diff_ 0 "$WORK/rollout" "$WORK/replay"
fi
if part 3 && have "$CKPT" "$WORK/rollout"; then
  t 0 drifttool recompute "$WORK/rollout" "${TRAIN[@]}" -o "$WORK/train" --overwrite
  diff_ 0 "$WORK/rollout" "$WORK/train"
fi
if part 4 && have "$CKPT" "$WORK/rollout"; then
  t 0 drifttool recompute "$WORK/rollout" "${TRAIN[@]}" --gradient-checkpointing -o "$WORK/train-gc" --overwrite
  diff_ 0 "$WORK/rollout" "$WORK/train-gc"
  diff_ 0 "$WORK/train" "$WORK/train-gc"
fi
if part 5 && have "$CKPT" "$WORK/rollout"; then
  t 0 drifttool recompute "$WORK/rollout" "${TRAIN[@]}" --micro-batch 1 -o "$WORK/train-strict-on-strict" --overwrite
  diff_ 0 "$WORK/rollout" "$WORK/train-strict-on-strict"
  diff_ 0 "$WORK/train" "$WORK/train-strict-on-strict"
fi
if part 6 && have "$CKPT" "$WORK/rollout"; then
  t 0 drifttool run "${RUN[@]}" --mode auto -o "$WORK/rollout-prod" --overwrite
  diff_ 1 "$WORK/rollout" "$WORK/rollout-prod"
  t 0 drifttool recompute "$WORK/rollout" "${TRAIN[@]}" --micro-batch 1 --mode auto -o "$WORK/train-prod-on-strict" --overwrite
  diff_ 1 "$WORK/rollout" "$WORK/train-prod-on-strict"
fi
if part 7 && have "$CKPT" "$WORK/rollout-prod"; then
  t 0 drifttool recompute "$WORK/rollout-prod" "${TRAIN[@]}" --micro-batch 1 --mode strict -o "$WORK/train-strict-on-prod" --overwrite
  diff_ 1 "$WORK/rollout-prod" "$WORK/train-strict-on-prod"
  t 0 drifttool recompute "$WORK/rollout-prod" "${TRAIN[@]}" --micro-batch 1 --mode auto -o "$WORK/train-prod-on-prod" --overwrite
  diff_ "0|1" "$WORK/rollout-prod" "$WORK/train-prod-on-prod"
fi
if part 8; then
  echo "Per cell (rollout/train): verdict, first drift, SDE KL, reward; first-epoch ratio against the clip range $CLIP:"
  for cell in strict/strict strict/prod prod/strict prod/prod; do
    r=${cell%/*} tr=${cell#*/} src=$WORK/rollout
    [ "$r" = prod ] && src=$WORK/rollout-prod
    want=1; [ "$cell" = strict/strict ] && want=0; [ "$cell" = prod/prod ] && want="0|1"
    have "$src" "$WORK/train-$tr-on-$r" && t "$want" ratio "$cell" "$src" "$WORK/train-$tr-on-$r"
  done
fi

echo "$RAN commands; ${#BAD[@]} not as expected$( ((${#BAD[@]})) && printf '\n  %s' "${BAD[@]}")"
[ ${#BAD[@]} -eq 0 ]
