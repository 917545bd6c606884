"""``jaxpar.spec.shard_tree`` / ``tree_shardings``: whole pytrees placed by logical names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.spec import param_partition_spec, partition_spec, shard_tree, tree_shardings

CFG = jaxpar.ParallelConfig(dp=2, sp=2, tp=2)
DIMS = jaxpar.Dims(
    vocab_size=256, d_model=64, n_layers=1, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=256
)
PARAM_AXES = {
    "embed": {"table_VD": ("vocab", "embed")},
    "layers": [
        {"wq_DNH": P("embed", "heads", "head_dim"), "w_in_DF": ("embed", "mlp")},
        {"wkv_DKH": ("embed", "kv_heads", "head_dim"), "norm_D": (None,)},
    ],
}
CACHE_AXES = {"k_BSKH": ("batch", "cache_seq", "kv_heads", "head_dim")}


def _params():
    shapes = {
        "embed": {"table_VD": (256, 64)},
        "layers": [
            {"wq_DNH": (64, 8, 8), "w_in_DF": (64, 256)},
            {"wkv_DKH": (64, 4, 8), "norm_D": (64,)},
        ],
    }
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    arrays = [jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) for s in leaves]
    return jax.tree.unflatten(treedef, arrays)


def test_parameters_get_their_one_layout_and_keep_their_values():
    mesh = jaxpar.make_mesh(CFG)
    params = _params()
    placed = shard_tree(params, PARAM_AXES, mesh, CFG, dims=DIMS)
    flat_axes = jax.tree.leaves(PARAM_AXES, is_leaf=lambda x: isinstance(x, (tuple, P)))
    for axes, before, after in zip(
        flat_axes, jax.tree.leaves(params), jax.tree.leaves(placed), strict=True
    ):
        assert after.sharding.mesh == mesh
        assert after.sharding.spec == param_partition_spec(tuple(axes), CFG, dims=DIMS)
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    # Each device holds its slice only: the MLP's columns split over tp=2.
    w_in = placed["layers"][0]["w_in_DF"]
    assert w_in.sharding.spec == P(None, "tp")
    assert {shard.data.shape for shard in w_in.addressable_shards} == {(64, 128)}


def test_a_cache_tree_differs_between_the_phases():
    mesh = jaxpar.make_mesh(CFG)
    cache = {"k_BSKH": jnp.zeros((8, 16, 4, 8))}
    specs = {}
    for phase in ("prefill", "decode"):
        placed = shard_tree(
            cache, CACHE_AXES, mesh, CFG, phase=phase, module="attention", dims=DIMS
        )
        specs[phase] = placed["k_BSKH"].sharding.spec
        expected = partition_spec(CACHE_AXES["k_BSKH"], "attention", phase, CFG, dims=DIMS)
        assert specs[phase] == expected
    # Prefill splits the cached sequence over sp; decode never does (sp carries batch).
    assert specs["prefill"][1] == "sp"
    assert specs["decode"][1] is None and "sp" in specs["decode"][0]


def test_tree_shardings_serve_as_jit_out_shardings():
    mesh = jaxpar.make_mesh(CFG)
    shardings = tree_shardings(PARAM_AXES, mesh, CFG, dims=DIMS)
    init = jax.jit(_params, out_shardings=shardings)
    out = init()
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(shardings), strict=True):
        assert got.sharding == want


def test_bad_input_is_refused_naming_what_and_where():
    mesh = jaxpar.make_mesh(CFG)
    with pytest.raises(ConfigError, match="give both"):
        tree_shardings(CACHE_AXES, mesh, CFG, phase="decode")
    with pytest.raises(ConfigError, match=r"\['w'\].*tuple of logical axis names"):
        tree_shardings({"w": "embed"}, mesh, CFG)
    with pytest.raises(ConfigError, match="one name per dimension"):
        tree_shardings({"w": P(("embed", "mlp"))}, mesh, CFG)
    with pytest.raises(ConfigError, match="differ in structure"):
        shard_tree({"a": jnp.ones(4)}, {"b": ("embed",)}, mesh, CFG)
    with pytest.raises(ConfigError, match="pass dims="):
        tree_shardings(CACHE_AXES, mesh, CFG, phase="decode", module="attention")
    with pytest.raises(JaxparError, match="unknown parameter logical axis 'rows'"):
        tree_shardings({"w": ("rows",)}, mesh, CFG)
