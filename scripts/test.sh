#!/usr/bin/env bash
# Checks format and lint (ruff), then runs the test suite on 8 simulated CPU devices (the
# tests force them themselves), spread over JAXPAR_TEST_WORKERS processes (default: one per
# core, at most 4), a file per worker at a time: files share their compiled programs and
# servers within one process. Arguments after the options go to pytest. At the end pytest
# prints each file's seconds, slowest first (tests/_timing.py); JAXPAR_TEST_TIMES=FILE
# writes the whole table there as JSON.
#
#   scripts/test.sh --fast   the fast tier, for a quick check while working: Python 3.12
#                            alone (.venv-py312, the `test` extra; no lm-eval, no
#                            accelerator compilers installed), lint, then every test not
#                            marked server, sweep, accel, pod, slow or hf_live
#                            (pyproject.toml): each layer (spec, models, engine on a few
#                            strategies each, inspect, plan, the CLI and the server app in
#                            process). Measured 2026-11-28 on this 2-core machine (load
#                            ~2): 1,119 tests, 6 min 13 s (710 s of file time over 2
#                            workers).
#   scripts/test.sh          the full tier, what CI runs (.ci/run): every test, on two JAX
#                            releases, below. Measured 2026-11-28 (load 2-4): 23 min 36 s in
#                            all, over the 20-minute goal (3.11: 137 tests, 1 min 44 s; 3.12:
#                            1,594 tests, 21 min 45 s, of which test_pod_compile.py takes
#                            3.1 min; both cores busy throughout: 193% CPU).
# Test programs compile for CPU with LLVM at -O0 (tests/conftest.py): XLA's HLO passes run as
# always, so every sharding, collective and memory figure is the one users get.
# Nothing the fast tier leaves out is skipped: it is deselected by its marker, and the full
# tier runs it.
#
# The full tier: two JAX releases, the ends of the range pyproject.toml pins, within CI's
# time (2 cores; `pod` compiles real model shapes for TPU slices for minutes, which
# `-m "not pod"` leaves out locally):
#   1. Python 3.11 with jax 0.10.2, the newest pip gives 3.11 (.venv): only the tests marked
#      `jax_compat` (pyproject.toml), the version-sensitive ones: compiled-HLO parsing, MoE
#      nested in the pipeline, attention kernels, the planner against compiled programs.
#   2. Python 3.12 with the newest JAX and Flax pip gives it (.venv-py312): the whole suite.
# The whole suite goes to the newest release because that is what a new install gets and
# the one that changes under us (a release inside the range is picked up by the next run);
# 3.11's environment is frozen at jax 0.10.2, so only what depends on the release can break
# there. JAXPAR_TEST_JAX=3.11 or 3.12 runs the whole suite on that Python alone; the
# interpreters are found on PATH or in pyenv (JAXPAR_PYTHON_3_11 / _3_12 override).
# The whole suite's environment also gets the `lmeval` extra (lm-eval-harness and the
# transformers tokenizer its OpenAI client counts tokens with; no torch): a test runs its
# completions client against `jaxpar serve`, and the `docs` extra (MkDocs: a test builds the
# site with --strict). Both environments get the accelerator
# compilers (scripts/_accelerators.sh) for the tests marked `accel`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
source "$(dirname "$0")/_accelerators.sh"

python_for() {  # python_for X.Y: the interpreter for Python X.Y, or exit with why
  local override="JAXPAR_PYTHON_${1//./_}" found
  found="${!override:-$(find_python "$1")}"
  if [ -z "$found" ]; then
    echo "scripts/test.sh: no Python $1 found (on PATH or in pyenv); set $override," \
      "or JAXPAR_TEST_JAX to the one Python to test on" >&2
    exit 1
  fi
  echo "$found"
}

venv_for() { [ "$1" = 3.12 ] && echo .venv-py312 || echo .venv; }

fast=""
if [ "${1:-}" = --fast ]; then
  fast=1
  shift
fi

full="${JAXPAR_TEST_JAX:-3.12}"
compat=""
[ -z "${JAXPAR_TEST_JAX:-}" ] && [ -z "$fast" ] && compat=3.11
full_python="$(python_for "$full")"
[ -z "$compat" ] || compat_python="$(python_for "$compat")"
if [ -n "$fast" ]; then
  jaxpar_venv "$(venv_for "$full")" "$full_python" test
else
  jaxpar_venv "$(venv_for "$full")" "$full_python" test,lmeval,docs
  jaxpar_accelerators "$(venv_for "$full")"
fi
if [ -n "$compat" ]; then
  jaxpar_venv "$(venv_for "$compat")" "$compat_python"
  jaxpar_accelerators "$(venv_for "$compat")"
fi

# Lint first: format drift or a lint finding fails the run before any test.
"$(venv_for "$full")/bin/ruff" format --check .
"$(venv_for "$full")/bin/ruff" check .
workers="${JAXPAR_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, os.cpu_count() or 1))')}"
pytest=(-m pytest -q -n "$workers" --dist loadfile)
if [ -n "$compat" ]; then
  venv="$(venv_for "$compat")"
  echo "== jax_compat tests on $("$venv/bin/python" -c 'import sys, jax, flax; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")' 2>/dev/null)"
  # -m replaces pyproject's "not hf_live" (no jax_compat test is one). Exit code 5: the
  # arguments selected no jax_compat test, which is no failure.
  "$venv/bin/python" "${pytest[@]}" -m jax_compat "$@" || [ $? -eq 5 ]
fi
venv="$(venv_for "$full")"
if [ -n "$fast" ]; then
  # The markers (pyproject.toml) of what only the full tier runs; a -m of the caller's,
  # coming later, replaces this one.
  pytest+=(-m "not (server or sweep or accel or pod or slow or hf_live)")
fi
echo "== ${fast:+the fast tier of }all tests on $("$venv/bin/python" -c 'import sys, jax, flax; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")' 2>/dev/null)"
exec "$venv/bin/python" "${pytest[@]}" "$@"
