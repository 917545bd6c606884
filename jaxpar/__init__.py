"""jaxpar: a sharding backend for decoder-only Transformer inference in JAX.

Five parallel primitives (DP, PP, SP, EP, TP), checked against declarative legality tables
before anything compiles, mapped to per-phase ``PartitionSpec``s; XLA inserts the
collectives.

The spec layer (``partition_spec``, ``logical_axis_rules``, ``validate``, ...) needs only
JAX; models, engine and inspection load on first use, so ``import jaxpar.spec`` stays
light for people who bring their own Flax model.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxpar.errors import (
    CacheOverflowError,
    CheckpointError,
    ConfigError,
    DistributedError,
    GrammarError,
    IllegalStrategyError,
    InfeasiblePlanError,
    JaxparError,
    MeshError,
    PeerLostError,
    QueueFullError,
    ShapeError,
    SpecFileError,
)
from jaxpar.spec import (
    Dims,
    ModelDims,
    Module,
    ParallelConfig,
    Phase,
    Plan,
    Primitive,
    Status,
    logical_axis_rules,
    make_mesh,
    param_partition_spec,
    partition_spec,
    spec_table,
    validate,
)

_LAZY = {
    "ModelConfig": "jaxpar.models",
    "ExecutionOptions": "jaxpar.models",
    "ModelRun": "jaxpar.models",
    "KVCache": "jaxpar.models",
    "preset": "jaxpar.models",
    "init_params": "jaxpar.models",
    "load_hf_checkpoint": "jaxpar.models",
    "quantize_params": "jaxpar.models",
    "AbstractEngine": "jaxpar.engine",
    "InferenceEngine": "jaxpar.engine",
    "Generation": "jaxpar.engine",
    "ContinuousBatcher": "jaxpar.engine",
    "KVBudget": "jaxpar.engine",
    "Tokenizer": "jaxpar.engine",
    "RequestStream": "jaxpar.engine",
    "Sampling": "jaxpar.engine",
    "Constraint": "jaxpar.engine",
    "Grammars": "jaxpar.engine",
    "SpeculativeConfig": "jaxpar.engine",
    "engine_from_hf": "jaxpar.engine",
    "initialize_distributed": "jaxpar.engine",
    "parse_collectives": "jaxpar.inspect",
    "summarize": "jaxpar.inspect",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")


__all__ = [
    "AbstractEngine",
    "CacheOverflowError",
    "CheckpointError",
    "ConfigError",
    "Dims",
    "DistributedError",
    "GrammarError",
    "IllegalStrategyError",
    "InfeasiblePlanError",
    "JaxparError",
    "MeshError",
    "ModelDims",
    "Module",
    "ParallelConfig",
    "PeerLostError",
    "QueueFullError",
    "Phase",
    "Plan",
    "Primitive",
    "ShapeError",
    "SpecFileError",
    "Status",
    "logical_axis_rules",
    "make_mesh",
    "param_partition_spec",
    "partition_spec",
    "spec_table",
    "validate",
    *_LAZY,
]
