#!/usr/bin/env bash
# Delete a TPU slice, or (--queued) its queued resource together with the slice it holds.
#
#   launch/delete.sh NAME --zone ZONE [--project PROJECT] [--queued [--queued-resource-id ID]] [--dry-run]
source "$(dirname "$0")/common.sh"
USAGE="launch/delete.sh NAME --zone ZONE [--project P] [--queued [--queued-resource-id ID]] [--dry-run]"

parse_args "queued-resource-id" "queued" "$@"
need_name
((${#CMD[@]} == 0)) || usage_error "delete takes no command after --"
if [[ ${opt_queued:-0} == 1 ]]; then
  gcloud_run compute tpus queued-resources delete "${opt_queued_resource_id:-$NAME-qr}" "${ZONE_ARGS[@]}" --force --quiet
else
  [[ -z ${opt_queued_resource_id:-} ]] || usage_error "--queued-resource-id needs --queued"
  gcloud_run compute tpus tpu-vm delete "$NAME" "${ZONE_ARGS[@]}" --quiet
fi
