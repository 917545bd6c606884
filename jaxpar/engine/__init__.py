"""The engine: mesh placement, jit-compiled prefill and decode, KV-cache handoff, generate.

``pipeline`` is the pipeline schedule's module (its stage-local steps, one by one).
"""

from jaxpar.engine import _pipeline as pipeline
from jaxpar.engine._abstract import AbstractEngine, run_form
from jaxpar.engine._distributed import ProcessInfo, peer_failures
from jaxpar.engine._distributed import initialize as initialize_distributed
from jaxpar.engine._engine import Generation, InferenceEngine
from jaxpar.engine._layouts import Layouts
from jaxpar.engine._load import engine_from_hf
from jaxpar.engine._placement import put_global, to_host
from jaxpar.engine._sampling import Sampling
from jaxpar.engine._steps import Steps

__all__ = [
    "AbstractEngine",
    "Generation",
    "InferenceEngine",
    "Layouts",
    "ProcessInfo",
    "Sampling",
    "Steps",
    "engine_from_hf",
    "initialize_distributed",
    "peer_failures",
    "pipeline",
    "put_global",
    "run_form",
    "to_host",
]
