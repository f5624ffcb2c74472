#!/usr/bin/env bash
# Stop a detached run on every worker (SIGTERM to its process group; --kill: SIGKILL). A training
# run stopped this way resumes from its latest checkpoint with `train --resume`.
#
#   launch/stop.sh NAME --zone ZONE --run RUN [--project PROJECT] [--worker all|N] [--kill] [--dry-run]
source "$(dirname "$0")/common.sh"
USAGE="launch/stop.sh NAME --zone ZONE --run RUN [--project P] [--worker all|N] [--kill] [--dry-run]"

parse_args "run worker" "kill" "$@"
need_name
need_run_name
need_worker all
((${#CMD[@]} == 0)) || usage_error "stop takes no command after --"
signal=TERM
[[ ${opt_kill:-0} == 0 ]] || signal=KILL
steps=(
  "dir=$RUN_DIR"
  "for pid_file in \"\$dir\"/worker-*.pid; do [ -e \"\$pid_file\" ] || continue; pid=\$(cat \"\$pid_file\"); if kill -0 \"\$pid\" 2>/dev/null; then kill -$signal -- \"-\$pid\" && echo \"\$(hostname): sent SIG$signal to run $opt_run (process group \$pid)\"; else echo \"\$(hostname): run $opt_run is not running\"; fi; done"
)
ssh_workers "$WORKER" "$(join_lines "${steps[@]}")"
