"""The documentation site builds with no warning (``mkdocs build --strict``), as
``scripts/docs.sh`` builds it: a broken link between pages, a reference to a public name
that is gone, a docstring mkdocstrings cannot read or a CLI parser that fails to render
fails here, in the suite CI runs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "scripts" / "docs" / "mkdocs.yml"


@pytest.mark.slow
@pytest.mark.server  # mkdocs in a process of its own
def test_the_site_builds_strictly(tmp_path):
    missing = [
        m
        for m in ("mkdocs", "material", "mkdocstrings_handlers.python")
        if importlib.util.find_spec(m.split(".")[0]) is None
    ]
    assert not missing, (
        f"the `docs` extra is not installed in {sys.prefix} (missing {missing}): "
        "pip install -e '.[docs]' (scripts/docs.sh installs it into .venv-py312)"
    )
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    # The generated references are there: every subcommand, and the curated API.
    cli = (site / "cli.html").read_text()
    for command in ("demo", "run", "explain", "plan", "serve"):
        assert f"jaxpar {command}" in cli, command
    assert "shard_tree" in (site / "api" / "spec.html").read_text()
    assert "InferenceEngine" in (site / "api" / "jaxpar.html").read_text()
