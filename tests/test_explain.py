"""``jaxpar explain`` in-process: every tiny preset and HF fixture, JSON and text output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxpar.cli import main
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CASES = [
    (["--model", "tiny-dense", "--dp", "2", "--sp", "2", "--tp", "2"], "tiny-dense"),
    (["--model", "tiny-gqa", "--tp", "4"], "tiny-gqa"),
    (["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--tp", "2"], "tiny-moe"),
    (["--model", "tiny-gpt2", "--sp", "2", "--tp", "4"], "tiny-gpt2"),
    # 4 heads, 2 kv heads, vocab 256: tp=2 splits the kv heads.
    (["--hf", str(FIXTURES / "llama"), "--dp", "2", "--tp", "2"], "hf-llama"),
    # 4 experts, d_ff 48, vocab 128.
    (["--hf", str(FIXTURES / "mixtral_fused"), "--ep", "4", "--tp", "2"], "hf-mixtral"),
    # Qwen3-MoE: 64 experts top-8, q/k norms, 4 heads of 16 (N x H = 64 != d_model 32).
    (["--hf", str(FIXTURES / "qwen3_moe"), "--ep", "4", "--tp", "2"], "hf-qwen3-moe"),
]


def run_json(capsys, argv: list[str]) -> dict:
    """``explain --json``; the offline steps only unless ``argv`` names ``--programs``
    (the serving programs have their own test: compiling them per case costs minutes)."""
    programs = [] if "--programs" in argv else ["--programs", "offline"]
    assert main(["explain", *argv, *programs, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_reports_the_programs_that_serve(capsys):
    """The paged decode step (sampling included), prefill with and without context, the
    first tokens and the insert: each compiled, at the minimum under tp=2, with memory."""
    data = run_json(capsys, ["--model", "tiny-dense", "--tp", "2", "--programs", "serving"])
    rows = {r["program"]: r for r in data["serving"]["programs"]}
    assert list(rows) == [
        "serve_decode",
        "serve_prefill",
        "serve_prefill_context",
        "first_tokens",
        "insert",
    ]
    for name, row in rows.items():
        c = row["collectives"]
        assert c["program"] == name
        assert c["compiled_bytes"] == c["minimum_bytes"], (name, c["exceptions"])
        assert row["memory"]["peak"] > 0
    steps = {s["step"] for s in rows["serve_decode"]["collectives"]["model"]["items"]}
    assert {"attention out-proj", "sampling: candidates", "sampling: per-row sums"} <= steps
    # Analytic only: the serving programs' minimum without compiling.
    data = run_json(
        capsys, ["--model", "tiny-dense", "--tp", "2", "--no-compile", "--programs", "all"]
    )
    assert (
        data["serving"]["models"]["serve_decode"]["total_bytes"]
        == (rows["serve_decode"]["collectives"]["minimum_bytes"])
    )


@pytest.mark.parametrize(
    ("argv", "name"),
    # The fast tier's point: the dense preset (its MoE compiles in the capacity test below).
    sweep(CASES, lambda case: case[1] == "tiny-dense"),
    ids=[c[1] for c in CASES],
)
def test_json_holds_per_tensor_specs_and_compiled_collectives(capsys, argv, name):
    data = run_json(capsys, argv)
    assert data["compiled"] and set(data["phases"]) == {"prefill", "decode"}
    params = {p["tensor"]: p for p in data["parameters"]}
    q = params["layers.*.attn.q_kernel"]  # one array per layer, one row for all of them
    assert q["count"] == data["model"]["n_layers"]
    assert q["logical_axes"] == ["embed", "heads", "head_dim"]
    assert q["spec"] == "P(None, tp, None)"
    assert q["bytes_per_device"] * 2 <= data["model"]["d_model"] * data["model"]["n_heads"] * 4 * (
        data["model"]["head_dim"] * data["model"]["n_layers"]
    )
    for phase, d in data["phases"].items():
        tensors = {t["tensor"]: t for t in d["tensors"]}
        if phase == "prefill":
            cache = tensors["KV cache (K and V each)"]
            assert cache["spec"].startswith("P(None, ") and cache["bytes_per_device"] > 0
        else:  # decode's page pool [L, K, pages, page_pos, H]: never split within a page
            (pool,) = [t for t in d["tensors"] if t["tensor"].startswith("KV page pool")]
            assert pool["logical_axes"] == ["layers", "kv_heads", "pages", "page_pos", "head_dim"]
            assert pool["spec"].startswith("P(None, ") and pool["bytes_per_device"] > 0
            assert pool["spec"].split(", ")[3] == "None"
            assert tensors["block tables (page ids per row)"]["spec"].endswith(", None)")
        moe = "n_experts" in data["model"] and data["model"]["n_experts"] > 0
        local = [t for t in d["tensors"] if t["spec"] == "local (shard_map)"]
        assert len(local) == (2 if moe else 0)  # the MoE's per-device row buffers
        assert all(t["spec"].startswith("P(") for t in d["tensors"] if t not in local)
        assert d["modules"] and all(m["row"] and m["source"] for m in d["modules"])
        report = d["collectives"]
        assert report["rows"] and report["minimum_bytes"] > 0
        # These f32 strategies need no traffic above the minimum, save the MoE's padded
        # dispatch (dropless here), which is named, against the routed-token minimum.
        if moe:
            assert set(report["exceptions"]) == {"moe-dispatch-buffer"}, report["exceptions"]
            assert report["moe_exchange"] == "padded"  # XLA:CPU has no ragged all-to-all
            assert report["ratio"] > 1.05
        else:
            assert report["exceptions"] == {}, report["exceptions"]
            assert report["moe_exchange"] is None
        assert report["ratio_explained"] <= 1.05
        assert report["compiled_bytes"] == sum(r["compiled_bytes"] for r in report["rows"])
        for row in report["rows"]:  # every needed collective is really there
            assert row["compiled_bytes"] >= row["minimum_bytes"] / 1.05, row
        kinds = [s["kind"] for s in d["execution"]]
        assert "comm" in kinds and "compute" in kinds
        qk_norm = any("per-head q/k norms" in s["text"] for s in d["execution"])
        assert qk_norm == (name == "hf-qwen3-moe")


def test_text_tables_and_dot_file(capsys, tmp_path):
    dot = tmp_path / "steps.dot"
    assert (
        main(
            [
                "explain",
                "--model",
                "tiny-moe",
                "--sp",
                "2",
                "--ep",
                "4",
                "--phase",
                "prefill",
                "--programs",
                "offline",
                "--dot",
                str(dot),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for text in (
        "parameters",
        "prefill: tensors",
        "spec table rows",
        "compiled vs minimum",
        "prefill: execution",
        "all-to-all",
        "moe-dispatch-buffer",
        "MoE exchange compiled",
        "local (shard_map)",
    ):
        assert text in out, text
    graph = dot.read_text()
    assert graph.startswith("digraph") and "cluster_prefill" in graph and "next layer" in graph


def test_capacity_factor_reaches_the_routed_minimum(capsys):
    """--moe-capacity-factor 1.25: the report is against the routed-token minimum."""
    argv = ["--model", "tiny-moe", "--ep", "4", "--tp", "2", "--moe-capacity-factor", "1.25"]
    data = run_json(capsys, [*argv, "--phase", "prefill"])
    report = data["phases"]["prefill"]["collectives"]
    # 32 tokens per device, top-2, ep=4: C = ceil(1.25 x 32 x 2 / 4) = 20 rows per peer.
    assert "C=20" in " ".join(t["tensor"] for t in data["phases"]["prefill"]["tensors"])
    assert 1.0 < report["ratio"] <= 1.3
    assert any(i["step"] == "MoE drop count" for i in report["model"]["items"])


@pytest.mark.sweep  # a variant: the pipeline's permutes
def test_pipeline_permutes_between_stages(capsys):
    data = run_json(capsys, ["--model", "tiny-dense", "--pp", "2", "--tp", "4"])
    report = data["phases"]["prefill"]["collectives"]
    items = report["model"]["items"]
    assert any(i["kind"] == "collective-permute" and i["axes"] == ["pp"] for i in items)
    assert data["compiled"]
    # SPMD GPipe with M = 1 microbatch: every stage runs M + pp - 1 = 2 iterations, so
    # what runs inside the pipeline (all but the embedding) costs twice its minimum.
    embedding = sum(i["bytes"] for i in items if i["module"] == "embedding")
    assert embedding > 0
    assert report["exceptions"] == {"pp-bubble": report["minimum_bytes"] - embedding}
    permutes = [r for r in report["rows"] if r["kind"] == "collective-permute"]
    assert permutes and all(r["compiled_bytes"] == 2 * r["minimum_bytes"] > 0 for r in permutes)


@pytest.mark.sweep  # a variant: a larger model from shapes alone
def test_llama_1b_from_shapes_only(capsys):
    # Abstract parameters: nothing of its 1.2B parameters is allocated.
    data = run_json(capsys, ["--model", "llama-1b", "--tp", "8", "--phase", "decode"])
    report = data["phases"]["decode"]["collectives"]
    # XLA:CPU reduces bf16 in f32: twice the bf16 minimum, named as such.
    assert report["exceptions"] == {"cpu-bf16-upcast": report["minimum_bytes"]} != {}
    assert report["minimum_bytes"] > 0 and report["compiled_bytes"] == 2 * report["minimum_bytes"]
    assert data["parameters"][0]["bytes_per_device"] > 0


def test_illegal_strategy_is_refused(capsys):
    assert main(["explain", "--model", "tiny-dense", "--ep", "2"]) == 2
    assert "ep-needs-moe" in capsys.readouterr().out


@pytest.mark.sweep  # a variant: two device groups
def test_disaggregated_explains_each_phase_on_its_group_and_the_handoff(capsys):
    """``--prefill sp=4``: prefill compiled under sp=4 on devices 4-7, decode under tp=4 on
    devices 0-3, and the K/V handoff between them with its bytes."""
    batch, prompt_len = 4, 16
    data = run_json(
        capsys,
        ["--model", "tiny-gqa", "--tp", "4", "--prefill", "sp=4"]
        + ["--batch", str(batch), "--prompt-len", str(prompt_len)],
    )
    prefill, decode = data["phases"]["prefill"], data["phases"]["decode"]
    assert (prefill["strategy"], prefill["devices"]) == ("sp=4", [4, 5, 6, 7])
    assert (decode["strategy"], decode["devices"]) == ("tp=4", [0, 1, 2, 3])
    # Each phase's compiled collectives run over its own strategy's axes.
    assert {a for r in prefill["collectives"]["rows"] for a in r["axes"]} == {"sp"}
    assert {a for r in decode["collectives"]["rows"] for a in r["axes"]} == {"tp"}
    m = data["model"]
    kv = 2 * m["n_layers"] * batch * prompt_len * m["n_kv_heads"] * m["head_dim"] * 4  # f32
    transfer = data["disaggregated"]["transfer"]
    assert transfer["bytes_per_batch"] == kv + 2 * batch * 4  # + lengths and first tokens
    assert transfer["from_spec"] == "P(None, 'sp', None, None)"
    assert main(["explain", "--model", "tiny-gqa", "--tp", "4", "--prefill", "sp=4"]) == 0
    text = capsys.readouterr().out
    assert "prefill -> decode handoff" in text and "devices 4-7" in text


def test_quantized_experts_show_their_dtype_bytes_and_scales(capsys):
    """--quantize int8 on a MoE: the stacked expert kernels int8 split over ep (experts)
    and tp (columns), their per-expert scales ``[E, 1, F]`` float32 split as they are;
    the router stays in the model dtype."""
    data = run_json(
        capsys,
        ["--model", "tiny-moe", "--ep", "2", "--tp", "2", "--quantize", "int8", "--no-compile"],
    )
    rows = {r["tensor"]: r for r in data["parameters"]}
    gate, scale = (
        rows["layers.*.ffn.experts.gate_kernel"],
        rows["layers.*.ffn.experts.gate_kernel_scale"],
    )
    assert (gate["dtype"], scale["dtype"]) == ("int8", "float32")
    assert gate["spec"] == scale["spec"] == "P(ep, None, tp)"
    assert gate["bytes_per_device"] == 4 * (8 // 2) * 64 * (64 // 2)  # 4 layers, int8
    assert scale["bytes_per_device"] == 4 * (8 // 2) * (64 // 2) * 4
    assert rows["layers.*.ffn.experts.down_kernel_scale"]["spec"] == "P(ep, None, None)"
    assert rows["layers.*.ffn.router.kernel"]["dtype"] == "float32"


@pytest.mark.sweep  # a variant: int8 dense weights (the MoE one stays)
def test_quantized_parameters_show_their_dtype_bytes_and_scales(capsys):
    """--quantize int8: kernels int8 at one byte an element, stored out-major ``[N, H, D]``,
    scales float32 split as their kernels (tp splits the q kernel's heads and its scales'
    heads alike)."""
    data = run_json(capsys, ["--model", "tiny-gqa", "--tp", "2", "--quantize", "int8"])
    rows = {r["tensor"]: r for r in data["parameters"]}
    q, scale = rows["layers.*.attn.q_kernel"], rows["layers.*.attn.q_kernel_scale"]
    assert (q["dtype"], scale["dtype"]) == ("int8", "float32")
    assert q["spec"] == scale["spec"] == "P(tp, None, None)"
    assert q["bytes_per_device"] == 4 * 64 * 8 * 8 // 2  # 4 layers, int8, heads over tp
    assert rows["embed.token_table"]["dtype"] == "float32"  # not quantized unless asked
    asked = ["--model", "tiny-gqa", "--tp", "2", "--quantize", "int8", "--quantize-embeddings"]
    rows = {r["tensor"]: r for r in run_json(capsys, asked)["parameters"]}
    table, table_scale = rows["embed.token_table"], rows["embed.token_table_scale"]
    assert (table["dtype"], table_scale["dtype"]) == ("int8", "float32")
    assert table["spec"] == table_scale["spec"] == "P(tp, None)"  # rows split over tp
    assert rows["lm_head.kernel"]["dtype"] == "int8"
