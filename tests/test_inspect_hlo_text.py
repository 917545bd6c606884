"""The HLO collective reader on text snippets: printed forms CPU compilation cannot give.

``CPU_LINES`` are lines copied from real jax 0.10.2 XLA:CPU output (8 simulated
devices). ``GPU_ASYNC_HLO`` is hand-written: XLA:CPU never emits async collectives, so
it follows the grammar of GPU HLO text (``-start``/``-done`` pairs, async-start
wrappers, send/recv from pipelining) to exercise those paths.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from rich.console import Console

from jaxpar.inspect import (
    axes_for_groups,
    axes_for_pairs,
    collective_axes,
    expand_mesh_axes,
    groups_for_axes,
    module_of,
    parse_collectives,
    parse_replica_groups,
    summarize,
)
from jaxpar.inspect._hlo_text import ArrayShape, flatten_shape, parse_shape

MESH = AbstractMesh((2, 4), ("dp", "tp"))

GPU_ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8,1024]{1,0})->bf16[8,512]{1,0}}, num_partitions=8

%add.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%async_computation (param_0: f32[8,1024]) -> f32[4,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[4,1024]{1,0} reduce-scatter(%param_0), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, dimensions={0}, to_apply=%add.clone, metadata={op_name="jit(step)/jit(main)/moe/reduce_scatter" source_file="m.py" source_line=7}
}

%body (param: (s32[], bf16[8,512])) -> (s32[], bf16[8,512]) {
  %param = (s32[], bf16[8,512]{1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%param), index=0
  %gte.1 = bf16[8,512]{1,0} get-tuple-element(%param), index=1
  %collective-permute-start = (bf16[8,512]{1,0}, bf16[8,512]{1,0}, u32[], u32[]) collective-permute-start(%gte.1), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}, metadata={op_name="jit(step)/while/body/ppermute"}, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %collective-permute-done = bf16[8,512]{1,0} collective-permute-done(%collective-permute-start)
  ROOT %tuple = (s32[], bf16[8,512]{1,0}) tuple(%gte.0, %collective-permute-done)
}

%cond (param.1: (s32[], bf16[8,512])) -> pred[] {
  %param.1 = (s32[], bf16[8,512]{1,0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%param.1), index=0
  %constant.6 = s32[] constant(6)
  ROOT %lt = pred[] compare(%gte.2, %constant.6), direction=LT
}

ENTRY %main.9_spmd (param.2: bf16[8,1024], param.3: f32[8,1024]) -> bf16[8,512] {
  %param.2 = bf16[8,1024]{1,0} parameter(0)
  %param.3 = f32[8,1024]{1,0} parameter(1)
  %all-gather-start = (bf16[8,256]{1,0}, bf16[8,1024]{1,0}) all-gather-start(%param.2), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true, metadata={op_name="jit(step)/jit(main)/attention/all_gather"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %all-gather-done = bf16[8,1024]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = (f32[8,512]{1,0}, f32[16]{0}) all-reduce-start(%param.3, %param.3), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(step)/jit(main)/ffn/psum"}
  %all-reduce-done = (f32[8,512]{1,0}, f32[16]{0}) all-reduce-done(%all-reduce-start)
  %reduce-scatter-start = ((f32[8,1024]{1,0}), f32[4,1024]{1,0}) async-start(%param.3), calls=%async_computation
  %reduce-scatter-done = f32[4,1024]{1,0} async-done(%reduce-scatter-start)
  %after-all = token[] after-all()
  %send = (bf16[8,512]{1,0}, u32[], token[]) send(%param.2, %after-all), channel_id=6, frontend_attributes={_xla_send_recv_source_target_pairs="{{0,4},{1,5},{2,6},{3,7}}"}
  %recv = (bf16[8,512]{1,0}, u32[], token[]) recv(%after-all), channel_id=6, frontend_attributes={_xla_send_recv_source_target_pairs="{{0,4},{1,5},{2,6},{3,7}}"}
  %send-done = token[] send-done(%send), channel_id=6
  %recv-done = (bf16[8,512]{1,0}, token[]) recv-done(%recv), channel_id=6
  %outfeed-send = (f32[2]{0}, u32[], token[]) send(%param.3, %after-all), channel_id=7, is_host_transfer=true
  %init = (s32[], bf16[8,512]{1,0}) tuple(%param.2, %param.2)
  %while = (s32[], bf16[8,512]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = bf16[8,512]{1,0} get-tuple-element(%while), index=1
}
"""


def test_async_starts_count_once_with_output_bytes():
    found = {c.kind: c for c in parse_collectives(GPU_ASYNC_HLO)}
    assert set(found) == {
        "all-gather",
        "all-reduce",
        "reduce-scatter",
        "collective-permute",
        "send",
    }
    ag, ar, rs = found["all-gather"], found["all-reduce"], found["reduce-scatter"]
    assert (ag.is_async, ag.shapes, ag.bytes) == (True, ((8, 1024),), 8 * 1024 * 2)
    assert (ar.is_async, ar.shapes, ar.bytes) == (True, ((8, 512), (16,)), (8 * 512 + 16) * 4)
    assert (rs.is_async, rs.computation, rs.bytes) == (False, "async_computation", 8 * 1024 * 4)
    cp = found["collective-permute"]
    assert (cp.is_async, cp.shapes, cp.bytes) == (True, ((8, 512),), 8 * 512 * 2)
    assert (cp.in_loop, cp.trip_count) == (True, 6)
    assert (found["send"].bytes, found["send"].channel_id) == (8 * 512 * 2, 6)
    axes = {kind: collective_axes(c, MESH) for kind, c in found.items()}
    assert axes == {
        "all-gather": ("tp",),
        "all-reduce": ("tp",),
        "reduce-scatter": ("dp",),
        "collective-permute": ("tp",),
        "send": ("dp",),
    }
    assert module_of(rs.op_name) == "moe" and module_of(cp.op_name) is None


# Lines copied from jax 0.10.2 XLA:CPU compiled text, with their groups worked by hand.
CPU_LINES = {
    "replica_groups={{0,1,4,5},{2,3,6,7}}, use_global_device_ids=true": (
        "explicit",
        ((0, 1, 4, 5), (2, 3, 6, 7)),
    ),
    "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true": (
        "iota",
        ((0, 4), (1, 5), (2, 6), (3, 7)),
    ),
    "replica_groups=[2,4]<=[8], dimensions={0}": ("iota", ((0, 1, 2, 3), (4, 5, 6, 7))),
    "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, dimensions={0}": (
        "mesh",
        ((0, 4), (1, 5), (2, 6), (3, 7)),
    ),
    "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=1,'axis_3'=2], "
    "device_ids=([4,2]T(1,0)) {'axis_1'}, dimensions={0}": (
        "mesh",
        ((0, 4), (2, 6), (1, 5), (3, 7)),
    ),
}


# XLA:TPU's async collective fusions (abridged from a compiled v5e sp=2 x tp=2 prefill): one
# all-gather printed three times, in its start, continuation and done fusions, with the same
# channel and chain ids; another all-gather of its own beside them.
TPU_ASYNC_FUSION_HLO = """\
HloModule jit_prefill, is_scheduled=true, num_partitions=4

%fused_start (p0: bf16[8,128,1,128]) -> bf16[8,256,1,128] {
  %p0 = bf16[8,128,1,128]{1,3,0,2:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.45 = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} all-gather(%p0), channel_id=6, replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=2,'axis_3'=1] {'axis_1'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="0"}, metadata={op_name="jit(prefill)/attention/sharding_constraint"}
}

%async_collective_fusion.221 (p1: bf16[8,128,1,128]) -> bf16[8,256,1,128] {
  %p1 = bf16[8,128,1,128]{1,3,0,2:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.47 = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} all-gather(%p1), channel_id=6, replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=2,'axis_3'=1] {'axis_1'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="0"}, metadata={op_name="jit(prefill)/attention/sharding_constraint"}
}

%fused_done (p2: bf16[8,128,1,128]) -> bf16[8,256,1,128] {
  %p2 = bf16[8,128,1,128]{1,3,0,2:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.49 = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} all-gather(%p2), channel_id=6, replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=2,'axis_3'=1] {'axis_1'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="0"}, metadata={op_name="jit(prefill)/attention/sharding_constraint"}
}

ENTRY %main.22_spmd (k: bf16[8,128,1,128], v: bf16[8,128,1,1,128]) -> bf16[8,256,1,128] {
  %k = bf16[8,128,1,128]{1,3,0,2:T(8,128)(2,1)} parameter(0)
  %v = bf16[8,128,1,1,128]{1,4,2,0,3:T(8,128)(2,1)} parameter(1)
  %start = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} fusion(%k), kind=kCustom, calls=%fused_start
  %cont = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} fusion(%k), kind=kCustom, calls=%async_collective_fusion.221
  %done = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} fusion(%k), kind=kCustom, calls=%fused_done
  %all-gather.68 = bf16[8,256,1,1,128]{1,4,2,0,3:T(8,128)(2,1)} all-gather(%v), channel_id=24, replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=2,'axis_3'=1] {'axis_1'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={async_collective_name="all-gather-start.4"}, metadata={op_name="jit(prefill)/attention/sharding_constraint"}
  ROOT %out = bf16[8,256,1,128]{1,3,0,2:T(8,128)(2,1)} add(%done, %cont)
}
"""


def test_tpu_async_collective_fusions_count_once():
    found = parse_collectives(TPU_ASYNC_FUSION_HLO)
    assert [c.name for c in found] == ["all-gather.45", "all-gather.68"], found
    assert all(c.bytes == 8 * 256 * 128 * 2 for c in found)


def test_replica_group_forms_printed_by_cpu():
    for line, expected in CPU_LINES.items():
        groups, form = parse_replica_groups(", " + line)
        assert (form, groups) == expected, line


def test_synthesised_mesh_forms():
    # Unquoted names, an explicit device-id list, and sub-axes "x:(pre)size"; the
    # partitioner prints split axes as separate synthetic axes instead.
    explicit = parse_replica_groups(
        ", replica_groups=mesh[a=2,b=4], device_ids=(0,2,4,6,1,3,5,7) {b}"
    )
    iota = parse_replica_groups(
        ", replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}"
    )
    assert explicit[0] == iota[0] == ((0, 2, 4, 6), (1, 3, 5, 7))
    sub = expand_mesh_axes([("x", 8)], [("x", 2, 2)])
    split = expand_mesh_axes([("x0", 2), ("x1", 2), ("x2", 2)], [("x1", None, None)])
    np.testing.assert_array_equal(sub, split)
    two = expand_mesh_axes([("x", 8)], [("x", 4, 2), ("x", 1, 2)])
    np.testing.assert_array_equal(
        two, np.arange(8).reshape(2, 2, 2).transpose(1, 2, 0).reshape(2, 4)
    )


def test_empty_groups_mean_all_devices():
    assert parse_replica_groups(", replica_groups={}, to_apply=%add", 8)[0] == (tuple(range(8)),)
    assert parse_replica_groups(", replica_groups={}", None) == (None, "none")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_iota_groups_match_numpy(dims, data):
    perm = data.draw(st.permutations(range(len(dims))))
    n = int(np.prod(dims))
    size = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    text = f", replica_groups=[{n // size},{size}]<=[{','.join(map(str, dims))}]T({','.join(map(str, perm))})"
    groups, form = parse_replica_groups(text)
    # Element-wise reference: walk the transposed index space, ravel in the original.
    flat = [
        int(np.ravel_multi_index(tuple(idx[perm.index(k)] for k in range(len(dims))), dims))
        for idx in itertools.product(*(range(dims[p]) for p in perm))
    ]
    assert form == "iota"
    assert groups == tuple(tuple(flat[i : i + size]) for i in range(0, n, size))
    assert np.array_equal(
        np.array(groups), np.arange(n).reshape(dims).transpose(perm).reshape(-1, size)
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.data())
def test_mesh_form_matches_user_mesh_groups(sizes, data):
    names = [f"axis_{i}" for i in range(len(sizes))]
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    text = ", ".join(f"'{n}'={s}" for n, s in zip(names, sizes, strict=True))
    groups, _ = parse_replica_groups(f", replica_groups=mesh[{text}] {{{','.join(chosen)}}}")
    assert groups == groups_for_axes(AbstractMesh(tuple(sizes), tuple(names)), chosen)


def test_permute_axes_from_pairs():
    assert axes_for_pairs(((0, 4), (5, 1)), MESH) == ("dp",)
    assert axes_for_pairs(((0, 5),), MESH) == ("dp", "tp")
    assert axes_for_pairs(((3, 3),), MESH) == ()
    assert axes_for_pairs(((0, 8),), MESH) is None


def test_module_of_takes_first_scope_component():
    assert module_of("jit(step)/while/body/attention/ffn/psum") == "attention"
    assert module_of("jit(f)/shard_map/lm_head/all_gather") == "lm_head"
    assert module_of("jit(f)/attention_mask/psum") is None
    assert module_of(None) is None


def test_unmapped_groups_and_summary_outputs():
    assert axes_for_groups(((0, 3), (1, 2), (4, 7), (5, 6)), MESH) is None
    assert axes_for_groups(((0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)), MESH) == ()
    summary = summarize(parse_collectives(GPU_ASYNC_HLO), MESH)
    as_json = json.loads(json.dumps(summary.to_dict()))
    rows = {(r["kind"], tuple(r["axes"]), r["module"]): r for r in as_json["rows"]}
    assert rows["collective-permute", ("tp",), None]["count"] == 6
    assert rows["collective-permute", ("tp",), None]["bytes"] == 6 * 8 * 512 * 2
    assert as_json["total_bytes"] == sum(r["bytes"] for r in as_json["rows"])
    gather = next(c for c in parse_collectives(GPU_ASYNC_HLO) if c.kind == "all-gather")
    weird = summarize([replace(gather, replica_groups=((0, 3), (1, 2), (4, 7), (5, 6)))], MESH)
    assert weird.to_dict()["rows"][0]["axes"] == "unmapped"
    console = Console(record=True, width=120)
    console.print(summary.to_rich_table())
    text = console.export_text()
    assert "reduce-scatter" in text and "moe" in text and "49,152" in text


def test_shapes_and_element_sizes():
    shape = parse_shape("((bf16[2,<=3]{1,0}), s4[5], pred[], token[])")
    arrays = flatten_shape(shape)
    assert arrays == [
        ArrayShape("bf16", (2, 3)),
        ArrayShape("s4", (5,)),
        ArrayShape("pred", ()),
        ArrayShape("token", ()),
    ]
    assert [a.nbytes for a in arrays] == [12, 3, 1, 0]


def test_while_with_long_tuple_state_is_followed():
    """Tuples of more than five elements print ``/*index=5*/`` markers (real XLA:CPU text
    of a layer scan); the while op must still parse so its body's collectives count."""
    from jaxpar.inspect import parse_collectives

    text = """HloModule m, num_partitions=2

%body (p: (s32[], f32[2], f32[2], f32[2], f32[2], f32[2], f32[2])) -> (s32[], f32[2], f32[2], f32[2], f32[2], f32[2], f32[2]) {
  %p = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2], f32[2]) parameter(0)
  %g = f32[2]{0} get-tuple-element(%p), index=1
  %ar = f32[2]{0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2], f32[2]) tuple(%p, %ar, %g, %g, %g, %g, %g)
}

ENTRY %main (a: (s32[], f32[2], f32[2], f32[2], f32[2], f32[2], f32[2])) -> f32[2] {
  %a = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2], f32[2]) parameter(0)
  %w = (s32[], f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}, f32[2]{0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[2]{0} get-tuple-element(%w), index=1
}
"""
    (found,) = parse_collectives(text)
    assert found.kind == "all-reduce" and found.in_loop and found.trip_count == 4


def test_tpu_custom_call_printed_over_several_lines():
    """Compiled TPU HLO (libtpu, jax 0.10.2) prints a Pallas call's ``kernel_metadata``
    with newlines inside, one continuation line starting with ``}}``: the computation goes
    on after it, and the collectives below it count (a reader line by line lost them)."""
    text = """HloModule m, num_partitions=2

ENTRY %main (a: bf16[8,256], q: bf16[8,256]) -> bf16[8,256] {
  %a = bf16[8,256]{1,0:T(8,128)(2,1)} parameter(0)
  %q = bf16[8,256]{1,0:T(8,128)(2,1)} parameter(1)
  %ar = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} all-reduce(%a), channel_id=2, replica_groups=mesh['axis_0'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %splash_mha_fwd.4 = bf16[8,256]{1,0:T(8,128)(2,1)} custom-call(%q, %ar), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 256, \\"q_layout\\": 1}"
}}, metadata={op_name="jit(f)/attention/pallas_call"}, backend_config={"custom_call_config":{"body":"x"}}
  ROOT %ar.1 = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} all-reduce(%splash_mha_fwd.4), channel_id=3, replica_groups=mesh['axis_0'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/ffn/dot_general"}
}
"""
    found = parse_collectives(text)
    assert [(c.name, c.bytes, c.replica_groups) for c in found] == [
        ("ar", 4096, ((0, 1),)),
        ("ar.1", 4096, ((0, 1),)),
    ]
    assert found[1].op_name == "jit(f)/ffn/dot_general"


def test_while_without_known_trip_count_reads_its_counter():
    """Compiled TPU HLO prints no ``known_trip_count``: the trips come from ``i < N`` in
    the condition and the counter's constant start in the initial tuple (real form:
    jax 0.10.2 libtpu, a pipeline's layer loop)."""
    text = """HloModule m, num_partitions=2

%cond (p: (s32[], f32[2])) -> pred[] {
  %c.2 = s32[]{:T(128)} constant(3)
  %p = (s32[]{:T(128)}, f32[2]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c.2), direction=LT
}

%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %p = (s32[]{:T(128)}, f32[2]{0}) parameter(0)
  %g = f32[2]{0} get-tuple-element(%p), index=1
  %ar = f32[2]{0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[]{:T(128)}, f32[2]{0}) tuple(%p, %ar)
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %start = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[2]{0}) tuple(%start, %a)
  %w = (s32[]{:T(128)}, f32[2]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[2]{0} get-tuple-element(%w), index=1
}
"""
    (found,) = parse_collectives(text)
    assert found.in_loop and found.trip_count == 3
    unknown = text.replace("constant(0)", "parameter(1)")  # a start not known: unknown trips
    assert parse_collectives(unknown)[0].trip_count is None
