#!/usr/bin/env python3
"""Build tiny pre-quantized fp8 checkpoints from the ``llama`` HF fixture.

Each fixture holds the ``llama`` fixture's weights with every attention and MLP projection
(``q/k/v/o_proj``, ``gate/up/down_proj``; not the embedding, the norms or ``lm_head``)
stored as ``float8_e4m3fn`` with a ``weight_scale`` tensor, as the published formats lay
them out, and a ``config.json`` with their ``quantization_config``:

=======================  ===================  ===============================================
name                     quant_method         layout
=======================  ===================  ===============================================
llama_fp8_channel        compressed-tensors   FP8_DYNAMIC: per output channel
                                              ``weight_scale [out, 1]``, activations dynamic
                                              (no ``input_scale``)
llama_fp8_tensor         compressed-tensors   FP8: one ``weight_scale [1]`` per tensor and a
                                              static ``input_scale [1]`` per tensor
llama_fbgemm_fp8         fbgemm_fp8           ``weight_scale [out, 1]`` and
                                              ``input_scale_ub [1]``
=======================  ===================  ===============================================

Quantization: ``scale = max |w| / 448`` over the reduced dims (a row, or the tensor),
``w_fp8 = clip(w / scale, -448, 448)`` rounded to e4m3 (round to nearest even).

``reference.npz`` (the compressed-tensors fixtures, when transformers can load them: it
needs the ``compressed-tensors`` package; fbgemm_fp8 needs ``fbgemm-gpu`` and CUDA), in the layout of ``scripts/make_hf_fixtures.py`` (so
``tests/test_hf_fixtures.py`` checks it too): ``tokens_{i}`` as in the llama fixture,
``logits_{i}``, ``greedy_{i}`` (16 tokens) and ``greedy_logits_{i}``,
transformers' float32 logits of the checkpoint as it loads it (each Linear holds the stored
fp8 weight and ``weight_scale``, checked here bit for bit, and compressed-tensors' forward
applies them), weight-only: the scheme's fake quantization of the input activations
(FP8_DYNAMIC rounds each token's activations to fp8, FP8 all of them with the static
``input_scale``) is switched off
(``input_activations = None``), as jaxpar keeps activations in the model dtype.
``reference.json`` says what made it.

Usage (torch, transformers; for the reference also ``compressed-tensors``, which pulls a
torch of its own unless installed without dependencies: the fixtures were made with
compressed-tensors 0.20.0, loguru and psutil installed ``--no-deps`` into a directory of
their own)::

    .venv-hf/bin/pip install --no-deps --target /tmp/ct compressed-tensors loguru psutil
    PYTHONPATH=/tmp/ct .venv-hf/bin/python scripts/make_fp8_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
FP8_MAX = 448.0
GREEDY = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _scheme(strategy: str, static_input: bool) -> dict:
    weights = {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "symmetric": True,
        "dynamic": False,
        "group_size": None,
        "block_structure": None,
        "observer": "minmax",
    }
    inputs = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor" if static_input else "token",
        "symmetric": True,
        "dynamic": not static_input,
        "group_size": None,
        "block_structure": None,
        "observer": "minmax" if static_input else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


FIXTURES = {
    "llama_fp8_channel": ("channel", _scheme("channel", False)),
    "llama_fp8_tensor": ("tensor", _scheme("tensor", True)),
    "llama_fbgemm_fp8": (
        "channel",
        {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        },
    ),
}


def quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale) of a ``[out, in]`` weight: per row or per tensor."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    shaped = scale if strategy == "channel" else scale.reshape(1, 1)
    q = (w.float() / shaped).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def build(name: str, out: Path) -> Path:
    strategy, qconfig = FIXTURES[name]
    src = ROOT / "llama"
    dst = out / name
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    stored: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(0)
    for key, w in tensors.items():
        module = key.rsplit(".", 2)
        if len(module) == 3 and module[1] in PROJECTIONS and module[2] == "weight":
            q, scale = quantize(w, strategy)
            stored[key] = q
            stored[key.replace(".weight", ".weight_scale")] = scale
            if name == "llama_fp8_tensor":  # a static activation scale, as FP8 stores it
                stored[key.replace(".weight", ".input_scale")] = torch.tensor(
                    [rng.uniform(0.01, 0.05)], dtype=torch.float32
                )
            if name == "llama_fbgemm_fp8":
                stored[key.replace(".weight", ".input_scale_ub")] = torch.tensor([1200.0])
        else:
            stored[key] = w
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


def reference(path: Path) -> dict:
    """transformers' logits of the llama fixture's prompts, if it loads the checkpoint."""
    from transformers import AutoModelForCausalLM

    ref = np.load(ROOT / "llama" / "reference.npz")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    stored = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    for name in stored:  # the fp8 weights and their scales, as stored
        if name.endswith(".weight_scale"):
            weight = name.removesuffix("_scale")
            assert torch.equal(params[name], stored[name]), name
            assert params[weight].dtype == torch.float8_e4m3fn, weight
            assert torch.equal(params[weight].view(torch.uint8), stored[weight].view(torch.uint8))
    for module in model.modules():  # weight-only: no fp8 rounding of the activations
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            scheme.input_activations = None
    out = {"n_prompts": ref["n_prompts"]}
    gaps = []
    with torch.no_grad():
        for i in range(int(ref["n_prompts"])):
            tokens = torch.from_numpy(ref[f"tokens_{i}"].astype(np.int64))[None]
            run = model(tokens, use_cache=True)
            out[f"tokens_{i}"] = ref[f"tokens_{i}"]
            out[f"logits_{i}"] = run.logits[0].float().numpy()
            step, greedy, rows = run.logits[0, -1], [], []
            for _ in range(GREEDY):  # greedy with the KV cache, EOS ignored
                top2 = torch.topk(step, 2).values
                gaps.append(float(top2[0] - top2[1]))
                greedy.append(int(step.argmax()))
                rows.append(step.float().numpy())
                run = model(
                    torch.tensor([[greedy[-1]]]),
                    past_key_values=run.past_key_values,
                    use_cache=True,
                )
                step = run.logits[0, -1]
            out[f"greedy_{i}"] = np.asarray(greedy, np.int32)
            out[f"greedy_logits_{i}"] = np.stack(rows)
    np.savez(path / "reference.npz", **out)
    return {
        "min_greedy_logit_gap": round(min(gaps), 6),
        "model_class": type(model).__name__,
        "activations": "not quantized (scheme.input_activations = None): weight-only",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    import transformers

    for name in FIXTURES:
        path = build(name, args.out)
        meta = {
            "fixture": name,
            "made_from": "llama",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        if FIXTURES[name][1]["quant_method"] == "compressed-tensors":
            try:
                import compressed_tensors

                meta.update(reference(path), compressed_tensors=compressed_tensors.__version__)
                meta["reference"] = (
                    "transformers float32 logits (compressed-tensors forward, weight-only)"
                )
            except ImportError as e:
                meta["reference"] = f"none: {e}"
        (path / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
        print(path, meta.get("reference", "no transformers reference"))


if __name__ == "__main__":
    main()
