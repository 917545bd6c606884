"""Which attention kernel ``"auto"`` picks for a platform and dtype.

Plain policy, no kernel code: the execution options resolve their ``"auto"`` values with
it (:meth:`~jaxpar.models.ExecutionOptions.resolve`) and the attention paths with it
(:mod:`jaxpar.models._attention_ops`, :mod:`jaxpar.models._paged_attention`) pick a kernel
at trace time, so the choice is made in one place and the options need not import the
kernels to make it.
"""

from __future__ import annotations

import jax.numpy as jnp

#: The half-precision dtypes the fused kernels are picked for.
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def attention_impls(backend: str, dtype: jnp.dtype) -> tuple[str, str]:
    """The (prefill, decode) implementations ``impl="auto"`` picks.

    Fused kernels for half precision on GPU and TPU; XLA on CPU and for float32, where the
    XLA path is the exact reference (cuDNN flash attention takes only bf16/fp16, and the
    Pallas kernels' f32 dots may run at reduced precision: TF32 on GPU, bf16 passes on TPU).

    Args:
        backend: ``"cpu"``, ``"gpu"`` (or ``"cuda"``) or ``"tpu"``; anything else gets XLA.
        dtype: The dtype of q, k and v.
    """
    half = jnp.dtype(dtype) in HALF
    if backend in ("gpu", "cuda") and half:
        return "cudnn", "cudnn"
    if backend == "tpu" and half:
        return "pallas_tpu", "xla"
    return "xla", "xla"


def paged_attention_impl(backend: str, dtype) -> str:
    """The implementation ``impl="auto"`` picks for paged decode.

    The Pallas paged kernel of the backend for half precision (TPU: bf16 only, the kernel
    computes in bf16 and Mosaic takes no f16); XLA on CPU and for f32, the exact reference.

    Args:
        backend: ``"cpu"``, ``"gpu"`` (or ``"cuda"``) or ``"tpu"``; anything else gets XLA.
        dtype: The dtype of q and the pool.
    """
    dtype = jnp.dtype(dtype)
    if backend in ("gpu", "cuda") and dtype in HALF:
        return "pallas_gpu"
    if backend == "tpu" and dtype == jnp.dtype(jnp.bfloat16):
        return "pallas_tpu"
    return "xla"


#: Prompt length (padded tokens per sequence) from which ``sp_attention="auto"`` runs
#: ring attention rather than the K/V all-gather. Measured on 8 simulated CPU devices at
#: sp=8 (``scripts/bench_ring.py``, the docs' long-context page): the gather is 2x faster
#: at 256 tokens, the two about even at 512, the ring 2.8x faster at 1,024 and 6x at
#: 8,192 with a twelfth of the gather's temporaries.
RING_MIN_TOKENS = 1024


def sp_prefill_attention(choice: str, sp: int, tokens: int, min_tokens: int) -> str:
    """How prefill attention meets the keys of other token shards under ``sp``:
    ``"ring"`` (K/V blocks rotate, :mod:`jaxpar.models._ring_attention`) or ``"gather"``
    (K/V all-gathered). ``"auto"`` rings from ``min_tokens`` padded tokens; either way the
    ring needs ``sp > 1`` and the tokens in ``2 sp`` equal half-chunks, else it gathers.

    Args:
        choice: The run's ``sp_attention`` option: ``"auto"``, ``"gather"`` or ``"ring"``.
        sp: The degree that splits the prompt's tokens.
        tokens: Padded tokens per sequence of the prefill step.
        min_tokens: The run's ``ring_min_tokens``.
    """
    if choice == "gather" or sp < 2 or tokens % (2 * sp):
        return "gather"
    if choice == "ring" or tokens >= min_tokens:
        return "ring"
    return "gather"
