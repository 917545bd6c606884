"""The engine: mesh placement, jit-compiled prefill and decode, KV-cache handoff, generate."""

from jaxpar.engine._engine import Generation, InferenceEngine
from jaxpar.engine._sampling import Sampling

__all__ = ["Generation", "InferenceEngine", "Sampling"]
