"""The pipeline schedule's pieces, one by one (``jaxpar.engine.pipeline``).

``stage_slot`` is the fill / steady state / drain arithmetic, ``last_position`` the
prefill's last-token select, and ``run_schedule`` the loop of ``pipeline_iteration`` s;
here the loop runs stage steps that only count, so what each stage saw shows directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.engine import pipeline
from jaxpar.models import preset
from jaxpar.spec import ParallelConfig, Phase, make_mesh, sharding_context


@pytest.mark.parametrize(("stages", "count"), [(2, 1), (2, 3), (4, 2), (4, 6)])
def test_stage_slot_is_the_gpipe_schedule(stages, count):
    grid = pipeline.schedule(stages, count)
    for i, row in enumerate(grid):
        for s, microbatch in enumerate(row):
            read, write = pipeline.stage_slot(jnp.int32(i), jnp.int32(s), count)
            if microbatch is None:  # fill or drain: the write is dropped
                assert int(write) == count
            else:
                assert int(write) == microbatch == int(read)
            assert 0 <= int(read) < count


def test_last_position_picks_each_rows_last_prompt_token():
    x_BTD = jnp.arange(3 * 5 * 2, dtype=jnp.float32).reshape(3, 5, 2)
    lengths_B = jnp.array([1, 5, 3])
    got = pipeline.last_position(x_BTD, lengths_B)
    np.testing.assert_array_equal(got, x_BTD[jnp.arange(3), lengths_B - 1])


def _count_step(s, state, x, x_emb_M, k_M, v_M, *, i):
    """Stage-local step that adds 1 to what it holds and records it in its slot."""
    count = x_emb_M.shape[0]
    read, write = pipeline.stage_slot(i, s, count)
    x = jnp.where(s == 0, x_emb_M[jnp.minimum(i, count - 1)], x) + 1 + 0 * state
    return x, k_M.at[write].set(x, mode="drop"), v_M.at[write].set(read, mode="drop")


def _count_head(s, x, out_M, *, i):
    _, write = pipeline.stage_slot(i, s, out_M.shape[0])
    return out_M.at[write].set(x, mode="drop")


@pytest.mark.parametrize(("pp", "count"), [(2, 3), (4, 2)])
def test_run_schedule_passes_every_microbatch_through_every_stage(pp, count):
    config = ParallelConfig(pp=pp, dp=8 // pp)
    mesh = make_mesh(config, jax.devices()[: config.size])
    stages = pipeline.Stages(mesh, config, preset("tiny-dense"))
    inputs_M = 10.0 * jnp.arange(count)

    @jax.jit
    def run():
        with sharding_context(mesh, Phase.PREFILL, config, stages.dims):
            zeros_PM = jnp.zeros((pp, count))
            init = (jnp.zeros((pp,)), zeros_PM, zeros_PM, zeros_PM)
            return pipeline.run_schedule(
                stages,
                count,
                init,
                state_P=jnp.zeros((pp,)),
                x_emb=jnp.broadcast_to(inputs_M, (pp, count)),
                stage_step=_count_step,
                head=_count_head,
            )

    _, seen_PM, read_PM, out_PM = run()
    # Stage s saw microbatch m after s + 1 additions, and read its own slot m.
    want_PM = inputs_M[None, :] + 1 + jnp.arange(pp)[:, None]
    np.testing.assert_array_equal(seen_PM, want_PM)
    np.testing.assert_array_equal(read_PM, np.broadcast_to(np.arange(count), (pp, count)))
    # The last stage's head wrote each finished microbatch once.
    np.testing.assert_array_equal(out_PM[pp - 1], inputs_M + pp)
