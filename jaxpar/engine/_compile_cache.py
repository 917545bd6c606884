"""JAX's persistent compilation cache, on by default, on every process, and a count of
what it served.

A restart with the same model, strategy and shapes then loads every executable from disk
instead of compiling it. :func:`enable_compile_cache` points JAX at a directory (by
default ``$XDG_CACHE_HOME/jaxpar/xla``, else ``~/.cache/jaxpar/xla``) and caches every
program, however quick to compile (JAX's defaults skip programs under a second, which
leaves a small model's restart compiling almost everything). :class:`CompileCount`
counts the cache's hits and misses from JAX's monitoring events.

Several processes (``jax.distributed``): JAX writes cache entries from process 0 only
(it assumes one directory on shared storage, and its writes are not atomic), so every
other process compiled every program again at every start: the cache key of a program
that spans processes holds the process's own view of the devices (on CPU the topology
fingerprint differs per process), and nothing wrote the others' entries. Here process
``i > 0`` keeps its entries in ``<dir>/process-<i>`` and writes them itself: no two
processes write one file, and a host with its own disk (a TPU VM) finds its programs at
the next start as process 0 does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
import warnings
from pathlib import Path

import jax
from jax import monitoring

_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"
#: What :func:`enable_compile_cache` was given (resolved): the directory of process 0, and
#: the parent of the others' (set again per process once ``jax.distributed`` is up).
_base: Path | None = None
log = logging.getLogger(__name__)


def default_compile_cache() -> Path:
    """``$XDG_CACHE_HOME/jaxpar/xla``, else ``~/.cache/jaxpar/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxpar" / "xla"


def enable_compile_cache(directory: str | Path | None = None) -> Path:
    """Turns JAX's persistent compilation cache on at ``directory`` for every program; call
    before the first compile. Default: the directory JAX is already configured with
    (``JAX_COMPILATION_CACHE_DIR``), else :func:`default_compile_cache`. Returns the
    directory this process uses: ``directory`` itself, or its ``process-<i>`` for process
    ``i > 0`` of a multi-process job (see the module's docstring)."""
    global _base
    configured = jax.config.jax_compilation_cache_dir
    if directory is not None:
        _base = Path(directory)
    elif not configured:
        _base = default_compile_cache()
    elif _base is None or configured != str(_process_directory(_base)):
        _base = Path(configured)  # else: set by the last call (a process's own, i > 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return _use_process_directory()


def cache_every_process() -> Path | None:
    """After ``jax.distributed.initialize`` (and before the first compile): moves this
    process to its own cache directory and lets it write there (:func:`enable_compile_cache`
    does both if it runs after the initialize). None if the cache is not enabled."""
    return None if _base is None else _use_process_directory()


def _process_id() -> int:
    from jax._src import distributed  # no public accessor that leaves the backends unstarted

    return distributed.global_state.process_id or 0


def _process_directory(base: Path) -> Path:
    pid = _process_id()
    return base if pid == 0 else base / f"process-{pid}"


def _use_process_directory() -> Path:
    path = _process_directory(_base)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if _process_id():
        _write_from_this_process()
    return path


_WRITE_ARGS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable")


def _write_from_this_process() -> None:
    """Wraps JAX's cache write (``jax._src.compiler._cache_write``, which returns at once on
    a process other than 0) to write this process's entries too. Left alone, with a log
    line, if that function is not the one this was written against."""
    from jax._src import compilation_cache, compiler

    write = getattr(compiler, "_cache_write", None)
    if getattr(write, "every_process", False):
        return
    if write is None or tuple(inspect.signature(write).parameters) != _WRITE_ARGS:
        log.warning("this JAX's cache writes are not known: process %d recompiles", _process_id())
        return

    def every_process(cache_key, compile_time_secs, module_name, backend, executable) -> None:
        if compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:  # noqa: BLE001 - as JAX's own write: a warning, not a failure
            warnings.warn(f"compile cache entry of {module_name!r} not written: {e}", stacklevel=2)

    every_process.every_process = True
    compiler._cache_write = every_process


@dataclasses.dataclass
class CompileCount:
    """Persistent-cache hits and misses (programs compiled) since :meth:`start`."""

    hits: int = 0
    misses: int = 0
    # Warm-up compiles on several threads: each one's event counts.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def start(self) -> CompileCount:
        monitoring.register_event_listener(self._on_event)
        return self

    def _on_event(self, event: str, **_: object) -> None:
        with self._lock:
            if event == _HIT:
                self.hits += 1
            elif event == _MISS:
                self.misses += 1
