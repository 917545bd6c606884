"""One admission path: the engine, the batcher, ``jaxpar run`` and the server decide what a
request may ask by the same :class:`~jaxpar.engine.Admission` and merge sampling fields by
the same :func:`~jaxpar.engine.merge_sampling`.

An exact fit (prompt + max_tokens - 1 == max_seq_len) is accepted by all four and one
token more refused by all four; the same sampling fields give the same
:class:`~jaxpar.engine.Sampling` from the command line and over HTTP.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar import CacheOverflowError, InferenceEngine, ParallelConfig
from jaxpar.cli._run import choose_sampling
from jaxpar.engine import Admission, ContinuousBatcher, GenerationDefaults, Sampling
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.models import init_params, preset
from jaxpar.server import ServedModel, Service
from jaxpar.server._protocol import CompletionRequest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = preset("tiny-gqa")
MAX_SEQ_LEN = 32


@pytest.fixture(scope="module")
def engine():
    return InferenceEngine(
        CONFIG, init_params(CONFIG), ParallelConfig(), max_batch=2, max_seq_len=MAX_SEQ_LEN
    )


def test_admission_accepts_the_exact_fit_and_refuses_one_more():
    admission = Admission(vocab_size=256, max_seq_len=MAX_SEQ_LEN)
    prompt = [1] * 10
    assert admission.room(len(prompt)) == MAX_SEQ_LEN + 1 - 10
    admission.check(prompt, MAX_SEQ_LEN + 1 - 10)
    with pytest.raises(CacheOverflowError, match="lower max_tokens to at most 23"):
        admission.check(prompt, MAX_SEQ_LEN + 2 - 10)


def test_engine_and_batcher_share_the_rule(engine):
    prompt = [1] * 10
    fits, too_many = MAX_SEQ_LEN + 1 - 10, MAX_SEQ_LEN + 2 - 10
    engine._check_prompts([prompt], fits)
    with pytest.raises(CacheOverflowError, match="max_new_tokens"):
        engine._check_prompts([prompt], too_many)
    batcher = ContinuousBatcher(engine, kv_budget=KVBudget(page_size=8, tokens=128))
    assert batcher.admission == Admission(CONFIG.vocab_size, MAX_SEQ_LEN, MAX_SEQ_LEN)
    batcher.submit(prompt, max_tokens=fits).cancel()  # queued, never run
    with pytest.raises(CacheOverflowError, match="max_tokens"):
        batcher.submit(prompt, max_tokens=too_many)


def _run(max_new_tokens: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxpar.cli", "--cpu-devices", "1", "run"]
    command += ["--model", "tiny-gqa", "--max-seq-len", str(MAX_SEQ_LEN), "--prompt", "1,2,3"]
    command += ["--max-new-tokens", str(max_new_tokens)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.server
def test_jaxpar_run_accepts_the_exact_fit_the_engine_accepts():
    exact = _run(MAX_SEQ_LEN + 1 - 3)  # 3 prompt tokens + 30 new - 1 = 32 cached
    assert exact.returncode == 0, exact.stdout + exact.stderr
    over = _run(MAX_SEQ_LEN + 2 - 3)
    assert over.returncode == 2 and "lower --max-new-tokens to at most 30" in over.stdout, (
        over.stdout + over.stderr
    )


CASES = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.0, "top_k": 5},
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_p": 0.8},
    {"temperature": 1.2, "top_k": 0},
    {"temperature": 0.5, "top_k": 3, "top_p": 0.9},
]
BASES = [Sampling(), Sampling(temperature=0.6, top_k=20, top_p=0.95)]


@pytest.mark.parametrize("base", BASES, ids=["greedy-default", "sampled-default"])
@pytest.mark.parametrize("fields", CASES, ids=[str(c) or "none" for c in CASES])
def test_command_line_and_server_merge_sampling_the_same(base, fields):
    args = argparse.Namespace(**({"temperature": None, "top_k": None, "top_p": None} | fields))
    defaults = GenerationDefaults(sampling=base)
    from_cli, _ = choose_sampling(args, defaults)
    service = Service(batcher=None, model=ServedModel(name="m", sampling=base))
    body = CompletionRequest(model="m", prompt="x", **fields)
    assert from_cli == service.sampling(body)
    if fields.get("temperature") == 0.0:
        assert from_cli.greedy
    if "temperature" not in fields and ("top_k" in fields or "top_p" in fields):
        assert from_cli.temperature == (base.temperature or 1.0)  # they ask to sample


def test_server_room_is_the_batcher_admission(engine):
    """The server's default max_tokens is what the batcher's admission says fits."""
    batcher = ContinuousBatcher(engine, kv_budget=KVBudget(page_size=8, tokens=128))
    service = Service(batcher, ServedModel(name="m"))
    body = CompletionRequest(model="m", prompt=[1] * 10)
    assert service._max_tokens(body, [1] * 10, "prompt") == batcher.admission.room(10) == 23
