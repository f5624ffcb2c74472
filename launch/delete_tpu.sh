#!/usr/bin/env bash
# Delete a Cloud TPU VM slice: delete_tpu.sh NAME ZONE
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 NAME ZONE" >&2; exit 2; fi
gcloud compute tpus tpu-vm delete "$1" --zone "$2" --quiet
