"""The default path compiles for TPU and lowers and partitions for CUDA, kernels present.

* **TPU v5e**: every strategy is compiled for a compile-only ``v5e:2x4`` topology (libtpu,
  no TPU): real TPU HLO. ``"auto"`` resolves from the mesh's devices, so bf16 prefill must
  call the splash kernel in every layer; a silent fallback to XLA fails here.
* **CUDA**: lowered for ``cuda`` in a subprocess that has the CUDA plugin and cuDNN on its
  path (``tests/_cuda_lowering.py``), then compiled with XLA:CPU, which runs XLA's SPMD
  partitioning (cuDNN's custom partitioner included) before it stops at the first GPU
  custom call. A partitioning failure is a different error, and fails here.

``scripts/test.sh`` installs libtpu and the CUDA plugin outside the venv's packages
(``<venv>/accel``, see ``scripts/_accelerators.sh``); without them these tests fail and say
so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar.engine import AbstractEngine
from jaxpar.inspect import kernel_calls, parse_collectives, tpu_devices
from jaxpar.spec import ParallelConfig, make_mesh
from jaxpar.spec._constrain import _jax_version
from tests._accelerator_cases import CUDA_CASES, MOE_CASES, TPU_CASES, bench, model_config
from tests._movement import moved_fraction

ROOT = Path(__file__).resolve().parent.parent
ACCEL = Path(sys.prefix) / "accel"  # the running venv's (scripts/_accelerators.sh)
pytestmark = [pytest.mark.accel, pytest.mark.usefixtures("accelerator_compiles")]
# Version-sensitive: each JAX release brings its own libtpu and CUDA plugin, so
# scripts/test.sh also runs the tests marked jax_compat on the older release: every test
# here on at least its most composite cases (pipeline, sequence parallel with a window,
# dp x ep x tp, int4 experts), every case on the newer one.
COMPAT = pytest.mark.jax_compat
#: The cases of each parametrized test that also run on the older release.
COMPAT_CASES = {
    ("tiny-gqa", "sp=2,tp=2"),
    ("tiny-gqa", "pp=2,tp=2"),
    "dp=2,tp=2",
    "dp=2,ep=2,tp=2",
    "triton",
}


def _compat(cases: list, key=lambda case: case) -> list:
    """``cases`` as parameters, those in :data:`COMPAT_CASES` (or windowed) marked jax_compat."""

    def marked(case) -> bool:
        return key(case) in COMPAT_CASES or bool(isinstance(case, tuple) and case[2].get("window"))

    def param(case) -> object:
        values = case if isinstance(case, tuple) else (case,)
        return pytest.param(*values, marks=COMPAT) if marked(case) else case

    return [param(c) for c in cases]


BATCH, SEQ = 8, 256
TRITON_NEEDS_A_GPU = _jax_version() >= (0, 12)


def _libtpu() -> str:
    path, _ = bench.libtpu()  # the venv's accel/tpu
    if path is None:
        pytest.fail(f"no libtpu under {ACCEL / 'tpu'}: run scripts/test.sh, which installs it")
    return path


@pytest.fixture(scope="module")
def v5e() -> list:
    return tpu_devices("v5e:2x4", library_path=_libtpu())


def _tpu_engine(devices, preset_name: str, strategy: str, **overrides) -> AbstractEngine:
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=devices[: parallel.size])
    config = model_config(preset_name, **overrides)
    return AbstractEngine.build(config, parallel, max_batch=BATCH, max_seq_len=SEQ, mesh=mesh)


def _assert_tpu_program(compiled, engine: AbstractEngine, *, splash: int) -> None:
    assert "tpu_custom_call" in compiled.as_text() or splash == 0
    calls = kernel_calls(compiled)
    assert calls["splash"] == splash, calls
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes > 0
    # Collectives are read from TPU HLO as from CPU HLO: every one over this mesh's devices.
    n = engine.mesh.devices.size
    for c in parse_collectives(compiled):
        for group in c.replica_groups or ():
            assert all(0 <= i < n for i in group), c


@pytest.mark.parametrize(
    ("preset_name", "strategy", "overrides"), _compat(TPU_CASES, key=lambda c: c[:2]), ids=str
)
def test_bf16_steps_compile_for_tpu_v5e_with_splash_in_every_layer(
    v5e, preset_name, strategy, overrides
):
    engine = _tpu_engine(v5e, preset_name, strategy, **overrides)
    prefill = engine.lower("prefill", prompt_len=SEQ).compile()
    _assert_tpu_program(prefill, engine, splash=bench.splash_expected(engine))
    # TPU decode runs XLA (no Pallas TPU decode kernel reads this cache layout).
    decode = engine.lower("decode", prompt_len=SEQ).compile()
    _assert_tpu_program(decode, engine, splash=0)
    if engine.options.layer_loop == "unrolled":  # the stacked form copies by design
        # No weight or layer cache is copied (or widened to f32 and copied) per step. On
        # v5e the cache write through a [1, B, K, S, H] view and f32 products over the
        # cache once moved 114% (one device) and 156% (kv heads then replicated over tp=4).
        assert moved_fraction(decode, engine, BATCH, SEQ) == 0.0


@pytest.mark.parametrize("strategy", ["tp=2", pytest.param("dp=2,tp=2", marks=COMPAT)])
def test_serving_steps_compile_for_tpu_v5e(v5e, strategy):
    """The programs ``jaxpar serve`` runs, lowered by ``AbstractEngine`` as the server
    builds them (a page pool of BATCH x SEQ tokens): the paged decode step with its
    vocab-parallel sampler, and the insert of 4 prefilled rows of 128 tokens."""
    engine = _tpu_engine(v5e, "tiny-gqa", strategy)
    step = engine.lower("serve_decode", prompt_len=SEQ).compile()
    insert = engine.lower("insert", prompt_len=128, rows=4).compile()
    assert kernel_calls(step)["splash"] == 0  # decode: XLA on TPU
    assert step.memory_analysis().argument_size_in_bytes > 0
    assert insert.memory_analysis().argument_size_in_bytes > 0
    # No collective of the sampler is vocabulary-sized (the vocab-parallel sampler).
    vocab_bytes = BATCH * engine.run.vocab_size * 4
    assert all(c.bytes < vocab_bytes for c in parse_collectives(step))


@pytest.mark.parametrize("strategy", _compat(MOE_CASES))
def test_moe_ragged_dispatch_compiles_for_tpu_v5e(v5e, strategy):
    engine = _tpu_engine(v5e, "tiny-moe", strategy)
    assert engine.options.moe_dispatch == "ragged"  # probed on the TPU device itself
    layers = engine.model_config.n_layers
    for phase, splash in (("prefill", layers), ("decode", 0)):
        compiled = engine.lower(phase, prompt_len=SEQ).compile()
        _assert_tpu_program(compiled, engine, splash=splash)
        # Dispatch and combine: two ragged exchanges per layer.
        assert kernel_calls(compiled)["ragged_all_to_all"] == 2 * layers


@pytest.mark.parametrize(
    ("strategy", "quantize"),
    [(s, q) for s in MOE_CASES for q in ("int8", "int4") if (s, q) != (MOE_CASES[-1], "int4")]
    + [pytest.param(MOE_CASES[-1], "int4", marks=COMPAT)],
)
def test_quantized_moe_decode_compiles_for_tpu_v5e_reading_the_quantized_bytes(
    v5e, strategy, quantize
):
    """Quantized experts (and attention) over the ragged exchange: libtpu compiles the
    decode step (int4's two groups per column run the masked matmuls: its grouped form
    aborted libtpu's compiler under ep), and no expert kernel is dequantized into a copy
    (measured 0.0 int8, 0.0004 int4 under ep=2: within the CPU budget of 5%)."""
    engine = _tpu_engine(v5e, "tiny-moe", strategy, quantize=quantize)
    assert engine.options.moe_dispatch == "ragged"
    experts = engine.params["layers"][0]["ffn"]["experts"]
    assert experts["gate_kernel"].get_value().dtype == np.dtype(quantize)
    decode = engine.lower("decode", prompt_len=SEQ).compile()
    assert kernel_calls(decode)["ragged_all_to_all"] == 2 * engine.model_config.n_layers
    assert moved_fraction(decode, engine, BATCH, SEQ) <= 0.05


@COMPAT
def test_quantized_dense_steps_compile_for_tpu_v5e_reading_the_out_major_kernels(v5e):
    """int8 attention and FFN kernels, stored out-major ``[*O, *C]`` (the Hub's order), under
    tp=2: the TPU resolves the ``"dot"`` matmul form and takes the transposed operand as it
    lies, so neither prefill nor decode re-lays or dequantizes a kernel (measured 0.0002 and
    0.0; XLA:CPU's prefill dot re-lays them, see the README)."""
    engine = _tpu_engine(v5e, "tiny-gqa", "tp=2", quantize="int8")
    assert engine.options.matmul == "dot"
    assert engine.params["layers"][0]["attn"]["q_kernel"].get_value().dtype == np.int8
    for phase in ("prefill", "decode"):
        compiled = engine.lower(phase, prompt_len=SEQ).compile()
        assert moved_fraction(compiled, engine, BATCH, SEQ) <= 0.01, phase


# --- CUDA ------------------------------------------------------------------------------------


def _cuda_key(preset_name: str, strategy: str, overrides: dict) -> str:
    return f"{preset_name}|{strategy}|{json.dumps(overrides, sort_keys=True)}"


@pytest.fixture(scope="module")
def cuda_results(request) -> dict:
    """One subprocess lowers every selected case (the older release selects the
    jax_compat ones: -m jax_compat)."""
    plugin = ACCEL / "cuda"
    if not (plugin / "jax_plugins").is_dir():
        pytest.fail(f"no CUDA plugin under {plugin}: run scripts/test.sh, which installs it")
    selected = [
        _cuda_key(*(item.callspec.params[k] for k in ("preset_name", "strategy", "overrides")))
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_bf16_steps_lower_and_partition_for_cuda"
    ]
    env = dict(os.environ, PYTHONPATH=f"{plugin}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-m", "tests._cuda_lowering", *selected],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


# The older release lowers the composite cases and the windowed one, and the Triton
# decode kernel (which only it can lower without a GPU); the newer one lowers them all.
@pytest.mark.parametrize(
    ("preset_name", "strategy", "overrides"),
    _compat(CUDA_CASES, key=lambda c: c[:2] if c[2].get("decode_attention") is None else "triton"),
    ids=str,
)
def test_bf16_steps_lower_and_partition_for_cuda(cuda_results, preset_name, strategy, overrides):
    result = cuda_results[_cuda_key(preset_name, strategy, overrides)]
    per_layer = result["layers"] if result["layer_loop"] == "unrolled" else 1
    prefill, decode = result["prefill"], result["decode"]
    triton = overrides.get("decode_attention") == "pallas_gpu"
    if triton and TRITON_NEEDS_A_GPU:
        # JAX 0.12 asks the GPU for its kind while lowering a Pallas Triton kernel: with none
        # attached, the deprecated kernel cannot be lowered here (it can on 0.10).
        assert "No supported GPU devices found" in decode["lower_error"], decode
        decode = None
    # A kernel in every layer of both steps: one that returned f32 made "auto" drop to XLA
    # from layer 1 on (and an explicit kernel cast every later layer's cache).
    assert prefill["lower_error"] is None, prefill["lower_error"]
    assert prefill["calls"]["cudnn"] == per_layer, prefill
    if decode is not None:
        assert decode["lower_error"] is None, decode["lower_error"]
        assert decode["calls"]["triton" if triton else "cudnn"] == per_layer, decode
        assert decode["calls"]["cudnn" if triton else "triton"] == 0, decode
    for step in (prefill, decode):
        if step is None:
            continue
        # Partitioning went through; XLA:CPU then stopped at the GPU custom call.
        assert step["compile_error"] is not None, step
        assert "custom_partitioner" not in step["compile_error"], step["compile_error"]
        assert step["stopped_at_gpu_call"], step["compile_error"]


@COMPAT
def test_cases_cover_the_issue_strategies():
    assert MOE_CASES[-1] == "dp=2,ep=2,tp=2"  # the composite case both releases compile
    strategies = {s for _, s, _ in TPU_CASES}
    assert {"", "tp=2", "dp=2,tp=2", "sp=2,tp=2", "pp=2,tp=2"} <= strategies
    assert any(o.get("window") for _, _, o in TPU_CASES)
    # tiny-gqa has 2 kv heads: at tp=4 each is held twice, one per device.
    assert model_config("tiny-gqa").n_kv_heads < 4 and ("tiny-gqa", "tp=4", {}) in TPU_CASES
    assert set(MOE_CASES) == {"ep=2", "dp=2,ep=2,tp=2"}
    assert model_config("tiny-gqa").dtype == np.dtype("bfloat16")
