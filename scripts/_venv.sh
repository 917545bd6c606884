# Sourced by scripts/test.sh and scripts/demo.sh: create or reuse .venv and install jaxpar
# (editable, with its test extra) into it. Re-installs only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=".venv/.jaxpar-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch "$stamp"
fi
