#!/usr/bin/env bash
# Runs the whole test suite on 8 simulated CPU devices (the tests force them themselves).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
exec .venv/bin/python -m pytest -q "$@"
