#!/usr/bin/env bash
# The main job on the built-in default: a tiny model on 8 simulated CPU devices.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec .venv/bin/jaxpar demo "$@"
