"""The coordination service's key-value store, as the engine's processes share it.

Every process of a ``jax.distributed`` job is connected to one coordination service
(process 0 hosts it). Its key-value store carries what the processes agree on outside
any device program: the least free device memory, so that each sizes the same KV cache
(:func:`agree_min`), and the lockstep record of commands (:mod:`jaxpar.engine._lockstep`).
"""

from __future__ import annotations

import jax

from jaxpar.errors import DistributedError


def coordination_client():
    """The coordination service's client of this process (``jax.distributed``).

    Raises:
        DistributedError: ``jax.distributed`` is not initialised.
    """
    from jax._src import distributed  # the runtime's client: no public accessor

    service = distributed.global_state.client
    if service is None:
        raise DistributedError(
            "serving from several processes needs jax.distributed initialised first "
            "(jaxpar --coordinator ... --num-processes ... --process-id ...)"
        )
    return service


def agree_min(name: str, value: int) -> int:
    """The smallest of every process's ``value`` (each process calls this once per
    ``name``, in the same order): e.g. free device memory, which each process can only
    read from its own devices, so that every process sizes the same KV cache."""
    global _agreements
    _agreements += 1
    service, n = coordination_client(), jax.process_count()
    key = f"jaxpar/agree/{_agreements}-{name}"
    service.key_value_set(f"{key}/{jax.process_index()}", str(int(value)))
    return min(int(service.blocking_key_value_get(f"{key}/{pid}", 300_000)) for pid in range(n))


_agreements = 0
