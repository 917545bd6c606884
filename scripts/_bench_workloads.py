"""The ``workloads`` and ``vs-vllm`` sections of ``bench_serving.py``: issue 41's serving
workloads against an OpenAI-compatible server, measured by a streaming HTTP client.

* ``saturated``: Poisson arrivals faster than the server serves, a fixed output length
  (EOS ignored): output tokens/s, TTFT p50, TPOT p50, ITL p99.
* ``light``: Poisson arrivals far apart (each request mostly alone): TTFT p50, TPOT p50,
  ITL p99.
* ``prefix``: every prompt starts with one shared prefix, then its own question: TTFT p50,
  TPOT p50.
* ``long``: streams decoding when a long prompt arrives: the streams' ITL p99 against their
  TPOT p50.

TPOT is a request's ``(last token - first token) / (tokens - 1)``; ITL the gaps between
consecutive tokens of every request (tokens of one streamed chunk share its arrival time).
The server is ``jaxpar serve`` at its defaults (:func:`jaxpar_server`), or any server at a
URL serving the model as ``bench`` (vLLM: ``--served-model-name bench``). Prompts are
token ids, so any tokenizer of the model's vocabulary serves them alike.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import _bench_served as served
import numpy as np

# --- the workloads -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Poisson:
    """``requests`` at ``rate``/s (Poisson); each prompt a ``shared``-token prefix common to
    all, then its own ``prompt`` (inclusive range) tokens; ``max_tokens`` each."""

    requests: int
    rate: float
    prompt: tuple[int, int]
    max_tokens: int
    shared: int = 0

    def prompts(self, vocab: int, seed: int) -> tuple[np.ndarray, list[list[int]]]:
        """Arrival offsets (s, the first at 0) and prompts."""
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / self.rate, self.requests))
        prefix = rng.integers(1, vocab, self.shared).tolist()
        lengths = rng.integers(self.prompt[0], self.prompt[1] + 1, self.requests)
        return arrivals - arrivals[0], [
            prefix + rng.integers(1, vocab, int(n)).tolist() for n in lengths
        ]


@dataclasses.dataclass(frozen=True)
class Workloads:
    saturated: Poisson
    light: Poisson
    prefix: Poisson
    long: served.ChunkedSetup


#: Issue 41's shapes: 64 requests at 16/s; 0.2 requests/s; a 768-token prefix shared by 32
#: requests at 2/s; a 1,600-token prompt among 8 streams.
FULL = Workloads(
    saturated=Poisson(64, 16.0, (64, 256), 128),
    light=Poisson(12, 0.2, (64, 256), 128),
    prefix=Poisson(32, 2.0, (16, 64), 64, shared=768),
    long=served.ChunkedSetup(long_prompt=1600, head=16, tail=32),
)
#: A smoke run (seconds on a small model): the same shapes, few requests, short outputs.
QUICK = Workloads(
    saturated=Poisson(8, 16.0, (8, 32), 8),
    light=Poisson(3, 1.0, (8, 32), 8),
    prefix=Poisson(6, 4.0, (4, 16), 8, shared=64),
    long=served.ChunkedSetup(streams=4, stream_prompt=16, long_prompt=128, head=4, tail=4),
)


# --- the client ----------------------------------------------------------------------------


def run_poisson(url: str, work: Poisson, vocab: int, seed: int) -> list[served.Completion]:
    """Every request sent at its arrival time from a thread of its own, streamed."""
    arrivals, prompts = work.prompts(vocab, seed)
    results: list[served.Completion | None] = [None] * work.requests
    errors: list[BaseException] = []
    with served._client() as client:

        def one(i: int) -> None:
            try:
                results[i] = served.stream_completion(client, url, prompts[i], work.max_tokens)
            except BaseException as e:  # re-raised below
                errors.append(e)

        start = time.perf_counter() + 0.05
        threads = []
        for i, offset in enumerate(arrivals):
            delay = start + float(offset) - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            threads.append(threading.Thread(target=one, args=(i,)))
            threads[-1].start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def run_long(url: str, setup: served.ChunkedSetup, vocab: int, seed: int) -> dict[str, Any]:
    """``setup.streams`` requests stream; once each has ``head`` tokens the long prompt is
    sent; each stream hangs up ``tail`` tokens after the long request's last token."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, setup.stream_prompt).tolist() for _ in range(setup.streams)]
    long_prompt = rng.integers(1, vocab, setup.long_prompt).tolist()
    room = setup.max_seq_len - setup.stream_prompt + 1
    with served._client() as client:
        streams = served._Streams(client, url, prompts, room, setup.head, setup.tail).start()
        try:
            streams.wait_headed()
            long = served.stream_completion(client, url, long_prompt, setup.long_max_tokens)
        finally:
            done = streams.finish()
    return {"streams": done, "long": long}


# --- the figures ---------------------------------------------------------------------------


def _ms(xs, q: float) -> float:
    return 1e3 * float(np.percentile(xs, q)) if len(xs) else float("nan")


def _tpot(c: served.Completion) -> float:
    t = c.token_times
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")


def summarize(runs: list[served.Completion], max_tokens: int | None) -> dict[str, Any]:
    """Output tokens/s over the run (first send to last token), TTFT, TPOT and ITL
    percentiles; ``complete``: requests that got ``max_tokens`` tokens (all of them when
    ``max_tokens`` is None)."""
    start = min(c.sent for c in runs)
    end = max(c.token_times[-1] for c in runs)
    tokens = [len(c.token_times) for c in runs]
    gaps = np.concatenate([c.gaps() for c in runs])
    tpots = [x for x in map(_tpot, runs) if np.isfinite(x)]
    return {
        "requests": len(runs),
        "complete": sum(n == max_tokens or max_tokens is None and n > 0 for n in tokens),
        "output_tokens": int(sum(tokens)),
        "usage_tokens": int(sum(c.usage.get("completion_tokens", 0) for c in runs)),
        "seconds": end - start,
        "output_tokens_per_s": sum(tokens) / (end - start),
        "ttft_p50_ms": _ms([c.ttft for c in runs], 50),
        "ttft_p99_ms": _ms([c.ttft for c in runs], 99),
        "tpot_p50_ms": _ms(tpots, 50),
        "itl_p50_ms": _ms(gaps, 50),
        "itl_p99_ms": _ms(gaps, 99),
    }


def summarize_long(res: dict[str, Any]) -> dict[str, Any]:
    """The streams' figures (the long request's own TTFT apart) and ITL p99 / TPOT p50."""
    out = summarize(res["streams"], None)
    out["long_ttft_ms"] = 1e3 * res["long"].ttft
    out["long_tokens"] = len(res["long"].token_times)
    out["itl_p99_over_tpot_p50"] = out["itl_p99_ms"] / out["tpot_p50_ms"]
    return out


def run_workloads(url: str, works: Workloads, vocab: int, probe=None) -> dict[str, Any]:
    """Every workload once against ``url``, one after another (the server idle between);
    ``probe()`` (optional) reads server-side counters before and after each: its
    ``delta(before, after, seconds)`` lands in the results as ``profile``."""
    out: dict[str, Any] = {}
    for i, name in enumerate(("saturated", "light", "prefix", "long")):
        work = getattr(works, name)
        before = probe.read() if probe else None
        began = time.perf_counter()
        if name == "long":
            res = summarize_long(run_long(url, work, vocab, seed=40 + i))
            res["sent"] = work.streams
        else:
            res = summarize(run_poisson(url, work, vocab, seed=40 + i), work.max_tokens)
            res["sent"] = work.requests
        if probe:
            probe.wait_idle()
            res["profile"] = probe.delta(before, probe.read(), time.perf_counter() - began)
        out[name] = res
    return out


# --- the checkpoint and the server ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """A checkpoint the workloads serve: its directory's name and its model."""

    name: str
    config: Any  # a llama-architecture jaxpar ModelConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def _llama(d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab_size) -> Any:
    """A tied-embedding Llama of these sizes (RoPE theta 1e5, 8,192 positions)."""
    from jaxpar.models import EmbedConfig, ModelConfig, RopeConfig

    return ModelConfig(
        arch="llama", d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=d_ff, vocab_size=vocab_size,
        max_position_embeddings=8192, rope=RopeConfig(theta=100000.0),
        embed=EmbedConfig(tied=True),
    )  # fmt: skip


#: SmolLM2-135M-Instruct's published shape (LlamaForCausalLM, tied embeddings).
SMOLLM2 = Shape("smollm2-135m-shape", _llama(576, 30, 9, 3, 64, 1536, 49152))
#: A small Llama (tied): the smoke test's, compiled in seconds.
TINY = Shape("tiny", _llama(64, 2, 4, 2, 16, 128, 512))
SHAPES = {"smollm2": SMOLLM2, "tiny": TINY}


def write_checkpoint(root: Path, shape: Shape) -> Path:
    """``shape`` with random weights as a Hugging Face checkpoint under ``root`` (see
    ``served.write_checkpoint``; id ``i`` of its word-level tokenizer is ``t<i>``)."""
    return served.write_checkpoint(root, shape.config, shape.name)


#: What the workloads give ``jaxpar serve`` beyond its defaults (with ``--served-model-name``
#: and ``--port``, which :class:`served.Server` adds): issue 41's "each at its defaults".
DEFAULT_FLAGS = ("--dtype", "float32", "--max-seq-len", "2048")


def jaxpar_server(checkpoint: Path, work_dir: Path, quick: bool) -> served.Server:
    """``jaxpar serve`` at its defaults; ``quick`` warms up lazily (a smoke run must not wait
    for every bucket's compile)."""
    flags = [*DEFAULT_FLAGS, *(["--warmup", "lazy"] if quick else [])]
    return served.Server(checkpoint, flags, work_dir / "logs", work_dir / "xla")


# --- the sections --------------------------------------------------------------------------


def _jaxpar_run(work_dir: Path, shape: Shape, quick: bool, vllm_url: str | None):
    import _bench_profile as profile

    works = QUICK if quick else FULL
    checkpoint = write_checkpoint(work_dir, shape)
    with jaxpar_server(checkpoint, work_dir, quick) as srv:
        srv.wait_ready()
        jaxpar = run_workloads(srv.url, works, shape.vocab_size, probe=profile.Probe(srv))
        start_s, flags = srv.start_s, " ".join(srv.command[srv.command.index("--cpu-devices") :])
    setup = {
        "model": f"{shape.name} (random weights, word-level tokenizer)",
        "checkpoint": str(checkpoint),
        "jaxpar": flags,
        "jaxpar_start_s": start_s,
        "workloads": {
            k: dataclasses.asdict(getattr(works, k))
            for k in ("saturated", "light", "prefix", "long")
        },
    }
    res: dict[str, Any] = {"setup": setup, "jaxpar": jaxpar}
    if vllm_url:  # after jaxpar's server is gone: one system at a time
        res["vllm"] = run_workloads(vllm_url.rstrip("/"), works, shape.vocab_size)
        res["setup"]["vllm_url"] = vllm_url
    return res


def workloads_section(work_dir: Path, shape: Shape, quick: bool = False) -> dict[str, Any]:
    """Issue 41's workloads against ``jaxpar serve`` at its defaults, with the server's
    breakdown of each."""
    return _jaxpar_run(work_dir, shape, quick, None)


def vs_vllm_section(
    work_dir: Path, shape: Shape, vllm_url: str, quick: bool = False
) -> dict[str, Any]:
    """The same workloads against ``jaxpar serve`` and then the server at ``vllm_url``."""
    return _jaxpar_run(work_dir, shape, quick, vllm_url)


#: (workload, figure, label) of the tables.
FIGURES = (
    ("saturated", "output_tokens_per_s", "output tok/s"),
    ("saturated", "ttft_p50_ms", "TTFT p50 ms"),
    ("saturated", "tpot_p50_ms", "TPOT p50 ms"),
    ("saturated", "itl_p99_ms", "ITL p99 ms"),
    ("light", "ttft_p50_ms", "TTFT p50 ms"),
    ("light", "tpot_p50_ms", "TPOT p50 ms"),
    ("light", "itl_p99_ms", "ITL p99 ms"),
    ("prefix", "ttft_p50_ms", "TTFT p50 ms"),
    ("prefix", "tpot_p50_ms", "TPOT p50 ms"),
    ("long", "itl_p99_ms", "streams' ITL p99 ms"),
    ("long", "tpot_p50_ms", "streams' TPOT p50 ms"),
    ("long", "long_ttft_ms", "long prompt TTFT ms"),
)


def _describe(res: dict) -> str:
    w = res["setup"]["workloads"]
    s, li, p, lo = w["saturated"], w["light"], w["prefix"], w["long"]
    return (
        f"Model: {res['setup']['model']}; `jaxpar {res['setup']['jaxpar']}`. Streamed "
        f"completions of token ids, greedy, EOS ignored. Saturated: {s['requests']} requests "
        f"at {s['rate']:g}/s (Poisson), prompts {s['prompt'][0]}..{s['prompt'][1]} tokens, "
        f"{s['max_tokens']} out. Light: {li['requests']} at {li['rate']:g}/s, "
        f"{li['max_tokens']} out. Prefix: {p['requests']} at {p['rate']:g}/s sharing a "
        f"{p['shared']}-token prefix (+{p['prompt'][0]}..{p['prompt'][1]}), {p['max_tokens']} "
        f"out. Long: a {lo['long_prompt']}-token prompt sent among {lo['streams']} streams "
        f"({lo['stream_prompt']}-token prompts) once each has {lo['head']} tokens."
    )


def markdown(res: dict) -> str:
    import _bench_profile as profile

    j, v = res["jaxpar"], res.get("vllm")
    head = "| workload | figure | jaxpar |" + (" vLLM | jaxpar / vLLM |" if v else "")
    lines = [_describe(res), "", head, "|---|---|---|" + ("---|---|" if v else "")]
    for work, key, label in FIGURES:
        row = f"| {work} | {label} | {j[work][key]:.1f} |"
        if v:
            row += f" {v[work][key]:.1f} | {j[work][key] / v[work][key]:.2f} |"
        lines.append(row)
    lines += [
        "",
        "Requests complete (all their tokens) / sent: "
        + ", ".join(
            f"{k} {j[k]['complete']}/{j[k]['sent']}" for k in ("saturated", "light", "prefix")
        )
        + f"; long: {j['long']['requests']} streams. Long-prompt ITL p99 / TPOT p50: "
        f"{j['long']['itl_p99_over_tpot_p50']:.1f}"
        + (f" (vLLM {v['long']['itl_p99_over_tpot_p50']:.1f})" if v else "")
        + ".",
        "",
        "Where jaxpar's time went (its `/health` stats and `/metrics`, before and after each "
        "workload; the rest: host work between steps and idle time):",
        "",
        *profile.markdown({k: m["profile"] for k, m in j.items()}),
    ]
    return "\n".join(lines)
