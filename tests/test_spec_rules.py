"""Logical axis -> mesh axis resolution for every (module, phase), each axis > 1 in turn."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.errors import IllegalStrategyError, JaxparError
from jaxpar.spec import (
    MESH_AXES,
    Dims,
    ParallelConfig,
    canonical_mesh,
    logical_axis_rules,
    make_mesh,
    mesh_axes,
    partition_spec,
)

MODULES = ["embedding", "attention", "ffn", "moe", "lm_head"]
LAYERED = {"attention", "ffn", "moe"}


# Written by hand from DESIGN.md §2 and the tables: what a degree-2 axis splits.
def expected(module: str, phase: str, axis: str) -> dict[str, tuple[str, ...]]:
    dims: set[str] = set()
    if axis == "dp":
        dims = {"batch"} | ({"expert_batch"} if module == "moe" else set())
        if module != "moe":
            dims.add("expert_batch")  # no axis holds experts, so token groups follow batch
    elif axis == "pp":
        dims = {"layers"} if module in LAYERED else set()
    elif axis == "sp":
        if phase == "prefill":
            dims = {"seq", "cache_seq"} if module == "attention" else {"seq"}
        else:
            dims = {"batch", "expert_batch"}  # decode: sp carries batch, never tokens
    elif axis == "ep":
        dims = {"batch", "experts"} if module == "moe" else {"batch", "expert_batch"}
    elif axis == "tp":
        dims = {
            "embedding": {"vocab"},
            "lm_head": {"vocab"},
            "attention": {"heads", "kv_heads"},
            "ffn": {"mlp"},
            "moe": {"mlp"},
        }[module]
    if module == "attention" and phase == "decode" and "batch" in dims:
        dims.add("pages")  # a paged KV cache's pool splits with its sequences ([[follows]])
    return {d: (axis,) for d in dims}


@pytest.mark.parametrize("axis", ["dp", "pp", "sp", "ep", "tp"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("module", MODULES)
def test_each_axis_in_turn(module, phase, axis):
    config = ParallelConfig(**{axis: 2})
    resolved = mesh_axes(module, phase, config)
    got = {name: axes for name, axes in resolved.items() if axes}
    assert got == expected(module, phase, axis)


def test_issue_example_prefill_vs_decode():
    config = ParallelConfig(dp=2, sp=2, tp=2)
    assert jaxpar.partition_spec(("batch", "seq", "embed"), "attention", "prefill", config) == P(
        "dp", "sp", None
    )
    decode = jaxpar.partition_spec(("batch", "seq", "embed"), "attention", "decode", config)
    assert decode == P(("dp", "sp"), None, None)
    assert "sp" not in str(decode[1])  # no token dimension is split in decode


def test_enums_and_names_are_interchangeable():
    config = ParallelConfig(dp=2, tp=4)
    a = partition_spec(("batch", "heads"), jaxpar.Module.ATTENTION, jaxpar.Phase.DECODE, config)
    b = partition_spec(("batch", "heads"), "attention", "decode", config)
    assert a == b == P("dp", "tp")


def test_combined_axes_order_and_kv_cache_layouts():
    config = ParallelConfig(dp=2, sp=2, ep=2)
    cache = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
    assert partition_spec(cache, "attention", "prefill", config) == P(
        None, ("dp", "ep"), "sp", None, None
    )
    assert partition_spec(cache, "attention", "decode", config) == P(
        None, ("dp", "sp", "ep"), None, None, None
    )


def test_moe_dispatch_layouts():
    config = ParallelConfig(dp=2, ep=4)
    assert partition_spec(("batch", None, None, "embed"), "moe", "decode", config) == P(
        ("dp", "ep"), None, None, None
    )
    assert partition_spec(("experts", "expert_batch", None, "mlp"), "moe", "decode", config) == P(
        "ep", "dp", None, None
    )


def test_kv_heads_policy_replicates_when_fewer_than_tp():
    config = ParallelConfig(tp=4)
    gqa = Dims(
        vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=8, d_ff=128
    )
    spec = partition_spec(
        ("batch", "cache_seq", "kv_heads", "head_dim"), "attention", "decode", config, dims=gqa
    )
    assert spec == P(None, None, None, None)
    assert partition_spec(
        ("embed", "heads", "head_dim"), "attention", "decode", config, dims=gqa
    ) == P(None, "tp", None)
    wide = Dims(
        vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=8, d_ff=128
    )
    assert partition_spec(("kv_heads",), "attention", "decode", config, dims=wide) == P("tp")


def test_flax_rules_form():
    rules = logical_axis_rules("attention", "decode", ParallelConfig(dp=2, sp=2, tp=2))
    as_dict = dict(rules)
    assert len(as_dict) == len(rules)  # each logical name once
    assert as_dict["batch"] == ("dp", "sp")
    assert as_dict["heads"] == "tp"
    assert as_dict["seq"] is None and as_dict["cache_seq"] is None


def test_unknown_logical_axis_and_double_use():
    with pytest.raises(JaxparError, match="unknown logical axis 'hiddn'"):
        partition_spec(("hiddn",), "ffn", "prefill", ParallelConfig())
    with pytest.raises(IllegalStrategyError, match="both map to mesh axis 'ep'"):
        partition_spec(("batch", "experts"), "moe", "prefill", ParallelConfig(ep=2))


@pytest.mark.jax_compat
def test_make_mesh():
    mesh = make_mesh(ParallelConfig(dp=2, sp=2, tp=2))
    # pp named first (a shard_map nested in the pipeline's adds only later axes) ...
    assert mesh.axis_names == ("pp", "dp", "sp", "ep", "tp")
    assert dict(mesh.shape) == {"dp": 2, "pp": 1, "sp": 2, "ep": 1, "tp": 2}
    # ... while the devices keep the dp, pp, sp, ep, tp layout (tp innermost).
    mesh = make_mesh(ParallelConfig(dp=2, pp=2, tp=2))
    laid_out = np.array(jax.devices()).reshape(2, 2, 1, 1, 2)
    assert (mesh.devices.transpose(1, 0, 2, 3, 4) == laid_out).all()
    assert canonical_mesh(Mesh(laid_out, MESH_AXES)).devices.tolist() == mesh.devices.tolist()
    sub = make_mesh(ParallelConfig(tp=2), devices=jax.devices()[:2])
    assert sub.devices.size == 2
    with pytest.raises(jaxpar.MeshError, match="needs 4 devices"):
        make_mesh(ParallelConfig(tp=4))


def test_parallel_config_parse_and_errors():
    assert ParallelConfig.parse("dp=2, tp=4") == ParallelConfig(dp=2, tp=4)
    assert str(ParallelConfig(dp=2, tp=4)) == "dp=2,tp=4"
    with pytest.raises(jaxpar.ConfigError, match="cannot parse"):
        ParallelConfig.parse("xp=2")
    with pytest.raises(jaxpar.ConfigError, match="int >= 1"):
        ParallelConfig(tp=0)
    with pytest.raises(jaxpar.ConfigError, match="pp=1"):
        ParallelConfig(microbatches=2)


@pytest.mark.server
def test_spec_layer_imports_without_flax():
    """People who bring their own model use the spec layer without jaxpar's models."""
    import subprocess
    import sys

    code = "import sys, jaxpar, jaxpar.spec; assert 'flax' not in sys.modules, 'flax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
