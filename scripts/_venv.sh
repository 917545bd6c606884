# Sourced by scripts/test.sh and scripts/demo.sh: changes to the repository root and defines
#   jaxpar_venv DIR PYTHON [EXTRAS]
#                            create or reuse the virtual environment DIR with the interpreter
#                            PYTHON and install jaxpar (editable, with its EXTRAS, default
#                            "test") into it; re-installs only when pyproject.toml or the
#                            extras changed. pip resolves JAX for that Python (3.11: jax
#                            0.10.2; 3.12: the newest release inside pyproject.toml's range).
#   find_python X.Y          print a working interpreter of Python X.Y (PATH first, then
#                            pyenv's installs), or nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jaxpar_venv() {
  local venv="$1" python="$2" extras="${3:-test}"
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  # The stamp lists the extras installed: asking for one it lacks installs them.
  local stamp="$venv/.jaxpar-installed" extra missing=""
  for extra in ${extras//,/ }; do
    grep -qx "$extra" "$stamp" 2>/dev/null || missing=1
  done
  if [ -n "$missing" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e ".[$extras]"
    tr , '\n' <<<"$extras" >"$stamp"
  fi
}

find_python() {
  local want="$1" candidate
  # A pyenv shim for a version that is installed but not selected exists and fails to run:
  # every candidate is run once to check its version.
  for candidate in "$(command -v "python$want" 2>/dev/null || true)" \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/python; do
    if [ -x "$candidate" ] && "$candidate" -c \
      "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$want')" 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}
