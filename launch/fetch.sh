#!/usr/bin/env bash
# Copy results back: folders or files of the workers (relative to ~/dspark, e.g. runs/dspark_qwen3-8b),
# gs:// paths (the usual place for run.out_dir: it outlives the VM), and with --run the logs of a
# detached run from every worker.
#
#   launch/fetch.sh NAME --zone ZONE [--project PROJECT] [--worker 0] [--dest DIR] [--run RUN] [PATH ...] [--dry-run]
#
# A worker path is copied from --worker (default 0: process 0 writes run.json, metrics.jsonl and
# the drafter); a gs:// path with `gcloud storage rsync --recursive`. Everything lands in --dest
# (default fetched/NAME).
source "$(dirname "$0")/common.sh"
USAGE="launch/fetch.sh NAME --zone ZONE [--project P] [--worker N] [--dest DIR] [--run RUN] [PATH ...] [--dry-run]"

parse_args "worker dest run" "" "$@"
((${#POSITIONAL[@]} >= 1)) || usage_error "give the TPU name"
paths=("${POSITIONAL[@]:1}")
POSITIONAL=("${POSITIONAL[0]}")
need_name
need_worker 0
[[ $WORKER != all ]] || usage_error "--worker takes one worker number here (--run fetches every worker's logs)"
((${#CMD[@]} == 0)) || usage_error "fetch takes no command after --"
((${#paths[@]} > 0)) || [[ -n ${opt_run:-} ]] || usage_error "give what to fetch: PATH ... and/or --run RUN"
dest=${opt_dest:-fetched/$NAME}
[[ ${opt_dry_run:-0} == 1 ]] || mkdir -p "$dest"
for path in "${paths[@]}"; do
  case $path in
    gs://*)
      gcloud_run storage rsync --recursive "$path" "$dest/$(basename "${path%/}")"
      ;;
    /* | '~'/*)
      gcloud_run compute tpus tpu-vm scp --recurse "$NAME:$path" "$dest/" "${ZONE_ARGS[@]}" --worker="$WORKER"
      ;;
    *)
      [[ $path != *..* ]] || usage_error "a worker path may not contain '..': $path"
      gcloud_run compute tpus tpu-vm scp --recurse "$NAME:$REMOTE_WORKDIR/$path" "$dest/" "${ZONE_ARGS[@]}" --worker="$WORKER"
      ;;
  esac
done
if [[ -n ${opt_run:-} ]]; then
  need_run_name
  gcloud_run compute tpus tpu-vm scp --recurse "$NAME:$RUN_DIR" "$dest/" "${ZONE_ARGS[@]}" --worker=all
fi
