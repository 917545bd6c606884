"""The analytic communication model and the compiled-vs-minimum report, without compiling.

Sizes are recomputed by hand from the design (see ``jaxpar/inspect/_model.py``); the report
is fed hand-made :class:`Collective` records and a hand-written HLO snippet.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest

from jaxpar.inspect import (
    Collective,
    classify,
    collective_report,
    communication_model,
    execution_steps,
    parse_collectives,
)
from jaxpar.models import ExecutionOptions, ModelRun, preset
from jaxpar.spec import ParallelConfig

DENSE, GQA, MOE = preset("tiny-dense"), preset("tiny-gqa"), preset("tiny-moe")
B, T, D, L, F32 = 8, 16, 64, 4, 4


def items(model, strategy: str, phase: str, **kw):
    m = communication_model(
        model, ParallelConfig.parse(strategy), phase, batch=B, prompt_len=T, **kw
    )
    return {item.step: item for item in m.items}, m


def test_tp_decode_needs_two_all_reduces_per_layer_and_one_for_the_embedding():
    got, m = items(DENSE, "dp=2,sp=2,tp=2", "decode")
    assert set(got) == {"embedding lookup", "attention out-proj", "FFN down-proj"}
    for step, count in (("embedding lookup", 1), ("attention out-proj", L), ("FFN down-proj", L)):
        item = got[step]
        # Batch over dp and sp in decode (sp carries batch), one token.
        assert (item.kind, item.axes, item.shape, item.count) == (
            "all-reduce",
            ("tp",),
            (2, 1, D),
            count,
        )
    assert m.total_bytes == (2 * L + 1) * 2 * D * F32


def test_dp_needs_nothing():
    for phase in ("prefill", "decode"):
        got, m = items(DENSE, "dp=8", phase)
        assert got == {} and m.total_bytes == 0 and m.notes


def test_sp_prefill_gathers_kv_and_selects_the_last_position():
    got, _ = items(DENSE, "dp=2,sp=2,tp=2", "prefill")
    kv = got["K/V gather"]
    assert (kv.kind, kv.axes, kv.shape, kv.count) == ("all-gather", ("sp",), (4, T, 4, 8), 2 * L)
    assert got["attention out-proj"].shape == (4, T // 2, D)  # TP all-reduce on local tokens
    last = got["last-position select"]
    assert (last.kind, last.axes, last.module, last.shape) == ("all-reduce", ("sp",), None, (4, D))


def test_kv_head_groups_gather_one_head_per_device():
    """2 kv heads < tp=4: the run holds each twice (rule kv-head-replicas), one per device,
    so the sp gather moves one head per device, not both."""
    got, _ = items(GQA, "sp=2,tp=4", "prefill")
    assert got["K/V gather"].shape == (B, T, 1, 8)


def test_moe_minimum_is_the_routed_rows():
    got, _ = items(MOE, "dp=2,ep=2,tp=2", "prefill")
    a2a = got["dispatch + combine"]
    # Tokens per device: B / (dp * ep) sequences of T; each goes to top_k=2 experts.
    routed = 2 * (B // 4) * T
    assert (a2a.kind, a2a.axes, a2a.shape, a2a.count) == ("all-to-all", ("ep",), (routed, D), 2 * L)
    down = got["expert down-proj"]  # the expert TP reduction, once per token after combining
    assert (down.kind, down.axes, down.shape, down.count) == (
        "all-reduce",
        ("tp",),
        (routed // 2, D),
        L,
    )
    assert "FFN down-proj" not in got and "MoE drop count" not in got  # dropless


def test_moe_capacity_mode_sums_the_drop_count_and_sp_splits_groups():
    capped = ModelRun(MOE, ExecutionOptions(moe_capacity_factor=1.25))
    got, _ = items(capped, "sp=2,ep=4", "prefill")
    # Groups per (sequence shard, sp shard): B / ep sequences x T / sp tokens per device.
    assert got["dispatch + combine"].shape == (2 * (B // 4) * (T // 2), D)
    assert "dispatch sum over sp" not in got
    drop = got["MoE drop count"]
    assert (drop.kind, drop.axes, drop.shape, drop.itemsize) == ("all-reduce", ("sp", "ep"), (), 4)
    got, _ = items(capped, "sp=2,ep=4", "decode")  # sp carries batch in decode
    assert got["dispatch + combine"].shape == (2 * B // 8, D)
    assert got["MoE drop count"].axes == ("sp", "ep")


def test_pipeline_permutes_once_per_boundary_per_microbatch():
    cfg = ParallelConfig(pp=2, tp=4, microbatches=2)
    m = communication_model(DENSE, cfg, "prefill", batch=B, prompt_len=T)
    perm = next(i for i in m.items if i.kind == "collective-permute")
    assert (perm.axes, perm.shape, perm.count) == (("pp",), (B // 2, T, D), 2 * (2 - 1))
    attn = next(i for i in m.items if i.step == "attention out-proj")
    assert attn.count == (L // 2) * 2  # this stage's layers, once per microbatch


def test_execution_steps_name_the_layer_form():
    """The layer block's label says how the layers run: a loop over per-layer weights
    (unrolled, the default), or a scan over stacked ones (asked for, or pipelined)."""

    def label(config, cfg):
        steps = execution_steps(
            config, communication_model(config, cfg, "decode", batch=B, prompt_len=T)
        )
        return {s["section"] for s in steps if s["section"].startswith("layer")}

    assert label(DENSE, ParallelConfig(tp=2)) == {"layer x4 (unrolled)"}
    scan = ModelRun(DENSE, ExecutionOptions(layer_loop="scan"))
    assert label(scan, ParallelConfig(tp=2)) == {"layer x4 (scan)"}
    assert label(DENSE, ParallelConfig(pp=2, tp=2)) == {"layer x2 (scan)"}


def test_bf16_halves_the_bytes():
    half = dataclasses.replace(DENSE, dtype="bfloat16", param_dtype="bfloat16")
    assert (
        items(half, "tp=8", "decode")[1].total_bytes * 2
        == items(DENSE, "tp=8", "decode")[1].total_bytes
    )


def test_to_dict_is_json():
    json.dumps(items(MOE, "dp=2,ep=2,tp=2", "prefill")[1].to_dict())


# --- report ------------------------------------------------------------------------------


class Mesh:
    axis_names = ("dp", "pp", "sp", "ep", "tp")
    axis_sizes = (2, 1, 2, 1, 2)


def coll(kind, shape, groups, op_name, trip=1, dtype="f32") -> Collective:
    return Collective(
        kind=kind,
        name="x",
        computation="c",
        shapes=(shape,),
        dtypes=(dtype,),
        bytes=math.prod(shape) * 4,
        replica_groups=groups,
        groups_form="explicit",
        source_target_pairs=None,
        channel_id=1,
        use_global_device_ids=True,
        op_name=op_name,
        is_async=False,
        in_loop=trip > 1,
        trip_count=trip,
    )


TP_GROUPS = ((0, 1), (2, 3), (4, 5), (6, 7))
DP_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))


def test_report_matches_groups_and_names_the_excess():
    model = communication_model(
        DENSE, ParallelConfig(dp=2, sp=2, tp=2), "prefill", batch=B, prompt_len=T
    )
    found = [
        coll("all-reduce", (4, 8, D), TP_GROUPS, "jit(f)/while/body/attention/dot_general", L),
        coll("all-reduce", (4, 8, D), TP_GROUPS, "jit(f)/while/body/ffn/dot_general", L),
        coll("all-reduce", (4, 8, D), TP_GROUPS, "jit(f)/embedding/gather"),
        coll(
            "all-gather",
            (4, T, 4, 8),
            ((0, 2), (1, 3), (4, 6), (5, 7)),
            "jit(f)/while/body/attention/x",
            2 * L,
        ),
        coll("all-reduce", (4, D), ((0, 2), (1, 3), (4, 6), (5, 7)), "jit(f)/gather"),
        # Not needed, and inside a scope jaxpar names a cause by:
        coll("all-reduce", (4, D), DP_GROUPS, "jit(f)/while/body/moe/expert_rows/psum"),
    ]
    report = collective_report(found, Mesh(), model)
    assert report.exceptions == {"moe-dispatch-buffer": 4 * D * F32}
    assert report.ratio_explained == pytest.approx(1.0)
    assert report.ratio == pytest.approx(1 + 4 * D * F32 / model.total_bytes)
    row = next(r for r in report.rows if r.axes == ("dp",))
    assert (row.minimum_bytes, row.cause, row.ratio) == (0, "moe-dispatch-buffer", math.inf)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["exceptions"] == {"moe-dispatch-buffer": 1024} and data["rows"]
    from rich.console import Console

    Console(file=io.StringIO(), width=160).print(report.to_rich_table())


def test_excess_on_a_needed_group_goes_to_its_cause():
    half = dataclasses.replace(DENSE, dtype="bfloat16", param_dtype="bfloat16")
    model = communication_model(half, ParallelConfig(tp=8), "decode", batch=B, prompt_len=T)
    found = [
        coll("all-reduce", (B, 1, D), (tuple(range(8)),), f"jit(f)/{m}/dot", n)
        for m, n in (("attention", L), ("ffn", L), ("embedding", 1))
    ]

    class Mesh8:
        axis_names, axis_sizes = ("dp", "pp", "sp", "ep", "tp"), (1, 1, 1, 1, 8)

    report = collective_report(found, Mesh8(), model)  # f32 collectives for a bf16 model
    assert report.ratio == pytest.approx(2.0)
    assert report.exceptions == {"cpu-bf16-upcast": model.total_bytes}


def test_classify_rules():
    rows = "jit(f)/while/body/moe/expert_rows/all_to_all"
    a2a = coll("all-to-all", (2, 16, 8), DP_GROUPS, rows)
    # Causes are keyed on jaxpar's own named scopes, not on XLA's op text: an all-to-all
    # outside the MoE's expert-rows scope is not the MoE dispatch.
    other = coll("all-to-all", (2, 16, 8), DP_GROUPS, "jit(f)/lm_head/all_to_all")
    cache = coll("all-gather", (1, 8, 64, 2, 8), None, "jit(f)/while/body/squeeze")
    assert classify(a2a, "prefill") == "moe-dispatch-buffer"
    assert classify(other, "prefill") == "unclassified"
    assert classify(cache, "decode", cache_dims=(64, 8)) == "kv-cache-gather"
    assert classify(cache, "decode") == "unclassified"


HLO_WITH_INDEX_COMMENTS = """HloModule m, num_partitions=2

%body (p: (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2])) -> (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) {
  %p = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) parameter(0)
  %x = f32[2]{0} get-tuple-element(%p), index=1
  %ar = f32[2]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) tuple(%p)
}

%cond (p: (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2])) -> pred[] {
  %p = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2])) -> f32[2] {
  %a = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) parameter(0)
  %w = (s32[], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_index_comments_in_loop_carries_do_not_hide_the_loop_body():
    found = parse_collectives(HLO_WITH_INDEX_COMMENTS)
    assert [(c.kind, c.trip_count) for c in found] == [("all-reduce", 4)]


@pytest.mark.parametrize(("strategy", "ffn_runs"), [("ep=8,tp=8", 3), ("ep=8", 0), ("ep=4", 0)])
def test_shared_experts_ride_the_moe_reduction(strategy, ffn_runs):
    """DeepSeek-V3 (3 dense layers, then 58 MoE layers with a shared expert): where the
    routed experts and the shared one split their intermediate over the same axes (tp),
    the shared expert's partial sums join the experts' before their one all-reduce, so
    only the dense layers reduce apart (the compiled TPU program has 3 FFN all-reduces,
    not 61). Without tp neither reduces."""
    from pathlib import Path

    from jaxpar.models import config_from_hf

    path = Path(__file__).parent / "fixtures" / "configs" / "deepseek-v3"
    c = config_from_hf(json.loads((path / "config.json").read_text()), source=str(path))
    got, _ = items(c, strategy, "decode")
    ffn = got.get("FFN down-proj")
    assert (ffn.count if ffn else 0) == ffn_runs
    if "tp" in strategy:
        assert got["expert down-proj"].count == c.n_layers - c.moe.first_dense_layers
