"""The engine: mesh placement, jit-compiled prefill and decode, KV-cache handoff, generate,
and continuous batching over a paged KV cache (``ContinuousBatcher``, sized by ``KVBudget``).

``pipeline`` is the pipeline schedule's module (its stage-local steps, one by one).
"""

from jaxpar.engine import _pipeline as pipeline
from jaxpar.engine._abstract import AbstractEngine, run_form
from jaxpar.engine._batching import BatcherStats, ContinuousBatcher
from jaxpar.engine._distributed import ProcessInfo, peer_failures
from jaxpar.engine._distributed import initialize as initialize_distributed
from jaxpar.engine._engine import Generation, InferenceEngine
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.engine._layouts import Layouts
from jaxpar.engine._load import engine_from_hf
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._placement import put_global, to_host
from jaxpar.engine._requests import FINISH_REASONS, Request, RequestStream
from jaxpar.engine._sampling import RowSampling, Sampling
from jaxpar.engine._slots import Slots, SlotSteps
from jaxpar.engine._steps import Steps

__all__ = [
    "FINISH_REASONS",
    "AbstractEngine",
    "BatcherStats",
    "ContinuousBatcher",
    "Generation",
    "InferenceEngine",
    "KVBudget",
    "Layouts",
    "PagePool",
    "PageTable",
    "ProcessInfo",
    "Request",
    "RequestStream",
    "RowSampling",
    "Sampling",
    "SlotSteps",
    "Slots",
    "Steps",
    "engine_from_hf",
    "initialize_distributed",
    "peer_failures",
    "pipeline",
    "put_global",
    "run_form",
    "to_host",
]
