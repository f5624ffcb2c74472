#!/usr/bin/env bash
# Start the same command on every worker of a TPU slice (the SPMD way), detached: it survives a
# dropped SSH connection and this machine going away.
#
#   launch/run.sh NAME --zone ZONE --run RUN [--project PROJECT] [--worker all|N] [--dry-run] -- COMMAND ...
#
# On each worker COMMAND runs in ~/dspark with ~/dspark/.venv activated, under nohup + setsid, its
# output appended to ~/dspark_runs/RUN/worker-ID.log; the pid goes to worker-ID.pid and, when it
# ends, the exit status to worker-ID.exit (launch/status.sh reads them; launch/logs.sh tails the
# log). A RUN still running on a worker is not started twice there; a finished or killed one
# (e.g. preempted) may be started again under the same name, appending to its log: that is how a
# `python -m dspark_jax.train ... --resume` continues a run.
source "$(dirname "$0")/common.sh"
USAGE="launch/run.sh NAME --zone ZONE --run RUN [--project P] [--worker all|N] [--dry-run] -- COMMAND ..."

parse_args "run worker" "" "$@"
need_name
need_run_name
need_worker all
((${#CMD[@]} > 0)) || usage_error "give the command to run after --"

command_line=$(join_quoted "${CMD[@]}")
# What the detached shell runs on the worker (its own single-quoted script: $? and the exit-file
# variable are expanded there, not by the login shell that starts it).
inner="source $REMOTE_WORKDIR/.venv/bin/activate && cd $REMOTE_WORKDIR && $command_line; echo \$? > \"\$DSPARK_EXIT_FILE\""
steps=(
  "set -euo pipefail"
  "wid=$REMOTE_WORKER_ID"
  "dir=$RUN_DIR"
  'mkdir -p "$dir"'
  'log=$dir/worker-$wid.log pid_file=$dir/worker-$wid.pid'
  'export DSPARK_EXIT_FILE=$dir/worker-$wid.exit'
  "if [ -f \"\$pid_file\" ] && kill -0 \"\$(cat \"\$pid_file\")\" 2>/dev/null; then echo \"worker \$wid: run $opt_run is still running (pid \$(cat \"\$pid_file\")), not started again\" >&2; exit 1; fi"
  'rm -f "$DSPARK_EXIT_FILE"'
  "printf '%s\\n' $(shell_quote "$command_line") > \"\$dir/command\""
  'echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) worker $wid starts: $(cat "$dir/command")" >> "$log"'
  "nohup setsid bash -c $(shell_quote "$inner") >> \"\$log\" 2>&1 < /dev/null &"
  'echo $! > "$pid_file"'
  'echo "worker $wid: started pid $!, log $log"'
)
ssh_workers "$WORKER" "$(join_lines "${steps[@]}")"
