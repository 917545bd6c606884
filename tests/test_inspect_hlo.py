"""Collectives read back from real compiled XLA programs on 8 simulated CPU devices.

Every program here is compiled for real; byte counts are recomputed independently
from the per-device shapes the test itself chooses. Async GPU forms, which XLA:CPU
never emits, are checked on a hand-written snippet that follows the grammar of GPU
HLO text (see ``GPU_ASYNC_HLO``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.inspect import (
    Collective,
    collective_axes,
    module_of,
    parse_collectives,
    summarize,
)

# Version-sensitive (scripts/test.sh runs jax_compat tests on both JAX releases).
pytestmark = pytest.mark.jax_compat

AXES = ("dp", "pp", "sp", "ep", "tp")
F32 = 4


def make_mesh(shape: tuple[int, ...], devices: list | None = None) -> Mesh:
    """A 5-axis mesh; ``devices`` reorders the physical devices."""
    if devices is None:
        return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5)
    return Mesh(np.array(devices).reshape(shape), AXES)


MESH = make_mesh((2, 1, 1, 2, 2))


def compiled(fn, mesh: Mesh, in_specs, out_specs, *args) -> list[Collective]:
    """Collectives of ``shard_map(fn)`` compiled for ``mesh``."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return parse_collectives(jax.jit(mapped).lower(*args).compile())


def only(collectives: list[Collective]) -> Collective:
    assert len(collectives) == 1, collectives
    return collectives[0]


def test_psum_over_one_axis_in_attention_scope():
    def fn(x):
        with jax.named_scope("attention"):
            return lax.psum(x, "tp")

    c = only(compiled(fn, MESH, P("dp", "tp"), P("dp"), jnp.ones((8, 16))))
    assert (c.kind, c.shapes, c.dtypes) == ("all-reduce", ((4, 8),), ("f32",))
    assert c.bytes == 4 * 8 * F32
    # Parsed groups, not their printed form: jax 0.10.2 prints them explicitly, 0.12 in the
    # mesh-axes form.
    assert c.replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert collective_axes(c, MESH) == ("tp",)
    assert module_of(c.op_name) == "attention" and "attention" in c.op_name
    assert (c.channel_id, c.use_global_device_ids, c.is_async) == (1, True, False)
    assert (c.in_loop, c.trip_count) == (False, 1)


def test_collectives_in_a_conditional_branch_say_so():
    """A collective inside ``lax.cond`` runs only when its branch is taken (the sampling
    filters' gathers, which greedy steps skip): marked ``in_branch``; one outside is not."""

    def fn(x, flag):
        always = lax.psum(x, "tp")
        sometimes = lax.cond(
            flag[0] > 0, lambda v: lax.all_gather(v, "tp", tiled=True)[:4], lambda v: v, x
        )
        return always + sometimes

    found = compiled(fn, MESH, (P("tp"), P()), P(), jnp.ones((8,)), jnp.ones((1,), jnp.int32))
    by_kind = {c.kind: c for c in found}
    assert set(by_kind) == {"all-reduce", "all-gather"}, found
    assert not by_kind["all-reduce"].in_branch and by_kind["all-gather"].in_branch


def test_all_gather_counts_the_gathered_output():
    c = only(
        compiled(
            lambda x: lax.all_gather(x, "ep", axis=0, tiled=True),
            MESH,
            P("ep"),
            P(),
            jnp.ones((8, 16)),
        )
    )
    assert (c.kind, c.shapes) == ("all-gather", ((8, 16),))
    assert c.bytes == 8 * 16 * F32
    assert collective_axes(c, MESH) == ("ep",)


def test_reduce_scatter_counts_the_input():
    fn = lambda x: lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True)  # noqa: E731
    c = only(compiled(fn, MESH, P(None, "tp"), P("tp"), jnp.ones((8, 16))))
    assert (c.kind, c.shapes) == ("reduce-scatter", ((4, 8),))
    assert c.bytes == 8 * 8 * F32  # the (8, 8) local input, not the (4, 8) result
    assert collective_axes(c, MESH) == ("tp",)


def test_all_to_all_is_a_tuple_on_cpu():
    c = only(
        compiled(
            lambda x: lax.all_to_all(x, "ep", 0, 1, tiled=True),
            MESH,
            P("ep"),
            P(None, "ep"),
            jnp.ones((8, 16)),
        )
    )
    # XLA:CPU splits the local (4, 16) block into one tuple element per peer.
    assert (c.kind, c.shapes) == ("all-to-all", ((2, 16), (2, 16)))
    assert c.bytes == 4 * 16 * F32
    assert collective_axes(c, MESH) == ("ep",)


def test_collective_permute_along_pipeline_axis():
    mesh = make_mesh((1, 4, 1, 1, 2))
    perm = [(i, (i + 1) % 4) for i in range(4)]
    c = only(
        compiled(lambda x: lax.ppermute(x, "pp", perm), mesh, P("pp"), P("pp"), jnp.ones((8, 8)))
    )
    assert (c.kind, c.bytes, c.replica_groups) == ("collective-permute", 2 * 8 * F32, None)
    assert set(c.source_target_pairs) == {(2 * s + t, 2 * d + t) for s, d in perm for t in (0, 1)}
    assert collective_axes(c, mesh) == ("pp",)


def test_pre_optimisation_text_holds_only_explicit_collectives():
    mapped = jax.shard_map(lambda x: lax.psum(x, "tp"), mesh=MESH, in_specs=P("tp"), out_specs=P())
    c = only(parse_collectives(jax.jit(mapped).lower(jnp.ones((8, 4))).as_text(dialect="hlo")))
    assert (c.kind, c.bytes, collective_axes(c, MESH)) == ("all-reduce", 4 * 4 * F32, ("tp",))
    resharded = jax.jit(lambda x: 2 * x, in_shardings=NamedSharding(MESH, P("tp")))
    assert parse_collectives(resharded.lower(jnp.ones((8, 4))).as_text(dialect="hlo")) == []


def test_xla_cpu_combines_same_type_psums_into_one_tuple_all_reduce():
    fn = lambda x, y: (lax.psum(x, "tp"), lax.psum(2 * y, "tp"))  # noqa: E731
    c = only(
        compiled(fn, MESH, (P("tp"), P("tp")), (P(), P()), jnp.ones((8, 16)), jnp.ones((4, 16)))
    )
    assert (c.kind, c.shapes, c.dtypes) == ("all-reduce", ((4, 16), (2, 16)), ("f32", "f32"))
    assert c.bytes == (4 * 16 + 2 * 16) * F32


def test_psum_of_int_and_float_stays_two_all_reduces():
    fn = lambda x, y: (lax.psum(x, "tp"), lax.psum(y, "tp"))  # noqa: E731
    found = compiled(
        fn, MESH, (P("tp"), P("tp")), (P(), P()), jnp.ones((8,)), jnp.ones((4,), jnp.int32)
    )
    assert sorted(c.dtypes for c in found) == [("f32",), ("s32",)]


@pytest.mark.parametrize("axes", [("dp", "tp"), ("tp", "dp"), ("dp", "ep")])
def test_groups_over_two_of_three_axes(axes):
    c = only(
        compiled(
            lambda x: lax.all_gather(x, axes, tiled=True), MESH, P(axes), P(), jnp.ones((8, 4))
        )
    )
    assert c.bytes == 8 * 4 * F32
    # The order of ids inside a group follows the order of the gathered axes.
    assert collective_axes(c, MESH) == axes


def test_device_ids_are_positions_in_the_mesh_not_device_ids():
    order = [3, 6, 0, 5, 7, 1, 2, 4]
    mesh = make_mesh((2, 1, 1, 2, 2), [jax.devices()[i] for i in order])
    spec = P(("dp", "ep", "tp"))
    mapped = jax.jit(
        jax.shard_map(
            lambda x: lax.psum(x, "ep"), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
        )
    )
    x = 2.0 ** jnp.arange(8)  # shard p of x holds 2**p: every sum names its group
    c = only(parse_collectives(mapped.lower(x).compile()))
    identity = only(compiled(lambda x: lax.psum(x, "ep"), MESH, spec, spec, x))
    assert c.replica_groups == identity.replica_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert collective_axes(c, mesh) == ("ep",)
    expected = np.zeros(8)
    for group in c.replica_groups:
        expected[list(group)] = sum(2.0**p for p in group)
    np.testing.assert_array_equal(np.asarray(mapped(x)), expected)


def test_scan_over_layers_marks_loop_and_trip_count():
    def layer(h, w):
        with jax.named_scope("ffn"):
            return lax.psum(h @ w, "tp"), None

    def outer(h, ws):
        h, _ = lax.scan(layer, h, ws)
        return lax.psum(h, "ep"), None

    def fn(h, ws):
        return lax.scan(outer, h, ws)[0]

    found = compiled(fn, MESH, (P("tp"), P()), P("tp"), jnp.ones((8, 16)), jnp.ones((3, 4, 16, 16)))
    by_axes = {collective_axes(c, MESH): c for c in found}
    assert set(by_axes) == {("tp",), ("ep",)}
    inner, per_block = by_axes[("tp",)], by_axes[("ep",)]
    assert (inner.in_loop, inner.trip_count, module_of(inner.op_name)) == (True, 12, "ffn")
    assert (per_block.in_loop, per_block.trip_count) == (True, 3)
    assert "while/body" in inner.op_name and inner.computation != per_block.computation
    rows = {(r.axes, r.module): r for r in summarize(found, MESH).rows}
    assert rows[("tp",), "ffn"].count == 12 and rows[("tp",), "ffn"].static_count == 1
    assert rows[("tp",), "ffn"].bytes == 12 * 4 * 16 * F32


def test_auto_sharded_reshard_prints_mesh_or_iota_groups():
    mesh = make_mesh((2, 1, 1, 2, 2))
    sharded = NamedSharding(mesh, P("tp", "ep", "dp"))
    fn = jax.jit(lambda x: 2 * x, in_shardings=sharded, out_shardings=NamedSharding(mesh, P()))
    found = parse_collectives(fn.lower(jnp.ones((8, 8, 8))).compile())
    assert {c.kind for c in found} == {"all-gather"}
    # jax 0.10.2 prints partitioner-made groups in the mesh-axes form by default.
    assert {c.groups_form for c in found} <= {"mesh", "iota"}
    assert {collective_axes(c, mesh) for c in found} == {("tp",), ("ep",), ("dp",)}
    assert max(c.bytes for c in found) == 8 * 8 * 8 * F32


# Reshards whose all-gathers print mesh-axes groups (with or without device_ids, as the JAX
# release prints them) and one iota group with a transpose.
_SUBPROCESS = """
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxpar.inspect import parse_collectives
mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
cases = [(P("a", "b", "c"), P()), (P("c", "b", "a"), P()), (P(("c", "a")), P()),
         (P("c", "a"), P("a")), (P("b"), P(None, "a"))]
out = []
for i, o in cases:
    f = jax.jit(lambda x: 2 * x, in_shardings=NamedSharding(mesh, i),
                out_shardings=NamedSharding(mesh, o))
    out += [[c.groups_form, c.replica_groups] for c in parse_collectives(f.lower(
        jnp.ones((8, 8, 8))).compile()) if c.replica_groups]
print(json.dumps(out))
"""


def _start(flag: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {flag}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", _SUBPROCESS],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def _groups(process: subprocess.Popen) -> list:
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.server
def test_mesh_form_expands_like_the_iota_form_xla_prints_without_it():
    # The flag is read when XLA starts, so each setting needs its own process.
    on, off = (_start(f"--xla_enable_rgv3_materialization={v}") for v in ("true", "false"))
    with_mesh, without = _groups(on), _groups(off)
    assert {form for form, _ in with_mesh} == {"mesh", "iota"}
    assert {form for form, _ in without} == {"iota"}
    # The same groups, whichever form; the order of the groups themselves is the printer's
    # (jax 0.10.2 lists them as the iota form does, 0.12 in mesh order) and means nothing.
    assert [_partition(g) for _, g in with_mesh] == [_partition(g) for _, g in without]


def _partition(groups: list[list[int]]) -> list[tuple[int, ...]]:
    """Replica groups as XLA uses them: a partition of the devices, ids ordered in a group."""
    return sorted(map(tuple, groups))
