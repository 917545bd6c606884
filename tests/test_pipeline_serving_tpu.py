"""The pipelined serving decode step compiled for TPU v5e-16 at Llama-3-70B's widths.

Compile-only (libtpu's ``v5e:4x4`` topology, no TPU): the paged decode step ``jaxpar serve
--pp 2 --tp 8`` runs (:mod:`jaxpar.engine._pipeline_slots`: decode groups through two
stages, sampling on the last), at Llama-3-70B widths cut to 4 layers (2 per stage), 16
rows of 512 tokens. The offline pipeline once copied each stage's whole stacked kernels
every step on TPU (``tests/test_pipeline_tpu.py``); the serving step reads them in the
layouts they are stored in (:mod:`jaxpar.engine._param_formats`), so it must copy none,
hold temporaries far below one stage kernel, and, scaled to the full 80 layers (stacked
parameters and page pool grow with depth, the rest does not), fit the chip's HBM.
Measured: 4.7 MiB of temporaries, no kernel copy, 0.91 GiB of arguments at 4 layers.
"""

from __future__ import annotations

import math

import jax
import pytest

from jaxpar.engine import AbstractEngine
from jaxpar.inspect import tpu_devices
from jaxpar.inspect._movement import data_movement
from jaxpar.models import ExecutionOptions, ModelRun
from jaxpar.plan import load_hardware
from jaxpar.spec import ParallelConfig, make_mesh
from tests._accelerator_cases import bench
from tests.test_pipeline_tpu import _config

pytestmark = [pytest.mark.accel, pytest.mark.pod, pytest.mark.usefixtures("accelerator_compiles")]

LAYERS, FULL_LAYERS = 4, 80  # Llama-3-70B has 80
ROWS, SEQ = 16, 512


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


@pytest.fixture(scope="module")
def compiled():
    path, _ = bench.libtpu()
    if path is None:
        pytest.fail("no libtpu under the venv's accel/tpu: run scripts/test.sh, which installs it")
    devices = tpu_devices("v5e:4x4", library_path=path)
    parallel = ParallelConfig.parse("pp=2,tp=8")
    mesh = make_mesh(parallel, devices=devices[: parallel.size])
    run = ModelRun(_config(LAYERS), ExecutionOptions())
    engine = AbstractEngine.build(run, parallel, max_batch=ROWS, max_seq_len=SEQ, mesh=mesh)
    program = engine.lower("serve_decode", prompt_len=SEQ // 2).compile()
    return engine, program


def test_pipelined_serving_step_copies_no_stage_kernel(compiled):
    """No copy of a stage's whole stacked gate/up kernel (0.22 GiB per device), nor of
    its query or key/value kernels."""
    engine, program = compiled
    layers = engine.params["layers"]
    kernels = {
        (math.prod(x.sharding.shard_shape(x.shape)), _shard_bytes(x))
        for x in (
            layers["ffn"]["gate_up_kernel"].get_value(),
            layers["attn"]["q_kernel"].get_value(),
            layers["attn"]["kv_kernel"].get_value(),
        )
    }
    moves = data_movement(program, kernels)
    assert sum(m.total_bytes for m in moves) == 0, moves
    gate_up = _shard_bytes(layers["ffn"]["gate_up_kernel"].get_value())
    assert program.memory_analysis().temp_size_in_bytes < 0.1 * gate_up


def test_pipelined_serving_step_fits_v5e_hbm_at_full_depth(compiled):
    """Arguments + outputs + temporaries - aliased, with the stacked layers and the page
    pool scaled from 4 layers to 80: within a v5e chip's HBM."""
    engine, program = compiled
    mem = program.memory_analysis()
    layer_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(engine.params["layers"]))
    pool_bytes = engine.serving.slots.pool_bytes_per_device()
    fixed = mem.argument_size_in_bytes - layer_bytes - pool_bytes
    step = mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    full = fixed + (layer_bytes + pool_bytes) * FULL_LAYERS / LAYERS + step
    assert fixed > 0 and step >= 0
    assert full <= load_hardware("tpu-v5e").hbm_bytes, full / 2**30
