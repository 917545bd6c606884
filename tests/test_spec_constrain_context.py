"""``constrain`` outside a ``sharding_context`` says that it does nothing (issue 11, item 8)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar.errors import ConfigError
from jaxpar.spec import constrain, sharding_context

AXES = ("batch", "seq", "embed")


def test_outside_a_context_it_warns_and_returns_x():
    x = jnp.ones((8, 4, 16))
    with pytest.warns(UserWarning, match="outside a sharding_context does nothing"):
        y = constrain(x, AXES, "attention")
    assert y is x


def test_required_raises_and_not_required_is_silent():
    x = jnp.ones((8, 4, 16))
    with pytest.raises(ConfigError, match="sharding_context"):
        constrain(x, AXES, "attention", required=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert constrain(x, AXES, "attention", required=False) is x


def test_inside_a_context_it_constrains():
    cfg = jaxpar.ParallelConfig(dp=2, tp=4)
    mesh = jaxpar.make_mesh(cfg)

    @jax.jit
    def f(x):
        with sharding_context(mesh, "prefill", cfg):
            return constrain(x * 2, AXES, "attention", required=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = f(jnp.ones((8, 4, 16)))
    want = jaxpar.partition_spec(AXES, "attention", "prefill", cfg)
    assert want[0] == "dp"
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, want), y.ndim)


def test_jaxpars_own_models_stay_silent_on_one_device():
    from jaxpar.models import init_model

    model = init_model(jaxpar.preset("tiny-dense"), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.prefill(jnp.ones((1, 8), jnp.int32), jnp.array([8], jnp.int32))


@pytest.mark.jax_compat
def test_a_shard_map_nested_against_the_mesh_order_is_refused_where_xla_aborts():
    """jax >= 0.11.2 aborts the process (an XLA CHECK) on a shard_map manual over ``dp``
    nested in one manual over ``pp`` when the mesh names ``dp`` first; jaxpar refuses it
    with an error before tracing instead. Older releases run it."""
    from jax.sharding import PartitionSpec

    from jaxpar.spec import MESH_AXES, logical_shard_map
    from jaxpar.spec._constrain import _SORTED_MANUAL_AXES, _jax_version

    cfg = jaxpar.ParallelConfig(dp=2, pp=2, tp=2)
    assert MESH_AXES.index("dp") < MESH_AXES.index("pp")
    mesh = jax.make_mesh(cfg.shape, MESH_AXES, devices=jax.devices()[: cfg.size])

    def stage(x):
        with sharding_context(jax.sharding.get_abstract_mesh(), "prefill", cfg):
            double = logical_shard_map(lambda y: 2 * y, [AXES], AXES, "attention")
            return double(x[0])[None]

    def traced(on):
        staged = PartitionSpec("pp")
        run = jax.jit(
            jax.shard_map(stage, mesh=on, in_specs=staged, out_specs=staged, axis_names={"pp"})
        )
        sharding = jax.sharding.NamedSharding(on, staged)
        return run.trace(jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32, sharding=sharding))

    if _jax_version() >= _SORTED_MANUAL_AXES:
        with pytest.raises(ConfigError, match=r"\['dp'\] would become manual inside"):
            traced(mesh)
    else:
        traced(mesh)
    # The mesh jaxpar builds names pp first: the same nesting traces on every release.
    traced(jaxpar.make_mesh(cfg, devices=jax.devices()[: cfg.size]))
