#!/usr/bin/env bash
# The shipped SmolLM2-135M drafter's recipe, in sittings (docs/training.md, docs/results.md
# section 14): held-out data, greedy and sampled training data, then one training sitting that
# continues the shipped drafter for BUDGET_S seconds and replaces it only if held-out tau rose.
# Every step resumes where it stopped, so the same command continues after a kill, and on a new
# machine from what the repository holds:
#
#   mkdir -p logs && setsid nohup nice -n 19 bash launch/smollm2_drafter.sh > logs/smollm2_drafter.log 2>&1 &
#   bash launch/smollm2_drafter.sh --dry-run      # where each step stands and what would run next
#
# The data lives in the repository (DATA, default datasets/smollm2-135m: compact shards with their
# sha256 in each manifest), so datagen is never run twice: a complete folder is verified and
# skipped, a partial one resumes at its next shard. Commit new shards as they come
# (`git add datasets/ && git commit`), and after a sitting the drafter and $DATA/sittings.jsonl.
#
# Run from the repository root with the package installed. Settings (environment): PYTHON, DATA,
# SEEDS (sampled datagen seeds, default "0"), BUDGET_S (training seconds this sitting, default
# 5400; calibration after it takes ~20 minutes more), LR (default 1e-4, held after WARMUP_STEPS,
# default 50; 3e-4 lowered held-out tau over a sitting's first 68 steps, 1e-4 raised it in 174),
# DATAGEN_BATCH (rows datagen decodes at once, default 32; the responses do not depend on it: raise
# it on an accelerator), FEATURE_CACHE (default none: the target runs in each training
# step; a folder: the target's features cached there first, worth it only where building the cache
# is cheap next to the sitting: docs/results.md section 14), FEATURE_DTYPE (the target's weights for
# a feature cache build: bfloat16 where the CPU multiplies bf16 natively (AMX, AVX512-BF16), float32
# elsewhere), RUN (default runs/smollm2-from-<id of the shipped drafter's weights>), DATAGEN (default
# 1; 0: this sitting trains on the shards committed so far and leaves datagen for a later one, as
# the training reads partial datagen folders: a sitting's CPU goes to steps while data accrues).
#
# Levers side by side (docs/results.md section 14: when a sitting gains < ~0.05 held-out tau, change
# what limits it, each change against the plain recipe at the same budget): LEVER names an arm and
# TRAIN_OVERRIDES holds its extra `train` overrides (e.g. "data.anchors_per_seq=32
# data.blocks_per_row=128"); the arm trains in RUN=runs/smollm2-<LEVER>-from-<id>. SHIP=0 trains and
# records the sitting without calibrating or shipping, for arms run at once: score the arms on the
# same held-out batches (`python benchmarks/bench_draft_vocab.py --drafter RUN/drafter --sizes 0`),
# then ship the best: SHIP=1 BUDGET_S=0 with its LEVER (BUDGET_S=0: no training, the run as it stands
# is judged, calibrated and copied).
set -euo pipefail

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "error: unknown argument $1 (only --dry-run)" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python}
# a CPU recipe: in an environment with libtpu (the test extra installs it) JAX would otherwise try to
# start a TPU backend in every command and print libtpu's warnings
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
DATA=${DATA:-datasets/smollm2-135m}
SHIPPED=${SHIPPED:-dspark_jax/shipped/dspark_smollm2-135m}
SEEDS=${SEEDS:-0}
BUDGET_S=${BUDGET_S:-5400}
LR=${LR:-1.0e-4}
WARMUP_STEPS=${WARMUP_STEPS:-50}
DATAGEN_BATCH=${DATAGEN_BATCH:-32}
DATAGEN=${DATAGEN:-1}
LEVER=${LEVER:-}
TRAIN_OVERRIDES=${TRAIN_OVERRIDES:-}
SHIP=${SHIP:-1}
FEATURE_CACHE=${FEATURE_CACHE:-none}
if [ -z "${FEATURE_DTYPE:-}" ]; then
  if grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo 2>/dev/null; then FEATURE_DTYPE=bfloat16; else FEATURE_DTYPE=float32; fi
fi
EVAL_SETS=gsm8k,math500,humaneval,mbpp,livecodebench,lbpp,swe-bench,arena-hard-v2

step() {  # print the command; run it unless --dry-run
  echo "$*"
  if [ "$dry" = 0 ]; then
    echo "[$(date -u +%FT%TZ)] start" >&2
    "$@"
  fi
}

data_status() {  # one line: where datagen folder $1 stands (from its manifest)
  "$PYTHON" - "$1" <<'PY'
import json, sys
try:
    m = json.load(open(sys.argv[1] + "/manifest.json"))
except FileNotFoundError:
    print(f"{sys.argv[1]}: not started"); sys.exit()
state = "complete" if m["complete"] else "partial"
print(f"{sys.argv[1]}: {state}, {len(m['shards'])} / {m['num_shards_planned']} shards, "
      f"{m['num_examples']} / {m['num_planned']} prompts, {m['response_tokens']:,} response tokens")
PY
}

datagen() {  # datagen into $1 (further flags follow); a complete folder is only verified (sha256)
  local out=$1; shift
  [ "$dry" = 1 ] && echo "# $(data_status "$out")"
  if [ "$DATAGEN" = 0 ]; then echo "# DATAGEN=0: not this sitting"; return; fi
  step "$PYTHON" -m dspark_jax.datagen --out "$out" --max-new-tokens 384 --batch-size "$DATAGEN_BATCH" "$@"
}

datagen "$DATA/eval" --sets "$EVAL_SETS" --split eval --limit 40 --temperature 0
datagen "$DATA/train/greedy" --sets all --split train --temperature 0
for seed in $SEEDS; do
  datagen "$DATA/train/sampled-s$seed" --sets all --split train --seed "$seed"
done

# Training in sittings: each sitting continues the drafter the repository ships (any machine has
# it), for BUDGET_S seconds of training, in a run named after that drafter's weights (a sitting on
# the same machine resumes it; a new one starts it afresh from the shipped weights, Adam's moments
# re-warmed over WARMUP_STEPS). The run opens with the shipped drafter's held-out score and closes
# with its own on the same batches; only a better one is calibrated (STS at T = 0 and T = 1) and
# replaces the shipped drafter (bf16). Every sitting appends a row to $DATA/sittings.jsonl.
start_id=$("$PYTHON" launch/smollm2_sitting.py start-id "$SHIPPED")
RUN=${RUN:-runs/smollm2-${LEVER:+$LEVER-}from-$start_id}
read -r -a lever_overrides <<< "$TRAIN_OVERRIDES"
if [ "$FEATURE_CACHE" = none ]; then
  features=(data.feature_cache=null)
else
  features=("data.feature_cache=$FEATURE_CACHE" "data.feature_cache_dtype=$FEATURE_DTYPE")
fi
if [ "$dry" = 1 ]; then
  last=$( (ls -d "$RUN"/checkpoints/[0-9]* 2>/dev/null || true) | sed 's,.*/,,' | sort -n | tail -1)
  echo "# training sitting of ${BUDGET_S} s from the shipped drafter $start_id in $RUN: resumes at step ${last:-0}"
fi
t0=$(date +%s)
if [ "$BUDGET_S" = 0 ]; then echo "# BUDGET_S=0: no training, $RUN as it stands"; else
step "$PYTHON" -m dspark_jax.train --config configs/dspark_smollm2-135m.yaml --resume --allow-schedule-change \
  "optim.init_from_drafter=$SHIPPED" optim.schedule=constant "optim.lr=$LR" "optim.warmup_steps=$WARMUP_STEPS" \
  optim.steps=1000000 "run.time_budget_s=$BUDGET_S" "run.out_dir=$RUN" \
  "data.train_dir=$DATA/train" "data.eval_dir=$DATA/eval" run.eval_every=250 run.eval_batches=16 \
  data.seq_len=1024 data.rows=4 data.blocks_per_row=64 "${features[@]}" ${lever_overrides[@]+"${lever_overrides[@]}"}
fi
wall=$(( $(date +%s) - t0 ))

if [ "$dry" = 1 ] && [ "$SHIP" = 0 ]; then
  echo "# then (SHIP=0): its held-out verdict and a row in $DATA/sittings.jsonl, no calibration, nothing shipped"
  exit 0
fi
if [ "$dry" = 1 ]; then
  echo "# then, if its held-out expected tau beats the shipped drafter's: STS at T = 0 and T = 1 into $RUN-calibrated (bf16), copied to $SHIPPED; a row in $DATA/sittings.jsonl"
  exit 0
fi
record=("$PYTHON" launch/smollm2_sitting.py record "$RUN" --wall-s "$wall" --log "$DATA/sittings.jsonl" --lever "${LEVER:-recipe}" --overrides "$TRAIN_OVERRIDES")
if [ "$SHIP" = 0 ]; then
  "$PYTHON" launch/smollm2_sitting.py verdict "$RUN" || true
  "${record[@]}" --shipped 0
  echo "SHIP=0: trained and recorded, not calibrated: commit $DATA/sittings.jsonl"
  exit 0
fi
if "$PYTHON" launch/smollm2_sitting.py verdict "$RUN"; then
  step rm -rf "$RUN-calibrated"
  step "$PYTHON" -m dspark_jax.calibrate --drafter "$RUN/drafter" --temperature 0 --limit 16 \
    --max-new-tokens 128 --save-to "$RUN-calibrated" --storage-dtype bfloat16
  step "$PYTHON" -m dspark_jax.calibrate --drafter "$RUN-calibrated" --temperature 1 --limit 16 --max-new-tokens 128
  step cp "$RUN-calibrated/drafter.json" "$RUN-calibrated/drafter.safetensors" "$SHIPPED/"
  "${record[@]}" --shipped 1
  echo "shipped: commit $SHIPPED and $DATA/sittings.jsonl"
else
  "${record[@]}" --shipped 0
  echo "kept the shipped drafter: commit $DATA/sittings.jsonl"
fi
