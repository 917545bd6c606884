"""Every ```python block of README.md runs verbatim (issue 11, items 8 and 14).

Each block runs on its own, in a fresh interpreter with 8 simulated CPU devices, as a reader
who copies it would run it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar import ParallelConfig

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4, "README.md lost its python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # blocks run as a user's would, cache-less
    env["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    # Blocks name checkpoint directories as seen from the repository root.
    for fixture in set(re.findall(r'"(tests/fixtures/[\w/]+)"', BLOCKS[index])):
        shutil.copytree(README.parent / fixture, tmp_path / fixture)
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"README python block {index}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
    )


def test_streaming_callback_gets_minus_one_for_padding_and_finished_rows():
    # The README's description of the callback (item 14), checked: 2 prompts in a batch of
    # 4, prompt 0 stops at its first token, prompt 1 never stops.
    config = jaxpar.preset("tiny-dense")
    parallel = ParallelConfig(dp=2)
    engine = jaxpar.InferenceEngine(
        config,
        jaxpar.init_params(config, seed=0),
        parallel,
        max_batch=4,
        max_seq_len=32,
        mesh=jaxpar.make_mesh(parallel, jax.devices()[:2]),
    )
    prompts = [[5, 6, 7], [8, 9]]
    free = engine.generate(prompts, 4).tokens
    stop = free[0][0]
    assert stop not in free[1], "pick prompts whose second row does not emit the stop token"
    calls = []
    out = engine.generate(
        prompts,
        4,
        stop_tokens=[stop],
        callback=lambda step, tokens_B: calls.append((step, tokens_B.copy())),
    )
    assert [step for step, _ in calls] == [0, 1, 2, 3]
    streamed = np.stack([tokens_B for _, tokens_B in calls], axis=1)  # [rows, steps]
    assert streamed.shape == (4, 4) and streamed.dtype == np.int32
    assert (streamed[2:] == -1).all()  # padding rows
    assert streamed[0].tolist() == [stop, -1, -1, -1]  # finished after its stop token
    assert streamed[1].tolist() == free[1]
    assert out.tokens == [[stop], free[1]]


def test_readme_spec_layer_comments_state_the_results():
    # `expr  # P(...)` / `# Status.X` lines of the spec-layer block say what expr returns.
    block = next(b for b in BLOCKS if "jaxpar.partition_spec(" in b)
    namespace: dict = {}
    exec(block, namespace)  # the block needs the spec layer only
    claims = re.findall(r"^(jaxpar\.\S.*?)\s+# (P\(.*?\)|Status\.\w+)$", block, flags=re.M)
    assert len(claims) >= 3, claims
    for expr, claim in claims:
        value = eval(expr, namespace)
        shown = str(value) if claim.startswith("P(") else f"Status.{value.name}"
        assert shown == claim, (expr, shown, claim)
