# Shared by the launch scripts (sourced, not run): argument parsing, --dry-run, quoting, and the
# layout on the TPU workers. Every script takes --zone (required), --project and --dry-run; a usage
# error is one line on stderr and exit status 2.
#
# On every worker:
#   ~/dspark/                 the working directory (configs/ from setup.sh; data/, checkpoints/, runs/)
#   ~/dspark/.venv/           the virtual environment setup.sh installs into
#   ~/dspark_runs/RUN/        one detached run of run.sh: worker-ID.log, worker-ID.pid, worker-ID.exit, command
# ID is the TPU worker number (TPU_WORKER_ID, else the metadata server's agent-worker-number, else
# the hostname).

set -euo pipefail

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$LAUNCH_DIR/.." && pwd)
GCLOUD=${GCLOUD:-gcloud}
SCRIPT_NAME=$(basename "$0")
REMOTE_WORKDIR='~/dspark'
REMOTE_RUNS='~/dspark_runs'
# The worker's number, evaluated on the worker.
REMOTE_WORKER_ID='${TPU_WORKER_ID:-$(curl -sf -m 2 -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null || hostname)}'

usage_error() {  # one line on stderr, exit 2
  echo "$SCRIPT_NAME: $* (usage: $USAGE)" >&2
  exit 2
}

shell_quote() {  # one word, quoted as Python's shlex.quote quotes it
  local s=$1
  if [[ -n $s && $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\"\'\"\'}"
  fi
}

join_quoted() {  # the words as one shell command line
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(shell_quote "$word")"
  done
  printf '%s' "$out"
}

run() {  # run a command, or with --dry-run print it (one line, shell-quoted) and run nothing
  if [[ ${opt_dry_run:-0} == 1 ]]; then
    printf '%s\n' "$(join_quoted "$@")"
  else
    "$@"
  fi
}

gcloud_run() { run "$GCLOUD" "$@"; }

# parse_args VALUE_OPTIONS FLAG_OPTIONS "$@": sets opt_NAME (dashes as underscores) for every
# option given (--name value or --name=value; flags to 1), POSITIONAL to the other words and CMD
# to the words after "--". --zone, --project (values) and --dry-run, --help (flags) are always known.
parse_args() {
  local values=" zone project $1 " flags=" dry-run help $2 " word name
  shift 2
  POSITIONAL=()
  CMD=()
  while (($#)); do
    word=$1
    shift
    case $word in
      --)
        CMD=("$@")
        break
        ;;
      --*=*)
        name=${word%%=*}
        name=${name#--}
        [[ $values == *" $name "* ]] || usage_error "unknown option --$name (or it takes no value)"
        [[ -n ${word#*=} ]] || usage_error "--$name needs a value"
        printf -v "opt_${name//-/_}" '%s' "${word#*=}"
        ;;
      -h | --help)
        echo "usage: $USAGE"
        exit 0
        ;;
      --*)
        name=${word#--}
        if [[ $values == *" $name "* ]]; then
          (($#)) && [[ -n $1 && $1 != --* ]] || usage_error "--$name needs a value"
          printf -v "opt_${name//-/_}" '%s' "$1"
          shift
        elif [[ $flags == *" $name "* ]]; then
          printf -v "opt_${name//-/_}" '%s' 1
        else
          usage_error "unknown option --$name"
        fi
        ;;
      -*)
        usage_error "unknown option $word"
        ;;
      *)
        POSITIONAL+=("$word")
        ;;
    esac
  done
  [[ -n ${opt_zone:-} ]] || usage_error "--zone is required"
  ZONE_ARGS=(--zone="$opt_zone")
  [[ -z ${opt_project:-} ]] || ZONE_ARGS+=(--project="$opt_project")
}

need_name() {  # the one positional argument: the TPU VM (node) name
  ((${#POSITIONAL[@]} == 1)) || usage_error "give exactly one TPU name, got ${#POSITIONAL[@]} positional arguments"
  NAME=${POSITIONAL[0]}
  [[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || usage_error "TPU name '$NAME' must be lowercase letters, digits and dashes"
}

need_run_name() {  # --run RUN: a folder name under ~/dspark_runs
  [[ -n ${opt_run:-} ]] || usage_error "--run is required"
  [[ $opt_run =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || usage_error "run name '$opt_run' may hold only letters, digits, '.', '_' and '-'"
  RUN_DIR="$REMOTE_RUNS/$opt_run"
}

need_worker() {  # --worker N|all (default: $1)
  WORKER=${opt_worker:-$1}
  [[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || usage_error "--worker must be a number or 'all', got '$WORKER'"
}

join_lines() {  # shell statements as one line, "; " between them (after a "&": " "), so a remote command stays one line
  local out="" line
  for line in "$@"; do
    if [[ -z $out ]]; then
      out=$line
    elif [[ $out == *"&" && $out != *"&&" ]]; then
      out+=" $line"
    else
      out+="; $line"
    fi
  done
  printf '%s' "$out"
}

ssh_workers() {  # ssh_workers WORKER COMMAND: run COMMAND on the TPU workers
  gcloud_run compute tpus tpu-vm ssh "$NAME" "${ZONE_ARGS[@]}" --worker="$1" --command="$2"
}
