#!/usr/bin/env bash
# Create a Cloud TPU VM slice: create_tpu.sh NAME ZONE ACCELERATOR_TYPE [RUNTIME_VERSION]
set -euo pipefail
if [ $# -lt 3 ]; then echo "usage: $0 NAME ZONE ACCELERATOR_TYPE [RUNTIME_VERSION]" >&2; exit 2; fi
name=$1 zone=$2 type=$3 version=${4:-tpu-ubuntu2204-base}
gcloud compute tpus tpu-vm create "$name" --zone "$zone" --accelerator-type "$type" --version "$version"
