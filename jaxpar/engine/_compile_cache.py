"""JAX's persistent compilation cache, on by default, and a count of what it served.

A restart with the same model, strategy and shapes then loads every executable from disk
instead of compiling it. :func:`enable_compile_cache` points JAX at a directory (by
default ``$XDG_CACHE_HOME/jaxpar/xla``, else ``~/.cache/jaxpar/xla``) and caches every
program, however quick to compile (JAX's defaults skip programs under a second, which
leaves a small model's restart compiling almost everything). :class:`CompileCount`
counts the cache's hits and misses from JAX's monitoring events.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import jax
from jax import monitoring

_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"


def default_compile_cache() -> Path:
    """``$XDG_CACHE_HOME/jaxpar/xla``, else ``~/.cache/jaxpar/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxpar" / "xla"


def enable_compile_cache(directory: str | Path | None = None) -> Path:
    """Turns JAX's persistent compilation cache on at ``directory`` for every program; call
    before the first compile. Default: the directory JAX is already configured with
    (``JAX_COMPILATION_CACHE_DIR``), else :func:`default_compile_cache`. Returns it."""
    configured = jax.config.jax_compilation_cache_dir
    if directory is not None:
        path = Path(directory)
    else:
        path = Path(configured) if configured else default_compile_cache()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


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
