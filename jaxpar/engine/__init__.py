"""The engine: mesh placement, jit-compiled prefill and decode, KV-cache handoff, generate."""

from jaxpar.engine._distributed import ProcessInfo, peer_failures
from jaxpar.engine._distributed import initialize as initialize_distributed
from jaxpar.engine._engine import Generation, InferenceEngine
from jaxpar.engine._load import engine_from_hf
from jaxpar.engine._placement import to_host
from jaxpar.engine._sampling import Sampling

__all__ = [
    "Generation",
    "InferenceEngine",
    "ProcessInfo",
    "Sampling",
    "engine_from_hf",
    "initialize_distributed",
    "peer_failures",
    "to_host",
]
