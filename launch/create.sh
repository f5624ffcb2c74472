#!/usr/bin/env bash
# Create a Cloud TPU VM slice, directly or through a queued resource (which waits for capacity and,
# with --spot, is how spot / preemptible slices are usually obtained).
#
#   launch/create.sh NAME --zone ZONE --accelerator-type TYPE [--runtime-version VERSION] [--project PROJECT]
#                    [--queued [--queued-resource-id ID] [--valid-until-duration 6h] [--wait]]
#                    [--spot | --preemptible | --best-effort] [--dry-run]
#
# --runtime-version defaults by TPU generation: v4 tpu-ubuntu2204-base, v5litepod/v5e v2-alpha-tpuv5-lite,
# v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e. --spot: spot capacity (either way); --preemptible: the
# older preemptible VMs (direct only); --best-effort: queued only. The queued resource's id defaults
# to NAME-qr; --wait polls it until ACTIVE (every DSPARK_POLL_SECONDS, default 30).
source "$(dirname "$0")/common.sh"
USAGE="launch/create.sh NAME --zone ZONE --accelerator-type TYPE [--runtime-version V] [--project P] [--queued [--queued-resource-id ID] [--valid-until-duration D] [--wait]] [--spot|--preemptible|--best-effort] [--dry-run]"

parse_args "accelerator-type runtime-version queued-resource-id valid-until-duration" \
  "queued spot preemptible best-effort wait" "$@"
need_name
((${#CMD[@]} == 0)) || usage_error "create takes no command after --"
type=${opt_accelerator_type:-}
[[ -n $type ]] || usage_error "--accelerator-type is required (e.g. v5p-8, v6e-8)"
version=${opt_runtime_version:-}
if [[ -z $version ]]; then
  case $type in
    v4-*) version=tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) version=v2-alpha-tpuv5-lite ;;
    v5p-*) version=v2-alpha-tpuv5 ;;
    v6e-*) version=v2-alpha-tpuv6e ;;
    *) usage_error "no default runtime version for accelerator type '$type': give --runtime-version" ;;
  esac
fi
kinds=$(( ${opt_spot:-0} + ${opt_preemptible:-0} + ${opt_best_effort:-0} ))
((kinds <= 1)) || usage_error "choose one of --spot, --preemptible, --best-effort"
queued=${opt_queued:-0}
if [[ $queued == 1 ]]; then
  [[ ${opt_preemptible:-0} == 0 ]] || usage_error "queued resources take --spot (or --best-effort), not --preemptible"
  qr=${opt_queued_resource_id:-$NAME-qr}
  args=(compute tpus queued-resources create "$qr" --node-id="$NAME" "${ZONE_ARGS[@]}"
        --accelerator-type="$type" --runtime-version="$version")
  [[ ${opt_spot:-0} == 0 ]] || args+=(--spot)
  [[ ${opt_best_effort:-0} == 0 ]] || args+=(--best-effort)
  [[ -z ${opt_valid_until_duration:-} ]] || args+=(--valid-until-duration="$opt_valid_until_duration")
  gcloud_run "${args[@]}"
  if [[ ${opt_wait:-0} == 1 ]]; then
    describe=(compute tpus queued-resources describe "$qr" "${ZONE_ARGS[@]}" --format='value(state.state)')
    if [[ ${opt_dry_run:-0} == 1 ]]; then
      gcloud_run "${describe[@]}"
    else
      while :; do
        state=$("$GCLOUD" "${describe[@]}")
        echo "queued resource $qr: $state" >&2
        case $state in
          ACTIVE) break ;;
          FAILED | SUSPENDED) echo "$SCRIPT_NAME: queued resource $qr is $state" >&2; exit 1 ;;
        esac
        sleep "${DSPARK_POLL_SECONDS:-30}"
      done
    fi
  fi
else
  for flag in queued-resource-id valid-until-duration; do
    var=opt_${flag//-/_}
    [[ -z ${!var:-} ]] || usage_error "--$flag needs --queued"
  done
  [[ ${opt_wait:-0} == 0 ]] || usage_error "--wait needs --queued (a direct create already waits)"
  [[ ${opt_best_effort:-0} == 0 ]] || usage_error "--best-effort needs --queued"
  args=(compute tpus tpu-vm create "$NAME" "${ZONE_ARGS[@]}" --accelerator-type="$type" --version="$version")
  [[ ${opt_spot:-0} == 0 ]] || args+=(--spot)
  [[ ${opt_preemptible:-0} == 0 ]] || args+=(--preemptible)
  gcloud_run "${args[@]}"
fi
