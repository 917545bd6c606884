"""The peer in the GPU benchmark: Hugging Face transformers on PyTorch, same shapes as jaxpar.

Run by ``scripts/bench.py --gpu-only`` in its own process when ``torch`` and
``transformers`` import (the GPU image has both): a Llama model with the preset's shapes and
random bf16 weights, the fastest path transformers documents for decoding (static KV cache
and ``torch.compile``), greedy, no EOS. Prints one JSON object:

    python scripts/bench_torch_peer.py --model llama-1b --shapes 16x512,1x512 --steps 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _llama(config, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    rope = {"rope_type": "default", "rope_theta": c.rope.theta}
    if c.rope.scaling is not None:
        s = c.rope.scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": c.rope.theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    hf = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norms.eps,
        tie_word_embeddings=c.embed.tied,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.device(device):
        return LlamaForCausalLM(hf).to(torch.bfloat16).eval()


def _timed(fn, sync, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_name: str, shapes: list[tuple[int, int]], steps: int) -> dict:
    """Prefill seconds and decode seconds per step for each (batch, prompt) shape."""
    import torch

    from jaxpar.models import preset

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = _llama(preset(model_name), device)
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    rows = []
    for batch, prompt in shapes:
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)

        def generate(n: int, ids=ids) -> None:
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )

        with torch.no_grad():
            generate(steps)  # compiles for this shape
            prefill_s = _timed(lambda ids=ids: model(ids, logits_to_keep=1), sync)
            one, many = _timed(lambda: generate(1), sync), _timed(lambda: generate(steps), sync)
        rows.append(
            {
                "batch": batch,
                "prompt_len": prompt,
                "prefill_ms": 1e3 * prefill_s,
                "decode_ms": 1e3 * (many - one) / (steps - 1),
            }
        )
    import transformers

    return {
        "peer": "transformers + torch, static cache + torch.compile",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--shapes", default="16x512", help="comma-separated BATCHxPROMPT")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    print(json.dumps(measure(args.model, shapes, args.steps)))


if __name__ == "__main__":
    main()
