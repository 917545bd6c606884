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
