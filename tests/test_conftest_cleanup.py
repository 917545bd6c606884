"""The suite's private XLA cache directories do not outlive the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_xla_cache_directories_are_removed(tmp_path):
    """A pytest run with the suite's conftest (the controller and two xdist workers each
    make a directory) leaves no ``jaxpar-test-xla-*`` directory in its temp directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    seen = tmp_path / "seen.txt"
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import jax\n\n"
        "def test_probe():\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(jax.config.jax_compilation_cache_dir + '\\n')\n"
    )
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(probe)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    used = seen.read_text().split()
    assert used and all(Path(d).name.startswith("jaxpar-test-xla-") for d in used), used
    assert all(Path(d).parent == tmp_path for d in used), used
    assert not list(tmp_path.glob("jaxpar-test-xla-*"))
