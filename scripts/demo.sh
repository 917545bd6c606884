#!/usr/bin/env bash
# The main job on the built-in default: a tiny model on this machine's accelerators, or on
# 8 simulated CPU devices where there is none (`--cpu-devices N` to simulate N on the CPU).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
jaxpar_venv .venv "${PYTHON:-python3}"
exec .venv/bin/jaxpar demo "$@"
