"""The cost of serving across processes: process 0's command messages against the step.

Starts ``jaxpar serve`` as 2 processes x 4 simulated CPU devices (jax.distributed on
127.0.0.1) and as 1 process x 8 devices, both dp2·sp2·tp2 on the test checkpoint, sends
each the same concurrent requests, and reads ``/health``: process 0's lockstep counters
(messages sent through the coordination service's key-value store, the commands in them,
bytes, seconds in the puts) and the batcher's decode step time. Reports the put time per
message against the decode step time (the issue's goal: at most 10 %), and the step time
of the pair against the single process (what the second process costs in all: puts,
replay, and collectives between processes, which gloo runs over TCP here).

    python scripts/bench_lockstep.py [--requests 32] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests._serve_util import ServerProcess, process_pair  # noqa: E402

FLAGS = ["--hf", "tests/fixtures/llama_chat", "--max-seq-len", "64", "--prefill-batch", "2"]
FLAGS += ["--dp", "2", "--sp", "2", "--tp", "2", "--max-num-seqs", "32"]


async def _load(url: str, n: int, max_tokens: int) -> None:
    bodies = [
        {"model": "llama_chat", "prompt": [1, 7 + i, 9 + i], "max_tokens": max_tokens}
        | {"ignore_eos": True, "temperature": 0.0}
        for i in range(n)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for response in await asyncio.gather(
            *(http.post("/v1/completions", json=b) for b in bodies)
        ):
            response.raise_for_status()


def _measure(server: ServerProcess, n: int, max_tokens: int) -> dict:
    before = server.health()
    asyncio.run(_load(server.url, n, max_tokens))
    after = server.health()
    steps = after["stats"]["decode_steps"] - before["stats"]["decode_steps"]
    seconds = after["stats"]["decode_seconds"] - before["stats"]["decode_seconds"]
    out = {"decode_steps": steps, "step_s": seconds / max(steps, 1)}
    if "lockstep" in after:
        lock = {k: after["lockstep"][k] - before["lockstep"].get(k, 0) for k in after["lockstep"]}
        out |= {
            "messages": lock["messages"],
            "commands": lock["commands"],
            "bytes_per_message": lock["bytes"] / max(lock["messages"], 1),
            "put_s": lock["seconds"] / max(lock["messages"], 1),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pair, single = process_pair(FLAGS, Path(tmp)), None
        try:
            single = ServerProcess(FLAGS, cpu_devices=8, log_dir=Path(tmp))
            pair[0].wait_ready(900)
            single.wait_ready(900)
            _measure(pair[0], 4, 4)  # first requests: warm the host paths
            _measure(single, 4, 4)
            across = _measure(pair[0], args.requests, args.max_tokens)
            alone = _measure(single, args.requests, args.max_tokens)
        finally:
            for proc in [*pair, *([single] if single else [])]:
                proc.stop()
    result = {
        "across": across,
        "alone": alone,
        "put_over_step": across["put_s"] / across["step_s"],
        "pair_over_single_step": across["step_s"] / alone["step_s"],
    }
    print(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    a, s = r["across"], r["alone"]
    goal = "met" if r["put_over_step"] <= 0.10 else "MISSED"
    return "\n".join(
        [
            "| | 2 processes x 4 devices | 1 process x 8 devices |",
            "|---|---|---|",
            f"| decode steps | {a['decode_steps']} | {s['decode_steps']} |",
            f"| decode step time (ms) | {a['step_s'] * 1e3:.1f} | {s['step_s'] * 1e3:.1f} |",
            f"| messages to process 1 (commands) | {a['messages']} ({a['commands']}) | - |",
            f"| bytes per message | {a['bytes_per_message']:.0f} | - |",
            f"| put per message (ms) | {a['put_s'] * 1e3:.2f} | - |",
            f"| **put / decode step** (goal <= 0.10) | **{r['put_over_step']:.3f}** ({goal}) | - |",
            f"| step time, pair / single | {r['pair_over_single_step']:.2f} | 1 |",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
