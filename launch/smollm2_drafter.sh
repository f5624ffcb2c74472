#!/usr/bin/env bash
# The shipped SmolLM2-135M drafter's whole recipe on one machine (docs/training.md, docs/results.md
# section 14): held-out data, greedy and sampled training data, the training run, STS at T = 0 and
# T = 1. Every step resumes where it stopped and a finished step is skipped, so the same command
# continues after a reboot, a kill or the end of a sitting:
#
#   mkdir -p logs && setsid nohup bash launch/smollm2_drafter.sh > logs/smollm2_drafter.log 2>&1 &
#   bash launch/smollm2_drafter.sh --dry-run      # the commands, one per line; runs nothing
#
# The data lives in the repository (DATA, default datasets/smollm2-135m: compact shards with their
# sha256 in each manifest, docs/training.md), so a sitting on a new machine continues from what is
# committed: a complete folder is verified and skipped, a partial one resumes at its next shard.
# Commit each folder's new shards as they come (`git add datasets/ && git commit`).
#
# The run starts from the drafter in START (default: the shipped one, copied once into
# RUN.start so the run keeps what it started from when the shipped drafter is replaced). Run from
# the repository root with the package installed. Settings (environment): RUN, START, SEEDS
# (sampled datagen seeds, default "0"), STEPS, PYTHON, DATAGEN_BATCH (rows datagen decodes at once,
# default 32; the responses do not depend on it: raise it on an accelerator), FEATURE_CACHE (the
# feature cache folder, default data/smollm2-train-features; "none": training runs the target in
# each step instead, the cheaper choice on an accelerator), FEATURE_DTYPE (the target's weights for
# the feature cache build: bfloat16 where the CPU multiplies bf16 natively (AMX, AVX512-BF16), where
# it is 1.3-1.8x faster, float32 elsewhere, where bf16 is emulated and slower: docs/training.md).
set -euo pipefail

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "error: unknown argument $1 (only --dry-run)" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python}
DATA=${DATA:-datasets/smollm2-135m}
RUN=${RUN:-runs/dspark_smollm2-135m-v2}
START=${START:-dspark_jax/shipped/dspark_smollm2-135m}
SEEDS=${SEEDS:-0}
STEPS=${STEPS:-4000}
DATAGEN_BATCH=${DATAGEN_BATCH:-32}
FEATURE_CACHE=${FEATURE_CACHE:-data/smollm2-train-features}
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
  step "$PYTHON" -m dspark_jax.datagen --out "$out" --max-new-tokens 384 --batch-size "$DATAGEN_BATCH" "$@"
}

datagen "$DATA/eval" --sets "$EVAL_SETS" --split eval --limit 40 --temperature 0
datagen "$DATA/train/greedy" --sets all --split train --temperature 0
for seed in $SEEDS; do
  datagen "$DATA/train/sampled-s$seed" --sets all --split train --seed "$seed"
done

calibrated_at() {  # the decoding temperatures drafter folder $1 is calibrated at, one per line
  "$PYTHON" -c 'import json, sys; print(*json.load(open(sys.argv[1])).get("sts_by_temperature", {}), sep="\n")' \
    "$1/drafter.json" 2>/dev/null || true
}

if [ ! -e "$RUN.start/drafter.json" ]; then
  step mkdir -p "$RUN.start"
  step cp "$START/drafter.json" "$START/drafter.safetensors" "$RUN.start/"
fi
if [ "$FEATURE_CACHE" = none ]; then
  features=(data.feature_cache=null)
else
  features=("data.feature_cache=$FEATURE_CACHE" "data.feature_cache_dtype=$FEATURE_DTYPE")
fi
if [ ! -e "$RUN/drafter/drafter.json" ]; then
  step "$PYTHON" -m dspark_jax.train --config configs/dspark_smollm2-135m.yaml --resume \
    "optim.steps=$STEPS" optim.lr=1.0e-3 "optim.init_from_drafter=$RUN.start" "run.out_dir=$RUN" \
    "data.train_dir=$DATA/train" "data.eval_dir=$DATA/eval" \
    run.eval_every=250 run.eval_batches=16 data.seq_len=1024 data.rows=4 data.blocks_per_row=64 \
    "${features[@]}"
fi

# STS on held-out greedy and T = 1 rounds, into one bf16 copy (the drafter to ship).
if ! calibrated_at "$RUN-calibrated" | grep -qx 0; then
  step "$PYTHON" -m dspark_jax.calibrate --drafter "$RUN/drafter" --temperature 0 --limit 16 \
    --max-new-tokens 128 --save-to "$RUN-calibrated" --storage-dtype bfloat16
fi
if ! calibrated_at "$RUN-calibrated" | grep -qx 1; then
  step "$PYTHON" -m dspark_jax.calibrate --drafter "$RUN-calibrated" --temperature 1 --limit 16 --max-new-tokens 128
fi
[ "$dry" = 1 ] || echo "done: $RUN-calibrated"
