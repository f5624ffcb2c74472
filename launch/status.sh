#!/usr/bin/env bash
# Is a detached run still going on each worker? The slice's state, then per worker: running (pid),
# finished (exit status) or stopped without an exit status (killed, or the VM was preempted), and
# the last line of its log.
#
#   launch/status.sh NAME --zone ZONE --run RUN [--project PROJECT] [--worker all|N] [--dry-run]
source "$(dirname "$0")/common.sh"
USAGE="launch/status.sh NAME --zone ZONE --run RUN [--project P] [--worker all|N] [--dry-run]"

parse_args "run worker" "" "$@"
need_name
need_run_name
need_worker all
((${#CMD[@]} == 0)) || usage_error "status takes no command after --"

describe=(compute tpus tpu-vm describe "$NAME" "${ZONE_ARGS[@]}" --format='value(state)')
if [[ ${opt_dry_run:-0} == 1 ]]; then
  gcloud_run "${describe[@]}"
else
  state=$("$GCLOUD" "${describe[@]}")
  echo "TPU $NAME: $state"
  if [[ $state != READY ]]; then
    echo "$SCRIPT_NAME: $NAME is not READY: after a preemption recreate it (launch/create.sh), run launch/setup.sh and start the run again with --resume" >&2
    exit 1
  fi
fi
steps=(
  "dir=$RUN_DIR"
  'found=0'
  'for pid_file in "$dir"/worker-*.pid; do [ -e "$pid_file" ] || continue; found=1; w=${pid_file##*/worker-}; w=${w%.pid}; pid=$(cat "$pid_file"); if [ -f "$dir/worker-$w.exit" ]; then state="finished, exit status $(cat "$dir/worker-$w.exit")"; elif kill -0 "$pid" 2>/dev/null; then state="running (pid $pid)"; else state="stopped without an exit status (killed or preempted)"; fi; last=$(tail -c 4096 "$dir/worker-$w.log" 2>/dev/null | tr "\r" "\n" | grep -v "^[[:space:]]*$" | tail -n 1 || true); echo "worker $w: $state | ${last:-<empty log>}"; done'
  "[ \$found = 1 ] || echo \"\$(hostname): no run $opt_run here\""
)
ssh_workers "$WORKER" "$(join_lines "${steps[@]}")"
