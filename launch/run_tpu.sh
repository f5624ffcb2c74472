#!/usr/bin/env bash
# Run one command on every worker of a TPU slice (SPMD): run_tpu.sh NAME ZONE -- CMD ...
set -euo pipefail
if [ $# -lt 4 ] || [ "$3" != "--" ]; then echo "usage: $0 NAME ZONE -- CMD ..." >&2; exit 2; fi
name=$1 zone=$2; shift 3
cmd=$(printf '%q ' "$@")
mkdir -p logs
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
  --command "cd dspark_jax && . .venv/bin/activate && $cmd" 2>&1 | tee "logs/$name-$(date +%Y%m%d-%H%M%S).log"
