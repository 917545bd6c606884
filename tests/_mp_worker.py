"""One process of the multi-process tests (launched by ``tests/test_multiprocess.py``).

Usage: ``python tests/_mp_worker.py MODE PROCESS_ID NUM_PROCESSES PORT``

* ``generate``: runs every strategy in ``STRATEGIES`` and prints one ``RESULT {json}`` line
  with the tokens per strategy;
* ``dead-during``: every process generates once (compiled, gloo connected); then process 1
  dies with ``os._exit`` and process 0, generating again, must end with a clear error;
* ``dead-before``: process 1 dies right after joining; process 0 builds an engine and
  generates, and must end with a clear error;
* ``no-coordinator``: a process > 0 whose coordinator never answers gets
  ``DistributedError`` (printed; exit status 3).

The environment (``JAX_PLATFORMS=cpu``, ``XLA_FLAGS`` with 4 host devices) comes from the
test. Importing this module has no side effects: the test takes ``PROMPTS`` and
``STRATEGIES`` from it for its single-process reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING

from tests._prompts import MAX_BATCH, MAX_SEQ_LEN, NEW_TOKENS, PROMPTS  # noqa: F401

if TYPE_CHECKING:
    from jaxpar.engine import InferenceEngine

# Strategies whose mesh crosses the process boundary on a non-trivial axis: with 4 devices
# per process, the outermost axis of size > 1 is split between the processes.
STRATEGIES: dict[str, tuple[str, str]] = {
    "dense-sp2-tp4": ("tiny-dense", "sp=2,tp=4"),  # sequence-parallel prefill across hosts
    "moe-ep4-tp2": ("tiny-moe", "ep=4,tp=2"),  # experts split across hosts
}
STREAMED = "dense-sp2-tp4"  # also generated with a streaming callback
DEATH_EXIT_STATUS = 17  # the dying process's status, to tell it from a crash


def build(name: str, strategy: str) -> InferenceEngine:
    """An engine for preset ``name`` over all global devices (1 or many processes)."""
    from jaxpar.engine import InferenceEngine
    from jaxpar.models._config import preset
    from jaxpar.models._decoder import init_params
    from jaxpar.spec import ParallelConfig

    config = preset(name)
    params = init_params(config, seed=0)  # deterministic: every process builds the same
    return InferenceEngine(
        config, params, ParallelConfig.parse(strategy), max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN
    )


def tokens_for(name: str, strategy: str) -> list[list[int]]:
    """16 greedy tokens for ``PROMPTS`` (identical on every process)."""
    return build(name, strategy).generate(PROMPTS, NEW_TOKENS).tokens


def _log(message: str) -> None:
    print(f"{message} t={time.time():.3f}", flush=True)


def _die() -> None:
    """Leaves abruptly, like a crashed host: no exception, no atexit, no shutdown."""
    _log("DYING")
    os._exit(DEATH_EXIT_STATUS)


def _no_coordinator(process_id: int, num_processes: int, port: str) -> int:
    """Nobody listens on the port: a clear error, no abort."""
    from jaxpar.engine._distributed import DistributedError, initialize

    try:
        initialize(f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout_s=3)
    except DistributedError as e:
        print(f"DistributedError: {e}", flush=True)
        return 3
    return 0


def _compile_cache(process_id: int, num_processes: int, port: str) -> int:
    """The CLI's order (the compile cache, then the initialize), then one program over
    both processes' devices (an all-reduce); prints the cache directory, hits, misses."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxpar.engine import CompileCount, enable_compile_cache
    from jaxpar.engine._distributed import initialize, peer_failures

    enable_compile_cache(os.environ["JAXPAR_TEST_CACHE"])
    initialize(f"127.0.0.1:{port}", num_processes, process_id)
    count = CompileCount().start()
    mesh = jax.make_mesh((jax.device_count(),), ("tp",), devices=jax.devices())
    rows = NamedSharding(mesh, PartitionSpec("tp"))
    x = jax.make_array_from_callback((8, 4), rows, lambda i: np.ones((8, 4), np.float32)[i])
    with peer_failures():
        jax.block_until_ready(jax.jit(lambda a: a + a.sum(), out_shardings=rows)(x))
    print(f"CACHE {jax.config.jax_compilation_cache_dir} {count.hits} {count.misses}")
    return 0


def main(argv: list[str]) -> int:
    """Runs one ``MODE``; jaxpar is imported only here, after the test set the environment."""
    mode, process_id, num_processes, port = argv[0], int(argv[1]), int(argv[2]), argv[3]
    from jaxpar.engine._distributed import initialize, peer_failures

    own_start = {"no-coordinator": _no_coordinator, "compile-cache": _compile_cache}
    if mode in own_start:
        return own_start[mode](process_id, num_processes, port)
    info = initialize(f"127.0.0.1:{port}", num_processes, process_id)
    _log(f"INIT {info}")
    if mode == "generate":
        result = {}
        with peer_failures():
            for key, (name, strategy) in STRATEGIES.items():
                engine = build(name, strategy)
                result[key] = engine.generate(PROMPTS, NEW_TOKENS).tokens
                if key == STREAMED:  # one token per dispatch, read on the host each step
                    streamed = engine.generate(
                        PROMPTS, NEW_TOKENS, callback=lambda step, tokens: None
                    )
                    result[key + "+streamed"] = streamed.tokens
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if mode == "dead-before":  # process 1 dies before any collective ran
        if process_id == 1:
            _die()
        with peer_failures():
            build("tiny-dense", "tp=8").generate(PROMPTS, NEW_TOKENS)
        _log("UNEXPECTED: generated without the peer")
        return 0
    if mode == "dead-during":  # process 1 dies after a first generate; 0 generates again
        with peer_failures():
            engine = build("tiny-dense", "tp=8")  # every layer all-reduces across processes
            engine.generate(PROMPTS, NEW_TOKENS)
        _log("WARM")
        if process_id == 1:
            # Let the survivor finish reading its tokens first: dying at once can reset the
            # connection under the tail of its last collective (a lost peer too, but not
            # the case this mode is for). It is then waiting in its next prefill.
            time.sleep(2)
            _die()
        with peer_failures():
            engine.generate(PROMPTS, NEW_TOKENS)
        _log("UNEXPECTED: generated without the peer")
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    # Run as a script: make the repository importable even without the editable install.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
