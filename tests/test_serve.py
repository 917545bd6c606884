"""``jaxpar serve`` on one device, as the serving page starts it, with real clients.

One server for the module (scripts/docs/pages/serving.md's command, plus ``--slots 2 --max-queue 2`` so
overload is reachable), talked to with the official ``openai`` client, with ``httpx`` and
with lm-eval-harness's completions client. Every completion is checked token for token
against ``InferenceEngine.generate`` run here on the same checkpoint (``return_token_ids``
gives the ids), and logprobs against the engine's own.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest

from jaxpar.engine import Sampling
from tests import _lm_eval
from tests._serve_util import CHECKPOINT, MAX_SEQ_LEN, MODEL, ROOT, Offline, ServerProcess

pytestmark = pytest.mark.server

# The serving page's examples (the README and Getting started show copies of them:
# tests/test_docs_examples.py checks they are the same).
README = (ROOT / "scripts" / "docs" / "pages" / "serving.md").read_text()
SERVE_BLOCKS = re.findall(r"^```(\w+) serve\n(.*?)^```", README, flags=re.M | re.S)
README_PORT = "8000"


def _readme_serve_args() -> list[str]:
    command = next(body for lang, body in SERVE_BLOCKS if body.startswith("jaxpar serve"))
    args = shlex.split(command)[2:]
    i = args.index("--port")
    assert args[i + 1] == README_PORT
    return args[:i] + args[i + 2 :]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [*_readme_serve_args(), "--slots", "2", "--max-queue", "2"]
    proc = ServerProcess(args, cpu_devices=1, log_dir=tmp_path_factory.mktemp("serve"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def offline():
    return Offline().warm()


@pytest.fixture(scope="module")
def ready(server, offline):
    """The server once warmed up (the offline engine is built while it warms up)."""
    return server.wait_ready()


@pytest.fixture
def client(ready):
    return openai.OpenAI(base_url=f"{ready.url}/v1", api_key="unused", max_retries=0)


def _post(server: ServerProcess, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def test_health_and_models(ready, client):
    status = ready.health()
    assert status["status"] == "ok" and status["slots"] == 2
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert "prefix caching on" in ready.log()  # the start line: on by default


def test_greedy_completions_equal_offline_generate(ready, client, offline):
    texts = ["hello world", "how are you ? i am fine , thanks", "what is your name ?"]
    for text in texts:
        out = client.completions.create(
            model=MODEL, prompt=text, max_tokens=12, extra_body={"return_token_ids": True}
        )
        choice = out.choices[0].model_extra
        prompt = offline.encode(text)
        expected = offline.greedy(prompt, 12)
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == expected, text
        assert out.choices[0].text == offline.text(expected)
        assert out.choices[0].finish_reason == ("stop" if expected[-1] in offline.eos else "length")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
            len(prompt),
            len(expected),
        )
    ids = [1, 40, 41, 42, 43]  # a prompt as token ids, without EOS: exactly max_tokens
    out = _post(
        ready,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 20,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert out.json()["choices"][0]["token_ids"] == offline.greedy(ids, 20, eos=False)


def test_sampled_completion_equals_offline_generate(ready, offline):
    prompt = [1, 30, 31, 32]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0.9,
        "top_k": 40,
        "top_p": 0.95,
        "seed": 7,
        "return_token_ids": True,
    }
    tokens = _post(ready, "/v1/completions", body).json()["choices"][0]["token_ids"]
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95)
    assert tokens == offline.sampled(prompt, 16, sampling, seed=7)


def test_n_choices_and_a_list_of_prompts(ready, offline):
    """n choices of a seeded prompt sample with seed, seed + 1, ...; a list of prompts gets
    a choice each, in order; usage counts each prompt once and every choice's tokens."""
    prompt = [1, 30, 31, 32]
    sampled = {"temperature": 0.9, "top_k": 40, "seed": 7, "return_token_ids": True}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 2, **sampled}
    out = _post(ready, "/v1/completions", body).json()
    sampling = Sampling(temperature=0.9, top_k=40)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["token_ids"] for c in out["choices"]] == [
        offline.sampled(prompt, 8, sampling, seed=7),
        offline.sampled(prompt, 8, sampling, seed=8),
    ]
    completion = sum(len(c["token_ids"]) for c in out["choices"])
    assert 0 <= out["usage"].pop("prompt_tokens_details")["cached_tokens"] < len(prompt)
    assert out["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }
    prompts = ["hello world", "how are you ?"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 6, "ignore_eos": True}
    out = _post(ready, "/v1/completions", body | {"return_token_ids": True}).json()
    ids = [offline.encode(p) for p in prompts]
    assert [c["token_ids"] for c in out["choices"]] == [
        offline.greedy(p, 6, eos=False) for p in ids
    ]
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
    # Streamed: each chunk names its choice; put together, the same texts.
    with httpx.stream(
        "POST", f"{ready.url}/v1/completions", json=body | {"stream": True}, timeout=60
    ) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    texts = ["", ""]
    for chunk in map(json.loads, lines):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in out["choices"]]


def test_stream_is_the_completion_in_pieces(ready, client, offline):
    prompt = [1, 20, 21, 22, 23, 24]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
            stream_options={"include_usage": True},
        )
    )
    expected = offline.greedy(prompt, 20, eos=False)
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert len(pieces) > 2, "tokens arrive one chunk at a time"
    assert [t for p in pieces for t in (p.model_extra.get("token_ids") or [])] == expected
    assert "".join(p.text for p in pieces) == offline.text(expected)
    assert [p.finish_reason for p in pieces][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(ready, client, offline):
    """``usage.prompt_tokens_details.cached_tokens`` as OpenAI reports it: a prompt sent
    again reuses the K/V its first run cached (short of its last token, which prefill
    computes for the first token's logits), and draws the same tokens."""
    prompt = [1] + [250 - i for i in range(39)]  # 40 tokens no other test starts with
    expected = offline.greedy(prompt, 6, eos=False)
    runs = [
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        for _ in range(2)
    ]
    assert [run.choices[0].model_extra["token_ids"] for run in runs] == [expected] * 2
    assert [run.usage.prompt_tokens for run in runs] == [40, 40]
    assert _cached(runs[0].usage) == 0
    assert 0 < _cached(runs[1].usage) < 40
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert _cached(streamed[-1].usage) == _cached(runs[1].usage)
    messages = [{"role": "user", "content": "hello , how are you ?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert 0 <= _cached(chat.usage) < chat.usage.prompt_tokens


def test_stop_string_trims_the_text(ready, client, offline):
    prompt = [1, 50, 51, 52]
    full = offline.text(offline.greedy(prompt, 20, eos=False))
    words = full.split(" ")
    stop = words[len(words) // 2]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "ignore_eos": True}
    whole = _post(ready, "/v1/completions", body | {"stop": [stop]}).json()["choices"][0]
    assert whole["text"] == full[: full.index(stop)]
    assert whole["finish_reason"] == "stop"
    streamed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0] for c in streamed]
    assert "".join(p.text for p in pieces) == whole["text"]
    assert pieces[-1].finish_reason == "stop"


def test_chat_completion_uses_the_template(ready, client, offline):
    messages = [
        {"role": "system", "content": "you are fine"},
        {"role": "user", "content": "hello , how are you ?"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, extra_body={"return_token_ids": True}
    )
    prompt = offline.chat_ids(messages)
    assert prompt[:2] == [1, offline.tokenizer.token_to_id("<|system|>")]
    choice = out.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt
    expected = offline.greedy(prompt, 10)
    assert choice.model_extra["token_ids"] == expected
    assert choice.message.role == "assistant"
    assert choice.message.content == offline.text(expected)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def _log_softmax(logits_TV: np.ndarray) -> np.ndarray:
    x = logits_TV.astype(np.float64) - logits_TV.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _prompt_logprobs(offline: Offline, ids: list[int]) -> np.ndarray:
    """log_softmax at each position of ``ids`` (the engine's prefill, all logits)."""
    eng = offline.engine
    logits = np.asarray(eng.prefill_logits(*eng.pad_prompts([ids])))[0, : len(ids)]
    return _log_softmax(logits)


def test_logprobs_and_penalties_equal_offline(ready, client, offline):
    """Completion and chat logprobs (raw), with penalties on, equal the offline run's;
    echo with max_tokens 0 returns the prompt's log-likelihoods."""
    prompt = [1, 30, 31, 32, 30, 31]
    penalties = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True} | penalties,
    )
    gen = offline.engine.generate(
        [prompt], 8, sampling=Sampling(**penalties), stop_tokens=(), logprobs=3
    )
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == gen.tokens[0]
    assert gen.tokens[0] != offline.greedy(prompt, 8, eos=False)  # the penalties bite
    want = gen.logprobs[0]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, [e.logprob for e in want], atol=1e-5)
    for top, entry in zip(choice.logprobs.top_logprobs, want, strict=True):
        assert len(top) in (3, 4)  # the 3 most likely, and the chosen token if not among them
        assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
    assert "".join(choice.logprobs.tokens) == choice.text
    messages = [{"role": "user", "content": "hello , how are you ?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2
    )
    chat_gen = offline.engine.generate(
        [offline.chat_ids(messages)], 4, stop_tokens=offline.eos, logprobs=2
    )
    content = chat.choices[0].logprobs.content
    np.testing.assert_allclose(
        [c.logprob for c in content], [e.logprob for e in chat_gen.logprobs[0]], atol=1e-5
    )
    assert all(len(c.top_logprobs) == 2 for c in content)
    # The prompt's log-likelihoods: no decode row taken, nothing generated.
    echo = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    lp_TV = _prompt_logprobs(offline, prompt)
    got = echo.choices[0].logprobs.token_logprobs
    assert got[0] is None and echo.usage.completion_tokens == 0
    np.testing.assert_allclose(
        got[1:], [lp_TV[t - 1, prompt[t]] for t in range(1, len(prompt))], atol=1e-5
    )


def test_lm_eval_harness_loglikelihoods_equal_offline(ready, offline, tmp_path):
    """lm-eval-harness's ``local-completions`` (echo, logprobs, max_tokens 1, token ids)
    on a local loglikelihood task: each document's log-likelihood and is-greedy equal
    the engine's, from one prefill of context + continuation."""
    _lm_eval.require_lm_eval()
    samples = _lm_eval.run(f"{ready.url}/v1/completions", MODEL, CHECKPOINT, tmp_path)
    assert [s["doc_id"] for s in samples] == list(range(_lm_eval.LIMIT))
    for sample, (context, continuation) in zip(samples, _lm_eval.DOCS, strict=False):
        loglikelihood, greedy = sample["resps"][0][0]  # as lm-eval logs them: strings
        loglikelihood, greedy = float(loglikelihood), str(greedy) == "True"
        encode = lambda text: offline.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        ids, n_context = encode(context + continuation), len(encode(context))
        lp_TV = _prompt_logprobs(offline, ids)
        positions = range(n_context, len(ids))
        want = sum(lp_TV[t - 1, ids[t]] for t in positions)
        assert loglikelihood == pytest.approx(want, abs=1e-4), (context, continuation)
        assert greedy == all(int(np.argmax(lp_TV[t - 1])) == ids[t] for t in positions)


def _long(n: int) -> list[int]:
    return [1] + [10 + i % 200 for i in range(n - 1)]


BAD_REQUESTS = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": _long(MAX_SEQ_LEN + 1)}, "prompt"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2], "max_tokens": MAX_SEQ_LEN},
        "max_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": -3}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 65}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 33, "n": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs"),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        "top_logprobs",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": -1},
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5},
        "presence_penalty",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "repetition_penalty": 0},
        "repetition_penalty",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1}}, "logit_bias"),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format.json_schema.schema",
    ),
    (  # this checkpoint's word-level tokenizer has no decoder: no structured output
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
        },
        "response_format",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_json": 5}, "guided_json"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
        "messages",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, "messages"),
]


def test_bad_requests_get_a_400_naming_the_field(ready):
    for path, body, param in BAD_REQUESTS:
        response = _post(ready, path, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error" and error["message"], error
    response = httpx.post(
        f"{ready.url}/v1/completions",
        content=b"{not json",
        timeout=10,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400 and response.json()["error"]["message"]
    ready.wait_idle()  # none of them was queued


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert info.value.body["param"] == "temperature"


async def _overload(url: str, n: int) -> list[httpx.Response]:
    body = {
        "model": MODEL,
        "prompt": [1, 60, 61],
        "max_tokens": 60,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(n)))


def test_overload_gets_429_with_retry_after(ready, offline):
    # 2 slots and a queue of 2: of 16 requests at once, some must be refused.
    responses = asyncio.run(_overload(ready.url, 16))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    refused = [r for r in responses if r.status_code == 429]
    assert refused and codes.count(200) >= 2, codes
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    for r in responses:
        if r.status_code == 200:
            assert len(r.json()["choices"][0]["token_ids"]) == 60
    ready.wait_idle()


def test_disconnect_mid_stream_frees_the_slot(ready, offline):
    # The client reads one chunk of a 60-token stream and hangs up. Had the server
    # generated every token before sending the first chunk, or not cancelled the request,
    # it would have taken 59 decode steps; it must take fewer, and a later request runs.
    before = ready.wait_idle()["stats"]
    body = {
        "model": MODEL,
        "prompt": [1, 70, 71],
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{ready.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    later = _post(
        ready,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [1, 72],
            "max_tokens": 4,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert later.json()["choices"][0]["token_ids"] == offline.greedy([1, 72], 4, eos=False)
    after = ready.wait_idle()["stats"]
    assert after["finished"] == before["finished"] + 2
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps < 59 + 3, f"the disconnected request ran on ({steps} decode steps)"


def _run_curl_block(block: str, port: int) -> list[dict]:
    """A serving page ``bash serve`` block run against the server: the responses it printed."""
    curl = block.replace(README_PORT, str(port))
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_readme_examples_run_against_the_server(ready, tmp_path):
    blocks = [(lang, body) for lang, body in SERVE_BLOCKS if not body.startswith("jaxpar serve")]
    completion, repeated = [_run_curl_block(b, ready.port) for lang, b in blocks if lang == "bash"]
    for response in [*completion, *repeated]:
        assert response["choices"][0]["finish_reason"] in ("stop", "length")
    # The same prompt twice: the second reuses the K/V the first cached, as the serving page shows.
    usages = [response["usage"] for response in repeated]
    shown = re.search(r'```json\n(\{"id".*"cached_tokens":\d+\}\}\})\n```', README)
    assert shown, "serving.md lost the response of the repeated prompt"
    assert usages[1] == json.loads(shown.group(1))["usage"]
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < usages[1]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens"]
    script = tmp_path / "readme_openai.py"
    python = next(body for lang, body in blocks if lang == "python")
    script.write_text(python.replace(README_PORT, str(ready.port)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "completion_tokens=" in run.stdout


def test_sigterm_finishes_in_flight_requests_and_exits_0(ready):
    # Last in the module: it ends the server. A stream in flight when SIGTERM arrives
    # still gets all its tokens; then the process exits 0.
    body = {
        "model": MODEL,
        "prompt": [1, 80],
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens, done = [], False
    with httpx.stream("POST", f"{ready.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
                break
        ready.proc.send_signal(15)
        for line in lines:
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
            done = done or line == "data: [DONE]"
    assert done and len(tokens) == 60
    assert ready.proc.wait(60) == 0, ready.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{ready.url}/health", timeout=5)
