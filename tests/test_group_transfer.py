"""Moving arrays between two device groups in one program (``jaxpar.engine._group_transfer``),
the move a disaggregated server makes when its groups lie on other processes: here both
groups in one process (devices 4-7 to devices 0-3 of the 8 simulated CPU devices), where
the program is the same. The values arrive unchanged, in the target shardings, and the
program is one point-to-point send per array from each source device to its destination:
no all-gather, no host."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.engine import check_groups, moves_globally
from jaxpar.engine._group_transfer import _send_program, move_tree, put_tree, union_mesh
from jaxpar.errors import ConfigError


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()
    prefill = Mesh(np.array(devices[4:8]), ("sp",))  # the source group, its own layout
    decode = Mesh(np.array(devices[:4]).reshape(2, 2), ("dp", "tp"))
    return prefill, decode


def _tree(prefill: Mesh):
    """A quantized prefill K ([L, P, T, K, H] int8 and its [.., K, 1] f32 scales), lengths
    and first tokens, laid out over the prefill group (tokens split by sp)."""
    rng = np.random.default_rng(0)
    k = rng.integers(-128, 127, (2, 2, 8, 4, 8), dtype=np.int8)
    scales = rng.random((2, 2, 8, 4, 1), dtype=np.float32)
    lengths, first = np.array([5, 8], np.int32), np.array([17, 3], np.int32)
    tokens = NamedSharding(prefill, PartitionSpec(None, None, "sp"))
    rows = NamedSharding(prefill, PartitionSpec())
    host = {"k": (k, scales), "lengths": lengths, "first": first}
    placed = {
        "k": tuple(jax.device_put(x, tokens) for x in (k, scales)),
        "lengths": jax.device_put(lengths, rows),
        "first": jax.device_put(first, rows),
    }
    return host, placed


def test_a_quantized_kv_tree_arrives_unchanged_in_the_decode_layout(meshes):
    prefill, decode = meshes
    host, placed = _tree(prefill)
    heads = NamedSharding(decode, PartitionSpec(None, "dp", None, "tp"))  # rows dp, heads tp
    targets = {"k": heads, "lengths": NamedSharding(decode, PartitionSpec("dp"))}
    targets["first"] = NamedSharding(decode, PartitionSpec())
    moved, nbytes = put_tree(placed, targets, move_tree)
    for got, want, target in zip(
        jax.tree.leaves(moved),
        jax.tree.leaves(host),
        jax.tree.leaves(jax.tree.broadcast(targets, host)),
        strict=True,
    ):
        assert got.sharding == target
        np.testing.assert_array_equal(np.asarray(got), want)
    assert nbytes == sum(x.nbytes for x in jax.tree.leaves(host))
    # The same as jax.device_put, which can do it here (one process).
    put, put_bytes = put_tree(placed, targets)
    assert put_bytes == nbytes
    for a, b in zip(jax.tree.leaves(put), jax.tree.leaves(moved), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_move_is_one_send_per_array_from_each_source_device_to_its_destination(meshes):
    prefill, decode = meshes
    mesh = union_mesh(prefill, decode)
    assert [d.id for d in mesh.devices[0].flat] == [0, 1, 2, 3]  # group 0: the destination
    specs = (PartitionSpec("dp", None, "tp"), PartitionSpec())
    shapes = [
        jax.ShapeDtypeStruct((2, 4, 4, 8), np.float32),
        jax.ShapeDtypeStruct((2, 2), np.int32),
    ]
    spread = [PartitionSpec("group", *s) for s in specs]
    args = [
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p))
        for s, p in zip(shapes, spread, strict=True)
    ]
    hlo = _send_program(mesh, specs).lower(args).compile().as_text()
    sends = re.findall(r"collective-permute[^\n]*source_target_pairs=\{([^\n]*?)\}\}", hlo)
    assert len(sends) == 2, hlo  # one per array
    for pairs in sends:  # group 1 (mesh positions 4-7) to group 0 (0-3), one to one
        assert sorted(re.findall(r"\{?(\d+),(\d+)", pairs)) == [
            ("4", "0"), ("5", "1"), ("6", "2"), ("7", "3")
        ]  # fmt: skip
    for op in ("all-gather", "all-reduce", "all-to-all", "outfeed", "send(", "recv("):
        assert op not in hlo, op


def test_groups_that_cannot_pair_their_devices_are_refused(meshes):
    prefill, decode = meshes
    assert not moves_globally()  # one process: jax.device_put moves them
    devices = jax.devices()
    with pytest.raises(ConfigError, match=r"prefill group \(2 devices\).*decode group \(4"):
        check_groups(Mesh(np.array(devices[4:6]), ("tp",)), decode)
    with pytest.raises(ConfigError, match="must not share devices; they share"):
        check_groups(Mesh(np.array(devices[2:6]), ("tp",)), decode)
