"""Test set-up: 8 simulated CPU devices, forced before JAX initialises its backends."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import _schedule, _timing  # noqa: E402

jax.config.update("jax_enable_x64", False)

# Identical programs (same model, strategy and shapes) recur across test files; a cache
# private to this run compiles each once. It starts empty, so every program is still
# compiled and checked at least once per run.
# One per run: the process that starts the run (the xdist controller, or pytest alone)
# makes it and removes it when it exits; xdist workers are handed its path (see
# pytest_configure_node) and share it, so a program compiled in one worker is loaded in
# another. Entries are keyed on the program, its devices and the compile options. (JAX
# writes an entry unlocked: a worker that reads one half-written warns and compiles.)
_CACHE_DIR = "jaxpar_test_xla_cache_dir"


def pytest_configure(config) -> None:
    path = getattr(config, "workerinput", {}).get(_CACHE_DIR)
    if path is None:  # the run's own process: a fresh, empty directory
        path = tempfile.mkdtemp(prefix="jaxpar-test-xla-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Processes the tests start (jaxpar serve, jaxpar demo) use it too, not the user's cache.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # The CPU programs' machine code unoptimised (LLVM at -O0), here and in the processes
    # the tests start: XLA's HLO passes (SPMD partitioning, collectives, fusion, buffer
    # assignment) run as always, so every sharding, collective and memory figure the tests
    # read is the one users get; only the CPU backend's code generation is skipped, which
    # costs more than the tiny programs take to run (it cut the fast tier's file time by
    # a third: 870 s -> 574 s). Compiles for accelerators keep it (accelerator_compiles).
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    # Seconds per test file, shown at the end (and written to $JAXPAR_TEST_TIMES).
    _timing.register(config)


def pytest_collection_modifyitems(items) -> None:
    """The long files first, so that xdist's workers end together (tests/_schedule.py)."""
    _schedule.long_files_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """In the xdist controller, before each worker starts: hand it the run's cache."""
    node.workerinput[_CACHE_DIR] = jax.config.jax_compilation_cache_dir


assert jax.device_count() == 8, f"tests need 8 simulated CPU devices, got {jax.device_count()}"

# The live transformers oracle runs in the HF venv, which has torch but not JAX, and so
# without this conftest: `.venv-hf/bin/python -m pytest --noconftest -m hf_live
# tests/test_hf_live.py` (see scripts/make_hf_fixtures.py). Here it is not collected.
collect_ignore = ["test_hf_live.py"]


@pytest.fixture(scope="module")
def accelerator_compiles():
    """For a module that compiles for TPU or GPU (compile-only): the compiler optimises as
    in production (the figures asserted are those users get), and the persistent compile
    cache is off: compile-only TPU executables are written to it but cannot be read back
    without a TPU client (jax 0.12 warns and compiles again)."""
    was = jax.config.values["jax_enable_compilation_cache"]
    unoptimised = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    jax.config.update("jax_disable_most_optimizations", unoptimised)
