"""Structured output: grammar token masks in the sampler, the batcher and the server.

The model is ``tests/fixtures/llama_bytes`` (the tiny random Llama with a byte-level
tokenizer, which can spell JSON): untrained, so whatever it writes under a grammar is the
grammar's doing. Checked here:

* the sampler (``select_rows``) never draws a token its row's mask forbids, greedy or
  seeded, and draws the same tokens on a dp2-tp2 mesh as on one device; rows with every
  bit set draw what they draw with no mask at all;
* the batcher: a constrained greedy request draws, step by step, the argmax of the model's
  logits over the tokens its grammar allows (an oracle built here from full prefills and a
  fresh matcher); unconstrained requests running beside constrained ones draw exactly
  their own offline tokens; nothing compiles after warm-up; a grammar that completes ends
  its request with "stop", ``max_tokens`` with "length";
* the server (a ``jaxpar serve`` process, the official ``openai`` client): json_schema,
  json_object, guided_regex and guided_choice outputs parse / match, streamed too; bad
  constraints are 400s naming their field.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import re
import subprocess
import sys

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import GrammarError, ParallelConfig
from jaxpar.engine import (
    Constraint,
    ContinuousBatcher,
    Grammars,
    KVBudget,
    RowSampling,
    Sampling,
    engine_from_hf,
    generation_defaults,
    load_tokenizer,
)
from jaxpar.engine._grammar import all_allowed
from jaxpar.engine._sampling import select_rows
from jaxpar.spec import make_mesh
from tests._serve_util import ROOT, ServerProcess

CHECKPOINT = ROOT / "tests" / "fixtures" / "llama_bytes"
MODEL = "llama_bytes"
MAX_SEQ_LEN = 64
#: A schema an untrained model can finish: bounded strings and numbers, no extra keys.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"


def _valid(doc: dict) -> bool:
    """``doc`` satisfies :data:`SCHEMA` (checked by hand: no jsonschema here)."""
    return (
        set(doc) == {"name", "ok", "n"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 5
        and isinstance(doc["ok"], bool)
        and type(doc["n"]) is int
        and 0 <= doc["n"] <= 99
    )


def _bits(mask_W: np.ndarray, vocab: int) -> np.ndarray:
    """A packed mask row as bool [vocab] (bit ``v % 32`` of word ``v // 32``)."""
    return np.unpackbits(mask_W.astype("<i4").view(np.uint8), bitorder="little")[:vocab] == 1


# --- the sampler ---------------------------------------------------------------------------

VOCAB, ROWS = 96, 8


def _sampler_case():
    """Logits, masks (rows 0-5 random ~30% of ids, 6-7 everything) and sampling rows
    (even rows greedy; odd rows temperature 1 with top-k and top-p, seeded)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32) * 3
    allowed = rng.random((ROWS, VOCAB)) < 0.3
    allowed[:, 5] = True  # at least one id per row
    allowed[6:] = True
    mask = np.zeros((ROWS, -(-VOCAB // 32)), np.int32)
    for b, v in zip(*np.nonzero(allowed), strict=True):
        mask[b, v // 32] |= np.int32(1 << (v % 32)) if v % 32 < 31 else np.int32(-(2**31))
    samplings = [
        Sampling() if b % 2 == 0 else Sampling(temperature=1.0, top_k=40, top_p=0.9)
        for b in range(ROWS)
    ]
    rows = RowSampling.rows(samplings, seeds=list(range(ROWS)))
    return logits, allowed, mask, rows


STEPS = 3


def _draws(mesh=None):
    """``select_rows`` at steps ``0..STEPS-1`` (``[STEPS, ROWS]`` tokens), jitted once, on
    one device or with logits split ``[dp, tp]`` and rows over ``dp`` on ``mesh``."""

    def fn(logits, rows, mask):
        steps = jnp.arange(STEPS, dtype=jnp.int32)[:, None] * jnp.ones(ROWS, jnp.int32)
        return jax.vmap(lambda step_B: select_rows(logits, rows, step_B, None, mask))(steps)

    if mesh is None:
        return jax.jit(fn)
    row, row_x = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P("dp", None))
    logits = NamedSharding(mesh, P("dp", "tp"))
    return jax.jit(
        fn,
        in_shardings=(logits, RowSampling.like(row, row_x), row_x),
        out_shardings=NamedSharding(mesh, P(None, "dp")),
    )


def test_sampler_draws_only_allowed_tokens_on_any_mesh():
    logits, allowed, mask, rows = _sampler_case()
    assert all((_bits(mask[b], VOCAB) == allowed[b]).all() for b in range(ROWS))
    mesh = make_mesh(ParallelConfig(dp=2, tp=2), jax.devices()[:4])
    draws = _draws()
    tokens_SB = np.asarray(draws(logits, rows, mask))
    assert all(allowed[np.arange(ROWS), t].all() for t in tokens_SB), tokens_SB
    np.testing.assert_array_equal(np.asarray(_draws(mesh)(logits, rows, mask)), tokens_SB)
    # Greedy rows take the argmax among their allowed ids, and the mask bites (the
    # unmasked argmax is forbidden in some row); sampled rows vary with the step.
    greedy = np.arange(0, 6, 2)
    masked_argmax = np.where(allowed, logits, -np.inf).argmax(-1)
    np.testing.assert_array_equal(tokens_SB[:, greedy], np.tile(masked_argmax[greedy], (STEPS, 1)))
    assert (masked_argmax[greedy] != logits.argmax(-1)[greedy]).any()
    assert len({tuple(t) for t in tokens_SB[:, 1::2]}) > 1
    # Rows with every bit set draw what they draw with no mask at all, beside masked rows.
    plain_SB = np.asarray(draws(logits, rows, all_allowed(ROWS, VOCAB)))
    np.testing.assert_array_equal(tokens_SB[:, 6:], plain_SB[:, 6:])
    unmasked = jax.jit(lambda lg, r: select_rows(lg, r, jnp.zeros(ROWS, jnp.int32)))
    np.testing.assert_array_equal(plain_SB[0], np.asarray(unmasked(logits, rows)))


# --- the batcher ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(request):
    """A warmed-up batcher on the byte-level fixture, its tokenizer, grammars and EOS ids
    (built while the server process warms up, where this run has server tests to run: the
    fast tier, which deselects them, starts no server)."""
    if any(
        item.module is request.module and item.get_closest_marker("server")
        for item in request.session.items
    ):
        request.getfixturevalue("server")
    parallel = ParallelConfig()
    engine = engine_from_hf(
        CHECKPOINT,
        parallel,
        max_batch=4,
        max_seq_len=MAX_SEQ_LEN,
        mesh=make_mesh(parallel, jax.devices()[:1]),
    )
    tokenizer = load_tokenizer(CHECKPOINT)
    eos = generation_defaults(CHECKPOINT).eos_token_ids
    grammars = Grammars(tokenizer, engine.steps.vocab_size, eos)
    # 64 tokens of cache for 4 rows: requests running together get preempted.
    budget = KVBudget(page_size=16, tokens=MAX_SEQ_LEN)
    batcher = ContinuousBatcher(engine, prefill_batch=2, kv_budget=budget).start()
    batcher.warmup(range(1, 9))  # every prompt here has at most 8 tokens
    try:
        yield batcher, tokenizer, grammars, eos
    finally:
        batcher.close()


def _oracle(engine, grammar, prompt: list[int], n: int, eos) -> list[int]:
    """Greedy under a grammar from first principles: at each step the full prefill's last
    logits, restricted to what a fresh matcher allows after the tokens so far."""
    matcher, out = grammar.matcher(), []
    vocab = engine.steps.vocab_size
    tokens_BT = np.zeros((engine.max_batch, MAX_SEQ_LEN), np.int32)  # one shape: one compile
    lengths_B = np.ones(engine.max_batch, np.int32)
    while len(out) < n:
        ids = prompt + out
        tokens_BT[0, : len(ids)], lengths_B[0] = ids, len(ids)
        logits = np.asarray(engine.prefill_logits(tokens_BT, lengths_B))[0, len(ids) - 1]
        mask = all_allowed(1, vocab)
        matcher.fill(mask[0])
        token = int(np.where(_bits(mask[0], vocab), logits[:vocab], -np.inf).argmax())
        out.append(token)
        assert matcher.consume(token)
        if matcher.done or token in eos:
            break
    return out


def test_constrained_greedy_is_the_argmax_over_allowed_tokens(served):
    batcher, tokenizer, grammars, eos = served
    grammar = grammars.compile(Constraint.json_schema(SCHEMA))
    prompt = tokenizer.encode("data: ").ids
    compiled = len(batcher.engine.steps._compiled)
    stream = batcher.submit(prompt, max_tokens=40, stop_tokens=eos, grammar=grammar)
    tokens = stream.result(120)
    assert len(batcher.engine.steps._compiled) == compiled  # warm-up compiled the masks' path
    assert tokens == _oracle(batcher.engine, grammar, prompt, 40, eos)
    assert stream.finish_reason == "stop"
    assert _valid(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)))


def test_constrained_and_plain_requests_side_by_side(served):
    """Requests sent together (preempting each other in the small cache) draw what each
    draws alone: a row's mask touches no other row, and plain rows run as they do with no
    grammar about."""
    batcher, tokenizer, grammars, eos = served
    sampled = Sampling(temperature=1.0, top_k=50)
    plain = [
        dict(prompt=tokenizer.encode("hello").ids, max_tokens=20, sampling=Sampling(), seed=0),
        dict(prompt=tokenizer.encode("x = ").ids, max_tokens=16, sampling=sampled, seed=3),
    ]
    constrained = [
        dict(prompt=tokenizer.encode("mail: ").ids, grammar=Constraint.regex(EMAIL), seed=1),
        dict(prompt=tokenizer.encode("{").ids, grammar=Constraint.json_schema(SCHEMA), seed=2),
        dict(prompt=tokenizer.encode("?").ids, grammar=Constraint.choice(["yes", "no"]), seed=0),
    ]
    for c in constrained:
        c |= dict(max_tokens=40, sampling=sampled, grammar=grammars.compile(c["grammar"]))
    solo = [batcher.submit(**r).result(120) for r in plain]
    alone = [batcher.submit(**c, stop_tokens=eos).result(120) for c in constrained]
    preempted = batcher.stats.preemptions
    together = [constrained[0], plain[0], *constrained[1:], plain[1]]
    streams = [batcher.submit(**r, stop_tokens=eos if "grammar" in r else ()) for r in together]
    got = [s.result(120) for s in streams]
    assert [got[1], got[4]] == solo
    assert [got[0], got[2], got[3]] == alone
    assert batcher.stats.preemptions > preempted
    email, doc, choice = (tokenizer.decode(t, skip_special_tokens=True) for t in alone)
    assert re.fullmatch(EMAIL, email), email
    assert _valid(json.loads(doc)), doc
    assert choice in ("yes", "no")
    assert [streams[i].finish_reason for i in (0, 2, 3)] == ["stop"] * 3


def test_max_tokens_cuts_a_grammar_with_length(served):
    batcher, tokenizer, _, _ = served
    grammar = Constraint.json_schema(SCHEMA)  # compiled by submit, with the engine's tokenizer
    stream = batcher.submit(tokenizer.encode("a").ids, max_tokens=4, grammar=grammar)
    text = tokenizer.decode(stream.result(120))
    assert stream.finish_reason == "length"
    assert len(stream.tokens) == 4 and text.startswith('{"')


def test_preempted_constrained_requests_resume_in_their_grammar(served):
    """Three requests in a cache that holds about one: some are preempted, and each
    resumes where its grammar was (its next token drawn under the mask of the tokens it
    had) and ends as it does alone."""
    batcher, tokenizer, grammars, eos = served
    grammar = grammars.compile(Constraint.json_schema(SCHEMA))
    prompts = [tokenizer.encode(p).ids for p in ("a", "bb", "ccc")]
    kw = dict(max_tokens=40, stop_tokens=eos, grammar=grammar)
    alone = [batcher.submit(p, **kw).result(120) for p in prompts]
    preempted = batcher.stats.preemptions
    together = [s.result(120) for s in [batcher.submit(p, **kw) for p in prompts]]
    assert batcher.stats.preemptions > preempted
    assert together == alone


def test_offline_generate_takes_a_grammar(served):
    """``generate(..., grammar=)`` (the offline API on the same core) draws what the
    batcher draws for each prompt, and ``generate_text`` takes it too."""
    batcher, tokenizer, grammars, eos = served
    engine = batcher.engine
    prompts = [tokenizer.encode(p).ids for p in ("a", "bb", "ccc")]
    grammar = grammars.compile(Constraint.json_schema(SCHEMA))
    served_tokens = [
        batcher.submit(p, max_tokens=40, stop_tokens=eos, grammar=grammar).result(120)
        for p in prompts
    ]
    out = engine.generate(prompts, 40, stop_tokens=eos, grammar=grammar)
    assert out.tokens == served_tokens
    texts = engine.generate_text(["a", "bb"], 40, grammar=Constraint.regex(EMAIL))
    assert all(re.fullmatch(EMAIL, t) for t in texts), texts


def test_bad_constraints_raise_grammar_errors(served):
    batcher, _, grammars, _ = served
    for bad in (
        Constraint.json_schema({"type": "objet"}),
        Constraint.json_schema("{not json"),
        Constraint.regex("a(b"),
        Constraint.choice([]),
        Constraint.grammar("start: undefined_rule"),
    ):
        with pytest.raises(GrammarError, match="invalid"):
            grammars.compile(bad)
    other = Grammars(load_tokenizer(CHECKPOINT), 512, [2])
    with pytest.raises(GrammarError, match="vocabulary of 512"):
        batcher.submit([1, 2], max_tokens=2, grammar=other.compile(Constraint.regex("a")))


# --- the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--hf", str(CHECKPOINT), "--max-seq-len", str(MAX_SEQ_LEN), "--slots", "2"]
    args.append("--no-prefix-caching")  # fewer programs to warm up
    proc = ServerProcess(args, cpu_devices=1, log_dir=tmp_path_factory.mktemp("structured"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    """An ``openai`` client of the server, once it is warmed up."""
    server.wait_ready()
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.server
def test_server_json_schema_json_object_regex_and_choice(client):
    messages = [{"role": "user", "content": "rec"}]
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "record", "schema": SCHEMA, "strict": True},
    }
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, response_format=schema_format
    )
    assert chat.choices[0].finish_reason == "stop"
    assert _valid(json.loads(chat.choices[0].message.content))
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, response_format=schema_format, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    obj = client.completions.create(
        model=MODEL,
        prompt="json: ",
        max_tokens=40,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].text), dict)
    for seed in (0, 1):
        email = client.completions.create(
            model=MODEL,
            prompt="mail: ",
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": EMAIL},
        )
        assert re.fullmatch(EMAIL, email.choices[0].text), email.choices[0].text
    choice = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert choice.choices[0].message.content in ("red", "green", "blue")


@pytest.mark.server
def test_server_plain_requests_unchanged_beside_constrained(client):
    """Sent together, plain completions equal the same completions sent alone."""
    plain = dict(model=MODEL, prompt="hi", max_tokens=12, extra_body={"ignore_eos": True})
    alone = client.completions.create(**plain).choices[0].text
    body = dict(model=MODEL, prompt="rec: ", max_tokens=40)
    body["extra_body"] = {"guided_json": SCHEMA}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, **plain)]
        futures += [pool.submit(client.completions.create, **body) for _ in range(2)]
        futures.append(pool.submit(client.completions.create, **plain))
        out = [f.result() for f in futures]
    assert [out[0].choices[0].text, out[3].choices[0].text] == [alone, alone]
    for o in out[1:3]:
        assert _valid(json.loads(o.choices[0].text))


@pytest.mark.server
def test_readme_structured_example_runs_against_the_server(server, client, tmp_path):
    readme = (ROOT / "scripts" / "docs" / "pages" / "serving.md").read_text()
    block = re.search(r"^```python structured\n(.*?)^```", readme, flags=re.M | re.S)
    assert block, "serving.md lost its structured-output example"
    script = tmp_path / "readme_structured.py"
    script.write_text(block.group(1).replace("8000", str(server.port)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    record, mail = run.stdout.splitlines()
    assert set(ast.literal_eval(record)) == {"name", "ok"}  # the dict the example printed
    assert re.fullmatch(r"[a-z]{2,6}@[a-z]{2,6}\.org", mail), mail


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objet"}},
            }
        },
        "response_format",
    ),
    ({"guided_json": {"type": "objet"}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
]


@pytest.mark.server
def test_server_bad_constraints_get_a_400_naming_the_field(server, client):
    for extra, param in BAD:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert param in error["param"], (extra, error)
        assert error["message"], error
    server.wait_idle()  # none of them was queued
