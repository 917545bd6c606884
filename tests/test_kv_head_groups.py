"""KV heads by groups (rule kv-head-replicas): with tp a multiple of the K/V heads, each
device holds exactly the one K/V head its query heads read, never all of them.

The run repeats each checkpoint head tp/K times (adjacent copies), so ``kv_heads`` splits
over tp. Checked: sharded equals one device token for token (f32 prefill logits within
1e-4, greedy tokens identical) for tp 4 and 8 over 2 K/V heads (a preset, int8 weights,
pipelined, served over pages, disaggregated across two replica counts; the HF fixtures at
tp=4 against transformers are tests/test_engine_hf.py, test_gemma.py, test_gpt_oss.py) and tp 16 over 8 on 16 simulated devices (a subprocess); the
bytes per device of the K/V kernel and the caches are one head's; ``explain`` and ``plan``
count heads per group for a Llama-3-70B-shaped config at tp 16.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.engine import ContinuousBatcher, InferenceEngine, Sampling
from jaxpar.errors import IllegalStrategyError
from jaxpar.models import ModelRun, config_from_hf, init_params, preset
from jaxpar.spec import ParallelConfig, kv_head_replicas, make_mesh, param_partition_spec, validate
from tests._engine_util import PROMPTS, engine, reference
from tests._tiers import sweep

ROOT = Path(__file__).resolve().parents[1]
GQA = preset("tiny-gqa")  # 8 query heads, 2 K/V heads
KV_KERNEL = ("embed", None, "kv_heads", "head_dim")
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def test_replica_counts_and_refusals():
    assert [kv_head_replicas(ParallelConfig(tp=tp), GQA) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    # MLA caches one latent "head": no replicas (rule latent-cache-no-heads).
    mla_json = json.loads((ROOT / "tests/fixtures/hf/deepseek_v3/config.json").read_text())
    mla = config_from_hf(mla_json, source="deepseek_v3")
    assert mla.is_mla and kv_head_replicas(ParallelConfig(tp=4), mla) == 1
    # 3 does not divide 2 K/V heads nor is a multiple of them: refused, with what is legal.
    three = dataclasses.replace(GQA, n_heads=6)
    with pytest.raises(IllegalStrategyError) as err:
        validate(three, ParallelConfig(tp=3))
    message = str(err.value)
    assert "n_kv_heads=2 neither divides over tp=3" in message
    assert "kv-head-replicas" in message and "tp in 1, 2, 4, 6" in message


def test_a_run_splits_what_a_checkpoint_holds_whole():
    """The spec of the K/V kernel: the run's heads split over tp; dims with the
    checkpoint's 2 heads (a user's own model) keep them whole on every device."""
    tp4 = ParallelConfig(tp=4)
    run = ModelRun(GQA, kv_head_replicas=kv_head_replicas(tp4, GQA))
    assert (run.n_kv_heads, run.q_per_kv, run.config.n_kv_heads) == (4, 2, 2)
    assert param_partition_spec(KV_KERNEL, tp4, dims=run) == P(None, None, "tp", None)
    assert param_partition_spec(KV_KERNEL, tp4, dims=GQA) == P(None, None, None, None)


def _one_head_per_device(eng: InferenceEngine) -> None:
    """Every device holds 1/tp of the expanded K/V kernel and caches: one head's bytes."""
    c, tp = eng.model_config, eng.parallel_config.tp
    kv = eng.params["layers"][0]["attn"]["kv_kernel"]
    assert kv.shape == (c.d_model, 2, tp, c.head_dim)  # K heads, each tp/K times
    for shard in kv.addressable_shards:
        assert shard.data.shape == (c.d_model, 2, 1, c.head_dim)
    ref = np.asarray(engine("tiny-gqa", ParallelConfig()).params["layers"][0]["attn"]["kv_kernel"])
    r = tp // c.n_kv_heads
    for shard in kv.addressable_shards:  # device i holds checkpoint head i // r
        head = shard.index[2].start // r
        np.testing.assert_array_equal(np.asarray(shard.data), ref[:, :, head : head + 1])
    pool = eng.program.layouts.paged.k
    layer = pool[0] if isinstance(pool, tuple) else pool
    # The paged pool [K, pages, page, H] (per layer): its kv-head dim splits over tp.
    assert "tp" in (layer.spec[0] if isinstance(layer.spec[0], tuple) else (layer.spec[0],))
    cache = eng.layouts.cache.k
    layer = cache[0] if isinstance(cache, tuple) else cache
    assert layer.shard_shape((eng.max_batch, tp, 8, c.head_dim))[1] == 1


@pytest.mark.parametrize("tp", sweep([4, 8], (4).__eq__))
def test_tiny_gqa_matches_single_device(tp):
    ref_logits, ref_tokens = reference("tiny-gqa")
    eng = engine("tiny-gqa", ParallelConfig(tp=tp))
    assert eng.run.kv_head_replicas == tp // 2
    _one_head_per_device(eng)
    tokens, lengths = eng.pad_prompts(PROMPTS)
    np.testing.assert_allclose(
        np.asarray(eng.prefill(tokens, lengths)[0]), ref_logits, atol=1e-4, rtol=0
    )
    assert eng.generate(PROMPTS, 16).tokens == ref_tokens


@pytest.mark.sweep  # a variant of the tp=4 case above, over pp=2 stages
def test_pipelined_with_replicas_matches_single_device():
    """pp=2 x tp=4: stacked stages, contiguous cache, each head twice."""
    ref_logits, ref_tokens = reference("tiny-gqa")
    eng = engine("tiny-gqa", ParallelConfig(pp=2, tp=4))
    tokens, lengths = eng.pad_prompts(PROMPTS)
    np.testing.assert_allclose(
        np.asarray(eng.prefill(tokens, lengths)[0]), ref_logits, atol=1e-4, rtol=0
    )
    assert eng.generate(PROMPTS, 16).tokens == ref_tokens


@pytest.mark.sweep  # the fast tier's int8 expansion: the int8 checkpoint load below
def test_int8_kernels_expand_with_their_scales():
    """Quantized K/V kernels (int8 values stored out-major, per-channel scales) repeat
    along their kv_heads dim like float ones: tp=4 equals the int8 run on one device."""
    one = engine("tiny-gqa", ParallelConfig(), quantize="int8")
    four = engine("tiny-gqa", ParallelConfig(tp=4), quantize="int8")
    attn = four.params["layers"][0]["attn"]
    for name in ("kv_kernel", "kv_kernel_scale"):
        for shard in attn[name].addressable_shards:
            assert shard.data.shape[list(attn[name].shape).index(4)] == 1, name
    tokens, lengths = one.pad_prompts(PROMPTS)
    np.testing.assert_allclose(
        np.asarray(four.prefill(tokens, lengths)[0]),
        np.asarray(one.prefill(tokens, lengths)[0]),
        atol=1e-4,
        rtol=0,
    )
    assert four.generate(PROMPTS, 8).tokens == one.generate(PROMPTS, 8).tokens


# The HF loader path (the Llama fixture's 2 K/V heads at dp=2,tp=4, one per device, against
# transformers): tests/test_engine_hf.py.


def test_loader_expands_heads_and_reads_slices_of_them():
    """``load_hf_checkpoint(kv_head_replicas=2)``: every kv_heads dim (Qwen2's K/V kernel
    and bias) is the checkpoint's, each head repeated; a slice reads only its heads."""
    from flax import nnx

    from jaxpar.models import load_hf_checkpoint
    from jaxpar.models._hf_layout import Repeated

    root = ROOT / "tests/fixtures/hf/qwen2"
    plain = dict(nnx.to_flat_state(load_hf_checkpoint(root)[1]))
    expanded = dict(nnx.to_flat_state(load_hf_checkpoint(root, kv_head_replicas=2)[1]))
    grown = 0
    for path, var in expanded.items():
        axes = tuple(var.get_metadata()["out_sharding"])
        want = np.asarray(plain[path].get_value())
        if "kv_heads" in axes:
            want, grown = np.repeat(want, 2, axis=axes.index("kv_heads")), grown + 1
        np.testing.assert_array_equal(np.asarray(var.get_value()), want, err_msg=str(path))
    assert grown == 2 * 2  # kv_kernel and kv_bias of both layers

    class Rows:  # a recipe over a [3, 2] table: row i is i
        shape = (3, 2)

        def read(self, index, reader):
            return np.arange(3.0)[index[0], None].repeat(2, axis=1)[:, index[1]]

    repeated = Repeated(Rows(), 0, 4)
    assert repeated.shape == (12, 2)
    got = repeated.read((slice(5, 10), slice(None)), None)[:, 0]
    np.testing.assert_array_equal(got, [1, 1, 1, 2, 2])  # run heads 5..9: checkpoint 1, 2


@pytest.mark.parametrize(
    ("fixture", "quantize"),
    sweep([("llama", "int8"), ("llama_fp8_channel", None)], lambda p: p[1] == "int8"),
    ids=str,
)
def test_checkpoints_load_each_devices_heads_quantized(fixture, quantize):
    """``engine_from_hf`` reads each device's K/V head straight from the safetensors file
    (quantized at load, or a pre-quantized fp8 checkpoint with its scales): tp=4 over the
    fixture's 2 K/V heads equals the same load on one device."""
    from jaxpar.engine import engine_from_hf

    def load(parallel: ParallelConfig) -> InferenceEngine:
        mesh = make_mesh(parallel, jax.devices()[: parallel.size])
        path = ROOT / "tests/fixtures/hf" / fixture
        return engine_from_hf(
            path, parallel, max_batch=4, max_seq_len=32, mesh=mesh, quantize=quantize
        )

    one, four = load(ParallelConfig()), load(ParallelConfig(tp=4))
    kv = four.params["layers"][0]["attn"]["kv_kernel"]
    assert kv.shape[list(kv.sharding.spec).index("tp")] == 4
    assert {math.prod(s.data.shape) for s in kv.addressable_shards} == {kv.size // 4}
    prompts = [[5, 17, 99, 3], [42, 8]]
    tokens, lengths = one.pad_prompts(prompts)
    np.testing.assert_allclose(
        np.asarray(four.prefill_logits(tokens, lengths)),
        np.asarray(one.prefill_logits(tokens, lengths)),
        atol=1e-4,
        rtol=0,
    )
    assert four.generate(prompts, 6).tokens == one.generate(prompts, 6).tokens


def _served(eng: InferenceEngine, prefill: InferenceEngine | None = None) -> list[list[int]]:
    sampled = Sampling(temperature=0.8, top_k=20)
    with ContinuousBatcher(eng, prefill_engine=prefill) as batcher:
        if prefill is not None:  # ahead-of-time compiles of the insert too, as serve does
            batcher.warmup(range(1, 9))
        streams = [
            batcher.submit(prompt=p, max_tokens=10, sampling=Sampling() if i % 2 else sampled)
            for i, p in enumerate(PROMPTS)
        ]
        return [s.result(timeout=300) for s in streams]


# A variant: the fast tier's replicated heads are the tp=4 engine above (contiguous cache);
# tiny-gqa served over pages stays fast in tests/test_prefix_chunked.py.
@pytest.mark.sweep
def test_served_over_pages_and_disaggregated_match_single_device():
    """Continuous batching at tp=4 (paged pool, one head per device), and disaggregated
    prefill sp=2 (the checkpoint's 2 heads) -> decode tp=4 (each head twice): the heads
    regroup where they cross; both serve what one device serves."""
    config, params = GQA, init_params(GQA)

    def make(parallel: ParallelConfig, first: int) -> InferenceEngine:
        devices = jax.devices()[first : first + parallel.size]
        mesh = make_mesh(parallel, devices)
        return InferenceEngine(config, params, parallel, max_batch=8, max_seq_len=32, mesh=mesh)

    expected = _served(make(ParallelConfig(), 0))
    assert _served(make(ParallelConfig(tp=4), 0)) == expected
    prefill, decode = make(ParallelConfig(sp=2), 0), make(ParallelConfig(tp=4), 2)
    assert (prefill.run.kv_head_replicas, decode.run.kv_head_replicas) == (1, 2)
    assert _served(decode, prefill) == expected


_SIXTEEN = """
import json, sys
import jax, numpy as np
from jaxpar.engine import InferenceEngine
from jaxpar.models import ModelConfig, init_params
from jaxpar.spec import ParallelConfig
assert jax.device_count() == 16, jax.device_count()
config = ModelConfig(arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=32,
                     n_kv_heads=8, head_dim=8, d_ff=128, max_position_embeddings=64)
params = init_params(config)
prompts = [[5, 17, 99, 3], [42, 8, 1], [7]]
out = {}
for tp in (1, 16):
    eng = InferenceEngine(config, params, ParallelConfig(tp=tp), max_batch=4, max_seq_len=32)
    tokens, lengths = eng.pad_prompts(prompts)
    out[tp] = dict(
        logits=np.asarray(eng.prefill_logits(tokens, lengths)).tolist(),
        tokens=eng.generate(prompts, 8).tokens,
        replicas=eng.run.kv_head_replicas,
        kv_shards=sorted({s.data.shape[2] for s in
                          eng.params["layers"][0]["attn"]["kv_kernel"].addressable_shards}),
    )
print("RESULT " + json.dumps(out))
"""


def _subprocess(script: str, devices: int, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.server
def test_tp16_over_8_kv_heads_matches_one_device():
    """32 query / 8 K/V heads on 16 simulated devices: each head on its 2 devices only."""
    done = _subprocess(_SIXTEEN, 16)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    one, sixteen = out["1"], out["16"]
    assert (one["replicas"], sixteen["replicas"]) == (1, 2)
    assert sixteen["kv_shards"] == [1] and one["kv_shards"] == [8]
    np.testing.assert_allclose(sixteen["logits"], one["logits"], atol=1e-4, rtol=0)
    assert sixteen["tokens"] == one["tokens"]


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama70b")
    (path / "config.json").write_text(json.dumps(LLAMA_70B))
    return path


@pytest.mark.server
def test_explain_70b_tp16_splits_kv_kernel_over_tp(llama70b):
    from jaxpar.cli import main  # noqa: F401 (the CLI's parser, in-process)

    done = _subprocess(
        f"""
        import sys
        from jaxpar.cli import main
        sys.exit(main(["explain", "--hf", {str(llama70b)!r}, "--tp", "16", "--no-compile",
                       "--json", "--batch", "64", "--prompt-len", "1024",
                       "--max-seq-len", "1280"]))
        """,
        16,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    rows = {r["tensor"]: r for r in data["parameters"]}
    kv = rows["layers.*.attn.kv_kernel"]
    assert kv["shape"] == [8192, 2, 16, 128] and kv["spec"] == "P(None, None, tp, None)"
    # One K/V head per device: 8192 x 2 x 128 bf16 per layer, 80 layers.
    assert kv["bytes_per_device"] == 80 * 8192 * 2 * 128 * 2
    assert data["kv_head_replicas"] == {"n_kv_heads": 8, "replicas": 2, "run_kv_heads": 16}
    pool = next(r for r in data["phases"]["decode"]["tensors"] if r["tensor"].startswith("KV page"))
    assert "tp" in pool["spec"]
    shape = pool["shape"]
    assert pool["bytes_per_device"] == math.prod(shape) * 2 // 16


def test_plan_counts_kv_heads_per_group_for_70b(llama70b, capsys):
    """The planner's bytes per device at tp=16: one K/V head of the cache and of the K/V
    kernels per device (as at tp=8), not all 8; and ``plan`` serves 64 x (1024 + 256)
    tokens of the 70B on v5e-16 at tp=16 (among its top plans: pipelined serving, pp=2
    with tp=8 inside, ranks first for throughput)."""
    from jaxpar.cli import main
    from jaxpar.plan._memory import cache_bytes, param_bytes

    model = config_from_hf(LLAMA_70B, source="llama70b")
    tp8, tp16 = ParallelConfig(tp=8), ParallelConfig(tp=16)
    one_head = 80 * 64 * 1280 * 2 * 128 * 2  # K and V of one head, bf16, every layer
    lengths = 64 * 4
    assert cache_bytes(model, tp16, 64, 1280) == cache_bytes(model, tp8, 64, 1280)
    assert cache_bytes(model, tp16, 64, 1280) == one_head + lengths
    # Weights: the K/V kernels hold one head per device at tp=16, all the rest splits 16 ways.
    kv_kernel_tp16 = 80 * 8192 * 2 * 128 * 2
    kv_kernel_all = 8 * kv_kernel_tp16
    rest = param_bytes(model, ParallelConfig()) - kv_kernel_all
    assert param_bytes(model, tp16) - kv_kernel_tp16 <= rest // 16 + 8192 * 4 * 161
    args = ["plan", "--hf", str(llama70b), "--devices", "16", "--hardware", "tpu-v5e"]
    args += ["--batch", "64", "--prompt-len", "1024", "--gen-len", "256"]
    assert main([*args, "--objective", "throughput", "--top", "4", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert any(p["degrees"]["tp"] == 16 and p["fits"] for p in plans), plans
