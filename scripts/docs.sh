#!/usr/bin/env bash
# Builds the documentation site (scripts/docs/mkdocs.yml; pages under scripts/docs/pages/)
# into .site/ with `mkdocs build --strict`: a broken link, a reference to a name that is
# gone or a docstring mkdocstrings cannot read fails the build. The CLI and API reference
# pages are generated at build time (scripts/docs/hooks.py).
#
#   scripts/docs.sh                 build into .site/ (arguments go to mkdocs build)
#   scripts/docs.sh serve           live preview on http://127.0.0.1:8000 (pages and
#                                   docstrings rebuild on save; arguments go to mkdocs serve)
#
# The `docs` extra goes into .venv-py312, the environment scripts/test.sh runs the whole
# suite in, next to whatever extras it already holds (Python 3.12: found on PATH or in
# pyenv, JAXPAR_PYTHON_3_12 overrides).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"

venv=.venv-py312
python="${JAXPAR_PYTHON_3_12:-$(find_python 3.12)}"
if [ ! -x "$venv/bin/python" ] && [ -z "$python" ]; then
  echo "scripts/docs.sh: no Python 3.12 found (on PATH or in pyenv); set JAXPAR_PYTHON_3_12" >&2
  exit 1
fi
# Keep the extras the environment has (test, lmeval): asking for fewer would re-install.
extras="$( (echo docs; cat "$venv/.jaxpar-installed" 2>/dev/null || true) | sort -u | paste -sd, -)"
jaxpar_venv "$venv" "$python" "$extras"

export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, on every build
config=scripts/docs/mkdocs.yml
case "${1:-}" in
  serve) shift; exec "$venv/bin/mkdocs" serve -f "$config" "$@" ;;
  build) shift ;;
esac
exec "$venv/bin/mkdocs" build --strict -f "$config" "$@"
