"""Served benchmarks for ``bench_serving.py``: ``jaxpar serve`` as its own process, measured
by an HTTP client, each with and without the feature in the same run.

* ``prefix``: requests sharing a long system prompt, with the prefix cache and with
  ``--no-prefix-caching``: time to first token on a hit against a miss, prompt tokens
  computed against the unshared suffixes, and the hit rate.
* ``chunked``: a long prompt arriving while requests stream, with chunked prefill (the
  default ``--max-prefill-tokens``) and with the prompt prefilled whole: each running
  stream's longest gap between two tokens against its median time per output token.

The model is the other sections' (:func:`bench_serving.bench_model`, random weights),
written once as a Hugging Face Llama checkpoint with a word-level tokenizer (token ``i`` is
the word ``t<i>``, so every token streams as its own text); prompts are token ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "bench"
READY_TIMEOUT_S = 900  # start-up and warm-up compiles on a busy 2-core machine


# --- the checkpoint ------------------------------------------------------------------------


def llama_tensors(config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random Llama weights in Hugging Face's names and layouts (``[out, in]``), scaled
    ``1 / sqrt(in)`` so activations stay finite over every layer."""
    rng = np.random.default_rng(seed)
    d, hd, f = config.d_model, config.head_dim, config.d_ff

    def dense(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    t = {
        "model.embed_tokens.weight": rng.standard_normal((config.vocab_size, d)).astype(np.float32),
        "model.norm.weight": np.ones(d, np.float32),
        "lm_head.weight": dense(config.vocab_size, d),
    }
    for i in range(config.n_layers):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = np.ones(d, np.float32)
        t[pre + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
        t[pre + "self_attn.q_proj.weight"] = dense(config.n_heads * hd, d)
        t[pre + "self_attn.k_proj.weight"] = dense(config.n_kv_heads * hd, d)
        t[pre + "self_attn.v_proj.weight"] = dense(config.n_kv_heads * hd, d)
        t[pre + "self_attn.o_proj.weight"] = dense(d, config.n_heads * hd)
        t[pre + "mlp.gate_proj.weight"] = dense(f, d)
        t[pre + "mlp.up_proj.weight"] = dense(f, d)
        t[pre + "mlp.down_proj.weight"] = dense(d, f)
    return t


def word_tokenizer(vocab_size: int):
    """A word-level ``tokenizers.Tokenizer``: id ``i`` is the word ``t<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def write_checkpoint(root: Path, config, name: str | None = None) -> Path:
    """``config`` (a llama-architecture ``ModelConfig``; ``embed.tied`` honoured) as a
    checkpoint directory under ``root`` (``name``, default ``bench-llama-<positions>``):
    config.json, model.safetensors (random weights), a word-level tokenizer.json and a
    tokenizer_config.json naming its class (vLLM's ``AutoTokenizer`` needs it). Kept between
    runs (same config, same files)."""
    from safetensors.numpy import save_file

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.d_ff,
        "rms_norm_eps": config.norms.eps,
        "rope_theta": config.rope.theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.embed.tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path = root / (name or f"bench-llama-{config.max_position_embeddings}")
    if (path / "config.json").is_file() and json.loads((path / "config.json").read_text()) == hf:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tensors = llama_tensors(config)
    if config.embed.tied:
        del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    word_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "t1",
        "eos_token": "t2",
        "unk_token": "t0",
        "model_max_length": config.max_position_embeddings,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (path / "config.json").write_text(json.dumps(hf, indent=1))  # last: marks it complete
    return path


# --- the server ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``jaxpar --cpu-devices 1 serve --hf CHECKPOINT ARGS`` in a subprocess of this
    checkout (``root``: of another, e.g. the code before a change), its log in
    ``log_dir``; ready once ``/health`` answers 200."""

    def __init__(
        self,
        checkpoint: Path,
        args: Sequence[str],
        log_dir: Path,
        cache_dir: Path,
        root: Path = ROOT,
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        checkpoint, cache_dir = checkpoint.resolve(), cache_dir.resolve()  # cwd is root
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"serve-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)  # --cpu-devices sets the device count
        self.command = [
            sys.executable, "-m", "jaxpar.cli", "--cpu-devices", "1",
            "--compile-cache", str(cache_dir), "serve", "--hf", str(checkpoint),
            "--served-model-name", SERVED_NAME, "--port", str(self.port),
            "--log-level", "info", *args,
        ]  # fmt: skip
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.start_s = float("nan")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Server:
        import httpx

        began = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{' '.join(self.command)} exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.start_s = time.perf_counter() - began
                    return self
            if time.perf_counter() - began > timeout:
                raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def wait_idle(self, timeout: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            status = httpx.get(f"{self.url}/health", timeout=10).json()
            if not status.get("active") and not status.get("queued"):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {status}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        import httpx

        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each sample's name (labels dropped) -> the sum over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


# --- the client ----------------------------------------------------------------------------


@dataclasses.dataclass
class Completion:
    """One streamed completion as the client saw it: when it was sent, when each token
    arrived (tokens of one chunk share its time), and its usage."""

    prompt_tokens: int
    sent: float
    token_times: list[float] = dataclasses.field(default_factory=list)
    usage: dict[str, Any] = dataclasses.field(default_factory=dict)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return None if cached is None else int(cached)

    def gaps(self) -> np.ndarray:
        """Seconds between consecutive tokens (the first token's wait left out)."""
        return np.diff(np.asarray(self.token_times))


def stream_completion(
    client,
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    on_token: Callable[[Completion], bool] | None = None,
) -> Completion:
    """``POST /v1/completions`` streamed, greedy, EOS ignored. ``on_token(completion)``
    after each chunk: returning True hangs up (the server cancels the request)."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    done = Completion(len(prompt), time.perf_counter())
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            now, chunk = time.perf_counter(), json.loads(data)
            if chunk.get("usage"):
                done.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids")
                n = len(ids) if ids is not None else int(bool(choice.get("text")))
                done.token_times += [now] * n
                done.finish_reason = choice.get("finish_reason") or done.finish_reason
            if on_token is not None and done.token_times and on_token(done):
                break
    return done


def _client():
    import httpx

    return httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))


def _median_ms(xs) -> float:
    return 1e3 * float(np.median(xs)) if len(xs) else float("nan")


# --- prefix caching ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefixSetup:
    system: int = 1024  # shared prompt tokens
    question: tuple[int, int] = (16, 64)  # each request's own tokens, uniform
    requests: int = 32
    max_tokens: int = 8
    page_size: int = 16


PREFIX = PrefixSetup()
PREFIX_QUICK = PrefixSetup(system=256, requests=8)


def _prefix_prompts(
    setup: PrefixSetup, vocab: int, seed: int, system: list[int] | None = None
) -> list[list[int]]:
    """A system prompt (``seed``'s, unless given) and a question per request. The question
    lengths are the same for every seed: each pass runs the programs the warm-up compiled."""
    lengths = np.random.default_rng(0).integers(
        setup.question[0], setup.question[1] + 1, setup.requests
    )
    rng = np.random.default_rng(seed)
    system = system or rng.integers(1, vocab, setup.system).tolist()
    return [system + rng.integers(1, vocab, int(n)).tolist() for n in lengths]


def _prefix_pass(server: Server, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
    """The prompts one after another (each alone on the server)."""
    with _client() as client:
        return [stream_completion(client, server.url, p, max_tokens) for p in prompts]


def _burst(server: Server, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """The prompts all at once; wall time to the last token, TTFT p50."""
    results: list[Completion | None] = [None] * len(prompts)
    with _client() as client:

        def one(i: int) -> None:
            results[i] = stream_completion(client, server.url, prompts[i], max_tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    done = [r for r in results if r is not None]
    if len(done) != len(prompts):
        raise RuntimeError("a burst request failed")
    return {
        "wall_s": max(r.token_times[-1] for r in done) - start,
        "ttft_p50_ms": _median_ms([r.ttft for r in done]),
        "cached_tokens": sum(r.cached_tokens or 0 for r in done),
    }


PREFIX_METRICS = ("jaxpar:prefix_cache_queries_total", "jaxpar:prefix_cache_hits_total")


def _metric_delta(before: dict, after: dict, name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def summarize_prefix(
    setup: PrefixSetup, runs: list[Completion], counters: dict[str, float | None]
) -> dict[str, Any]:
    """One server's sequential pass: the first request (a miss), the rest (hits when the
    cache works), prompt tokens computed against the suffixes past the shared prompt."""
    cached = [r.cached_tokens for r in runs]
    known = all(c is not None for c in cached)
    if not known and counters.get("queries") is not None:  # the counters instead
        cached_total = counters["hits"]
    else:
        cached_total = sum(c or 0 for c in cached)
    prompt_total = sum(r.prompt_tokens for r in runs)
    suffix = [r.prompt_tokens - setup.system for r in runs]
    rest = runs[1:]
    rest_cached = sum(c or 0 for c in cached[1:]) if known else None
    out = {
        "ttft_first_ms": 1e3 * runs[0].ttft,
        "ttft_rest_p50_ms": _median_ms([r.ttft for r in rest]),
        "ttft_all_p50_ms": _median_ms([r.ttft for r in runs]),
        "prompt_tokens": prompt_total,
        "suffix_tokens": sum(suffix),
        "cached_tokens": cached_total,
        "computed_over_suffix": (prompt_total - cached_total) / sum(suffix),
        "cached_per_request": cached,
        "counters": counters,
        "hit_rate": cached_total / prompt_total,
    }
    if rest_cached is not None:
        rest_prompt = sum(r.prompt_tokens for r in rest)
        out["rest_computed_over_suffix"] = (rest_prompt - rest_cached) / sum(suffix[1:])
    if counters.get("queries"):
        out["counter_hit_rate"] = counters["hits"] / counters["queries"]
    return out


def prefix_section(
    checkpoint: Path, vocab: int, work_dir: Path, quick: bool = False
) -> dict[str, Any]:
    """Two servers, one after the other (prefix caching on, then off): each warmed with a
    pass over another system prompt (the same question lengths), then the measured pass,
    then a burst of new questions twice (the first compiles, the second is measured)."""
    setup = PREFIX_QUICK if quick else PREFIX
    longest = setup.system + setup.question[1] + setup.max_tokens
    max_seq_len = -(-longest // 256) * 256
    common = [
        "--max-seq-len", str(max_seq_len), "--max-num-seqs", "16",
        "--kv-cache-tokens", str(4 * max_seq_len * 8), "--page-size", str(setup.page_size),
    ]  # fmt: skip
    warm = _prefix_prompts(setup, vocab, seed=10)
    measured = _prefix_prompts(setup, vocab, seed=11)
    system = measured[0][: setup.system]  # the bursts: its system prompt, new questions
    bursts = [_prefix_prompts(setup, vocab, seed, system) for seed in (12, 13)]
    systems: dict[str, Any] = {}
    for name, flags in (("prefix caching", []), ("no prefix caching", ["--no-prefix-caching"])):
        with Server(checkpoint, [*common, *flags], work_dir / "logs", work_dir / "xla") as srv:
            srv.wait_ready()
            _prefix_pass(srv, warm, setup.max_tokens)  # compiles the lengths used below
            srv.wait_idle()
            before = srv.metrics()
            runs = _prefix_pass(srv, measured, setup.max_tokens)
            srv.wait_idle()
            after = srv.metrics()
            counters = {
                k: _metric_delta(before, after, m)
                for k, m in zip(("queries", "hits"), PREFIX_METRICS, strict=True)
            }
            res = summarize_prefix(setup, runs, counters)
            _burst(srv, bursts[0], setup.max_tokens)  # compiles its batches' programs
            srv.wait_idle()
            res["burst"] = _burst(srv, bursts[1], setup.max_tokens)
            res["server_start_s"] = srv.start_s
            res["flags"] = " ".join([*common, *flags])
            systems[name] = res
    on, off = systems["prefix caching"], systems["no prefix caching"]
    return {
        "setup": {**dataclasses.asdict(setup), "max_seq_len": max_seq_len},
        "systems": systems,
        "hit_over_miss_ttft": on["ttft_rest_p50_ms"] / off["ttft_all_p50_ms"],
        "hit_over_first_ttft": on["ttft_rest_p50_ms"] / on["ttft_first_ms"],
    }


def _goal(value: float, goal: float) -> str:
    return f"goal <= {goal:g}: **{'pass' if value <= goal else 'FAIL'}**"


def prefix_markdown(res: dict) -> str:
    s, on, off = res["setup"], res["systems"]["prefix caching"], res["systems"]["no prefix caching"]
    lines = [
        f"Served (`jaxpar serve`, one CPU device, a process of its own; HTTP client, streamed "
        f"completions of token ids). {s['requests']} requests share a {s['system']}-token "
        f"system prompt, each with its own question of {s['question'][0]}..{s['question'][1]} "
        f"tokens; greedy, {s['max_tokens']} new tokens; sent one at a time after a warm-up "
        f"pass over another system prompt (the same question lengths); pages of "
        f"{s['page_size']} tokens; max_seq_len {s['max_seq_len']}. Burst: {s['requests']} new "
        "questions at once after the pass (after a burst that compiles).",
        "",
        "| server | TTFT first ms | TTFT rest p50 ms | cached tokens | computed / suffix "
        "(all) | computed / suffix (rest) | hit rate | burst of "
        f"{s['requests']}: s, TTFT p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["systems"].items():
        rest = m.get("rest_computed_over_suffix", float("nan"))
        b = m["burst"]
        lines.append(
            f"| {name} | {m['ttft_first_ms']:.1f} | {m['ttft_rest_p50_ms']:.1f} | "
            f"{m['cached_tokens']} / {m['prompt_tokens']} | {m['computed_over_suffix']:.2f} | "
            f"{rest:.2f} | {100 * m['hit_rate']:.1f}% | {b['wall_s']:.2f}, "
            f"{b['ttft_p50_ms']:.1f} |"
        )
    ratio = res["hit_over_miss_ttft"]
    rest = on.get("rest_computed_over_suffix", float("nan"))
    counters = on["counters"]
    lines += [
        "",
        f"- TTFT on a hit / on a miss: **{ratio:.3f}** ({on['ttft_rest_p50_ms']:.1f} ms, the "
        f"median of requests 2..{s['requests']} with the cache, against "
        f"{off['ttft_all_p50_ms']:.1f} ms, the median without; {_goal(ratio, 0.2)}); against "
        f"the cached server's own first request ({on['ttft_first_ms']:.1f} ms): "
        f"{res['hit_over_first_ttft']:.3f}.",
        f"- Prompt tokens computed / unshared suffix tokens, on the hits: **{rest:.3f}** "
        f"({_goal(rest, 1.1)}); over all {s['requests']} (the first computes the system prompt): "
        f"{on['computed_over_suffix']:.3f}; without the cache: {off['computed_over_suffix']:.3f}.",
        f"- Hit rate (cached / prompt tokens): **{100 * on['hit_rate']:.1f}%** of "
        f"{on['prompt_tokens']}"
        + (
            f"; `/metrics` counted {counters['hits']:.0f} hits of {counters['queries']:.0f} "
            f"queried tokens ({100 * on['counter_hit_rate']:.1f}%)"
            if counters.get("queries")
            else "; `/metrics` had no prefix-cache counters"
        )
        + ".",
    ]
    return "\n".join(lines)


# --- chunked prefill -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkedSetup:
    streams: int = 8  # requests decoding when the long prompt arrives
    stream_prompt: int = 32
    long_prompt: int = 4096
    long_max_tokens: int = 8
    head: int = 48  # tokens every stream has before the long prompt is sent
    tail: int = 48  # tokens every stream gets after the long request's last, then hangs up
    page_size: int = 16

    @property
    def max_seq_len(self) -> int:
        return self.long_prompt + 128


CHUNKED = ChunkedSetup()
CHUNKED_QUICK = ChunkedSetup(long_prompt=1024, head=16, tail=16)


class _Streams:
    """Requests streaming in threads. A reader never blocks (a blocked reader would see its
    tokens arrive in a heap later): each counts itself once it has ``head`` tokens, and
    hangs up ``tail`` tokens after :meth:`finish` is called."""

    def __init__(self, client, url: str, prompts: list[list[int]], max_tokens: int, head, tail):
        self.client, self.url, self.max_tokens = client, url, max_tokens
        self.head, self.tail = head, tail
        self.prompts = prompts
        self.results: list[Completion | None] = [None] * len(prompts)
        self.errors: list[BaseException] = []
        self._headed, self._count = threading.Condition(), 0
        self._finish = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(prompts))]

    def start(self) -> _Streams:
        for t in self._threads:
            t.start()
        return self

    def wait_headed(self, timeout: float = 600) -> None:
        with self._headed:
            self._headed.wait_for(
                lambda: self._count == len(self.prompts) or self.errors, timeout=timeout
            )
        if self.errors:
            raise self.errors[0]

    def finish(self) -> list[Completion]:
        self._finish.set()
        for t in self._threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return [r for r in self.results if r is not None]

    def _counted(self) -> None:
        with self._headed:
            self._count += 1
            self._headed.notify_all()

    def _run(self, i: int) -> None:
        counted, mark = False, 0  # mark: tokens when finish() was seen

        def on_token(c: Completion) -> bool:
            nonlocal counted, mark
            n = len(c.token_times)
            if not counted and n >= self.head:
                counted = True
                self._counted()
            if self._finish.is_set():
                mark = mark or n
                return n - mark >= self.tail
            return bool(self.errors)

        try:
            self.results[i] = stream_completion(
                self.client, self.url, self.prompts[i], self.max_tokens, on_token=on_token
            )
        except BaseException as e:  # raised by wait_headed or finish
            self.errors.append(e)
            with self._headed:
                self._headed.notify_all()


#: Where a stream's gaps fall against the long request: before it was sent, while it was
#: prefilled (sent to its first token), while it decoded (first to last token), after.
PHASES = ("before", "prefill", "long decode", "after")


def _gap_stats(c: Completion, long: Completion) -> dict[str, Any]:
    """A stream's longest gap and median gap (its TPOT); its steady TPOT (median gap
    before the long prompt was sent: nothing prefilled in between); and its longest gap in
    each of :data:`PHASES` (a gap counts in every phase it overlaps)."""
    times = np.asarray(c.token_times)
    gaps, start, end = np.diff(times), times[:-1], times[1:]
    sent, first, last = long.sent, long.token_times[0], long.token_times[-1]
    steady = gaps[end <= sent]
    phases = {
        "before": end <= sent,
        "prefill": (end > sent) & (start < first),
        "long decode": (end > first) & (start < last),
        "after": start >= last,
    }
    return {
        "tokens": len(times),
        "longest_gap_ms": 1e3 * float(gaps.max()),
        "tpot_p50_ms": _median_ms(gaps),
        "steady_tpot_p50_ms": _median_ms(steady),
        "gap_over_tpot": float(gaps.max() / np.median(gaps)),
        "gap_over_steady_tpot": float(gaps.max() / np.median(steady)) if len(steady) else np.nan,
        "longest_gap_ms_by_phase": {
            k: 1e3 * float(gaps[m].max()) if m.any() else np.nan for k, m in phases.items()
        },
    }


def _long_prompt_among_streams(
    server: Server, setup: ChunkedSetup, vocab: int, seed: int
) -> dict[str, Any]:
    """``setup.streams`` requests stream; once each has ``head`` tokens the long prompt is
    sent; each stream hangs up ``tail`` tokens after the long request's last token."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, setup.stream_prompt).tolist() for _ in range(setup.streams)]
    long_prompt = rng.integers(1, vocab, setup.long_prompt).tolist()
    room = setup.max_seq_len - setup.stream_prompt + 1
    with _client() as client:
        streams = _Streams(client, server.url, prompts, room, setup.head, setup.tail).start()
        try:
            streams.wait_headed()
            long = stream_completion(client, server.url, long_prompt, setup.long_max_tokens)
        finally:
            done = streams.finish()
    if any(r.finish_reason == "length" for r in done):
        raise RuntimeError("a stream ran out of tokens before the long request ended")
    return {
        "long_ttft_ms": 1e3 * long.ttft,
        "streams": [_gap_stats(r, long) for r in done],
    }


def chunked_section(
    checkpoint: Path,
    vocab: int,
    work_dir: Path,
    quick: bool = False,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """Two servers, one after the other: the default ``--max-prefill-tokens`` (chunked
    prefill), then one larger than the long prompt (prefilled whole); with ``baseline``
    (another checkout, e.g. the code before a change) first its server at its defaults.
    Each runs the scenario twice: the first compiles what it needs, the second is
    measured."""
    setup = CHUNKED_QUICK if quick else CHUNKED
    common = [
        "--max-seq-len", str(setup.max_seq_len), "--max-num-seqs", "16",
        "--kv-cache-tokens", str(2 * setup.max_seq_len + setup.streams * setup.max_seq_len),
        "--page-size", str(setup.page_size),
    ]  # fmt: skip
    whole = 4 * setup.long_prompt  # past a chunk and the budget of any row bucket
    systems: dict[str, Any] = {}
    runs = [
        ("chunked prefill (default)", [], ROOT),
        (f"whole prefill (--max-prefill-tokens {whole})", ["--max-prefill-tokens", str(whole)], ROOT),
    ]  # fmt: skip
    if baseline is not None:
        runs.insert(0, (f"before: {baseline.name} (default)", [], baseline))
    for name, flags, root in runs:
        args = [*common, *flags]
        with Server(checkpoint, args, work_dir / "logs", work_dir / "xla", root) as srv:
            srv.wait_ready()
            _long_prompt_among_streams(srv, setup, vocab, seed=20)  # warm-up: compiles
            srv.wait_idle()
            res = _long_prompt_among_streams(srv, setup, vocab, seed=21)
            srv.wait_idle()
            each = res["streams"]
            ratios = [s["gap_over_tpot"] for s in each]
            res |= {
                "worst_gap_over_tpot": max(ratios),
                "median_gap_over_tpot": float(np.median(ratios)),
                "worst_gap_over_steady_tpot": max(s["gap_over_steady_tpot"] for s in each),
                "longest_gap_ms": max(s["longest_gap_ms"] for s in each),
                "longest_gap_ms_by_phase": {
                    k: max(s["longest_gap_ms_by_phase"][k] for s in each) for k in PHASES
                },
                "tpot_p50_ms": float(np.median([s["tpot_p50_ms"] for s in each])),
                "steady_tpot_p50_ms": float(np.median([s["steady_tpot_p50_ms"] for s in each])),
                "server_start_s": srv.start_s,
                "flags": " ".join([*common, *flags]),
            }
            systems[name] = res
    return {"setup": {**dataclasses.asdict(setup), "max_seq_len": setup.max_seq_len},
            "systems": systems}  # fmt: skip


def chunked_markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        f"Served (`jaxpar serve`, one CPU device, a process of its own; HTTP client). "
        f"{s['streams']} requests ({s['stream_prompt']}-token prompts, greedy) are streaming "
        f"when a {s['long_prompt']}-token prompt arrives (each has {s['head']} tokens by "
        f"then); each hangs up {s['tail']} tokens after the long request's last. Per stream: "
        "the longest gap between two of its tokens, its median time per output token (TPOT: "
        "its median gap, the long prompt's prefill included) and its steady TPOT (median gap "
        "before the long prompt was sent). Each server runs the scenario once to compile, "
        "then once measured.",
        "",
        "| server | long prompt TTFT ms | TPOT p50 ms | steady TPOT p50 ms | longest gap ms "
        "| longest gap / TPOT: worst stream | median stream | goal <= 3 | longest gap / "
        "steady TPOT: worst stream |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["systems"].items():
        verdict = "pass" if m["worst_gap_over_tpot"] <= 3 else "FAIL"
        lines.append(
            f"| {name} | {m['long_ttft_ms']:.0f} | {m['tpot_p50_ms']:.1f} | "
            f"{m['steady_tpot_p50_ms']:.1f} | {m['longest_gap_ms']:.0f} | "
            f"**{m['worst_gap_over_tpot']:.1f}** | {m['median_gap_over_tpot']:.1f} | {verdict} | "
            f"{m['worst_gap_over_steady_tpot']:.1f} |"
        )
    lines += [
        "",
        "TPOT p50 and steady TPOT p50: the median over streams; longest gap: over all of them.",
        "",
        "Where the longest gaps fall (ms, over all streams; a gap counts in every phase it "
        "overlaps): before the long prompt was sent, while it was prefilled (sent to its "
        "first token), while it decoded (a row of its context in every decode step), after.",
        "",
        "| server | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for name, m in res["systems"].items():
        by = m["longest_gap_ms_by_phase"]
        lines.append(f"| {name} | " + " | ".join(f"{by[k]:.0f}" for k in PHASES) + " |")
    lines += [
        "",
        "Per stream (longest gap ms / TPOT p50 ms / steady TPOT p50 ms):",
        "",
    ]
    for name, m in res["systems"].items():
        each = ", ".join(
            f"{x['longest_gap_ms']:.0f}/{x['tpot_p50_ms']:.1f}/{x['steady_tpot_p50_ms']:.1f}"
            for x in m["streams"]
        )
        lines.append(f"- {name}: {each}")
    return "\n".join(lines)
