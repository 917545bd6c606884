"""jaxpar: a sharding backend for decoder-only Transformer inference in JAX.

Five parallel primitives (DP, PP, SP, EP, TP), checked against declarative legality tables
before anything compiles, mapped to per-phase ``PartitionSpec``s; XLA inserts the
collectives.
"""

from jaxpar.errors import (
    CacheOverflowError,
    CheckpointError,
    ConfigError,
    IllegalStrategyError,
    JaxparError,
    MeshError,
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
    partition_spec,
    spec_table,
    validate,
)

__all__ = [
    "CacheOverflowError",
    "CheckpointError",
    "ConfigError",
    "Dims",
    "IllegalStrategyError",
    "JaxparError",
    "MeshError",
    "ModelDims",
    "Module",
    "ParallelConfig",
    "Phase",
    "Plan",
    "Primitive",
    "ShapeError",
    "SpecFileError",
    "Status",
    "logical_axis_rules",
    "make_mesh",
    "partition_spec",
    "spec_table",
    "validate",
]
