#!/usr/bin/env bash
# Show the log of a detached run: worker 0's by default, or every worker's (--worker all).
#
#   launch/logs.sh NAME --zone ZONE --run RUN [--project PROJECT] [--worker N|all] [--lines 50] [--follow] [--dry-run]
source "$(dirname "$0")/common.sh"
USAGE="launch/logs.sh NAME --zone ZONE --run RUN [--project P] [--worker N|all] [--lines N] [--follow] [--dry-run]"

parse_args "run worker lines" "follow" "$@"
need_name
need_run_name
need_worker 0
((${#CMD[@]} == 0)) || usage_error "logs takes no command after --"
lines=${opt_lines:-50}
[[ $lines =~ ^[0-9]+$ ]] || usage_error "--lines must be a number, got '$lines'"
if [[ ${opt_follow:-0} == 1 ]]; then
  tail_cmd="tail -n $lines -F \"\$log\""
else
  tail_cmd="tail -n $lines \"\$log\" | tr \"\\r\" \"\\n\" | tail -n $lines"
fi
steps=(
  "dir=$RUN_DIR"
  'found=0'
  "for log in \"\$dir\"/worker-*.log; do [ -e \"\$log\" ] || continue; found=1; echo \"==> \$(hostname) \$log <==\"; $tail_cmd; done"
  "[ \$found = 1 ] || { echo \"\$(hostname): no log of run $opt_run in \$dir\" >&2; exit 1; }"
)
ssh_workers "$WORKER" "$(join_lines "${steps[@]}")"
