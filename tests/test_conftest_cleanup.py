"""The suite's XLA cache: one per run, shared by its xdist workers, gone after the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]


def test_one_xla_cache_directory_per_run_shared_and_removed(tmp_path):
    """A pytest run with the suite's conftest over two xdist workers: the controller makes
    one ``jaxpar-test-xla-*`` directory in its temp directory, both workers compile into
    it, and none is left after the run. The controller also sums each file's seconds from
    both workers' reports (tests/_timing.py) and writes them to ``JAXPAR_TEST_TIMES``."""
    times = tmp_path / "times.json"
    env = {**os.environ, "TMPDIR": str(tmp_path), "JAXPAR_TEST_TIMES": str(times)}
    seen = tmp_path / "seen.txt"
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\n\n"
        "import jax\n\n"
        "def test_probe():\n"
        "    jax.jit(lambda x: x * 3 + 1)(2.0).block_until_ready()\n"
        "    path = jax.config.jax_compilation_cache_dir\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(f\"{os.environ['PYTEST_XDIST_WORKER']} {path} {len(os.listdir(path))}\\n\")\n"
    )
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "tests").mkdir()  # the conftest's own imports
    for name in ("__init__.py", "_schedule.py", "_timing.py"):
        (tmp_path / "tests" / name).write_text((ROOT / "tests" / name).read_text())
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "each"]
        + ["-p", "no:cacheprovider", str(probe)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in seen.read_text().splitlines()]
    assert sorted(worker for worker, _, _ in rows) == ["gw0", "gw1"], rows
    (used,) = {Path(path) for _, path, _ in rows}  # one directory for both workers
    assert used.name.startswith("jaxpar-test-xla-") and used.parent == tmp_path, used
    assert all(int(entries) > 0 for _, _, entries in rows), rows  # compiled programs cached
    assert not list(tmp_path.glob("jaxpar-test-xla-*"))
    assert "seconds per test file" in run.stdout, run.stdout
    report = json.loads(times.read_text())
    (row,) = report["files"]  # the probe ran once in each worker: both counted, once each
    assert (row["file"], row["tests"], row["failed"]) == ("test_probe.py", 2, 0), report
    assert report["finished"] and 0 < row["seconds"] == report["total_s"] <= report["wall_s"], (
        report
    )
