#!/usr/bin/env bash
# Checks format and lint (ruff), then runs the whole test suite on 8 simulated CPU devices
# (the tests force them themselves), spread over JAXPAR_TEST_WORKERS processes (default:
# one per core, at most 4), a file per worker at a time: files share their compiled programs
# and servers within one process.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
source "$(dirname "$0")/_accelerators.sh"
# Lint first: format drift or a lint finding fails the run before any test.
.venv/bin/ruff format --check .
.venv/bin/ruff check .
workers="${JAXPAR_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, os.cpu_count() or 1))')}"
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
