"""The spec layer: legality tables, validation, logical-axis rules, mesh.

Importable on its own (it needs JAX, not Flax) by people who bring their own model.
"""

from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._constrain import (
    active_degree,
    active_mesh,
    active_mesh_axes,
    active_phase,
    active_platform,
    constrain,
    logical_shard_map,
    sharding_context,
)
from jaxpar.spec._dims import Dims, ModelDims, model_field
from jaxpar.spec._enums import LOGICAL_AXES, MESH_AXES, Module, Phase, Primitive, Status
from jaxpar.spec._kv_heads import kv_head_replicas
from jaxpar.spec._mesh import MESH_NAME_ORDER, canonical_mesh, default_mesh, make_mesh
from jaxpar.spec._rules import (
    logical_axis_rules,
    mesh_axes,
    param_partition_spec,
    partition_spec,
)
from jaxpar.spec._tables import Entry, Role, Rule, SpecTable, load_spec_table, spec_table
from jaxpar.spec._topology import (
    AxisLayout,
    array_layout,
    dcn_shape,
    describe_layout,
    layout_text,
    mesh_layout,
    slice_devices,
    slice_layout,
    slice_order,
    tpu_device_array,
)
from jaxpar.spec._tree import shard_tree, tree_shardings
from jaxpar.spec._validate import (
    Assignment,
    Plan,
    Violation,
    batch_multiple,
    modules_of,
    validate,
)

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "MESH_NAME_ORDER",
    "Assignment",
    "AxisLayout",
    "array_layout",
    "Dims",
    "model_field",
    "Entry",
    "ModelDims",
    "Module",
    "ParallelConfig",
    "Phase",
    "Plan",
    "Primitive",
    "Role",
    "Rule",
    "SpecTable",
    "Status",
    "Violation",
    "active_degree",
    "active_mesh",
    "active_mesh_axes",
    "active_phase",
    "active_platform",
    "batch_multiple",
    "canonical_mesh",
    "constrain",
    "kv_head_replicas",
    "load_spec_table",
    "logical_shard_map",
    "logical_axis_rules",
    "dcn_shape",
    "default_mesh",
    "describe_layout",
    "layout_text",
    "make_mesh",
    "mesh_axes",
    "mesh_layout",
    "modules_of",
    "param_partition_spec",
    "partition_spec",
    "shard_tree",
    "sharding_context",
    "slice_devices",
    "slice_layout",
    "slice_order",
    "spec_table",
    "tpu_device_array",
    "tree_shardings",
    "validate",
]
