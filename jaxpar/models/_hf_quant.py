"""Pre-quantized fp8 checkpoints: which ``quantization_config`` loads, and where its scales are.

Two published layouts store a Linear's weight as ``float8_e4m3fn`` (``[out, in]``) with a
``weight_scale`` tensor beside it (``weight = weight_fp8 * weight_scale``):

* ``quant_method: "compressed-tensors"`` (``format`` ``float-quantized`` or
  ``naive-quantized``; llm-compressor's FP8 / FP8_DYNAMIC schemes): 8-bit ``float``
  weights, symmetric, ``strategy`` ``channel`` (``weight_scale [out, 1]``) or ``tensor``
  (``weight_scale [1]``);
* ``quant_method: "fbgemm_fp8"``: ``weight_scale [out, 1]``.

They load into the representation ``--quantize fp8`` makes (:mod:`jaxpar.models._quant`):
the fp8 values as stored, bit for bit, and a float32 scale per output channel whose logical
axes are derived from the kernel's, so every strategy splits a scale with its kernel. A
per-tensor scale is broadcast to every output channel (exact: the same number repeated).
K and V, and gate and up, which jaxpar fuses into one kernel, keep each tensor's own scales.

Weight-only: the activations stay in the model dtype. What is read but not used, and why:
``input_scale`` (compressed-tensors' static activation scales) and ``input_scale_ub``
(fbgemm's bound on dynamic activation scales) describe fp8 *activations*, which jaxpar does
not compute (its matmul widens the fp8 weight to the activation dtype); ``k_scale`` /
``v_scale`` (``kv_cache_scheme``) describe an fp8 KV cache, and jaxpar's cache stays in the
model dtype. A Linear the checkpoint left in float (``ignore``, ``modules_to_not_convert``)
is quantized to fp8 at load time like ``--quantize fp8`` does. The embedding and the LM
head stay in the model dtype (the LM head is in ``ignore`` in both published layouts; an
fp8 one is refused).

Refused, before any tensor is read: every other ``quant_method`` (awq, gptq, bitsandbytes,
mxfp4, the block-wise ``fp8`` of DeepSeek-style checkpoints, ...), compressed-tensors
schemes other than 8-bit float weights per channel or per tensor (``block``, ``group``
strategies, int weights), and MoE models (their expert tensors' stored scales are not
read yet; a float MoE checkpoint quantizes its experts at load with ``--quantize``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import CheckpointError
from jaxpar.models._hf_layout import Fused, Recipe

#: Pre-quantized ``quant_method`` values jaxpar loads.
PREQUANTIZED_METHODS = ("compressed-tensors", "fbgemm_fp8")
SUPPORTED = (
    "pre-quantized fp8 checkpoints of quant_method 'compressed-tensors' (float8 weights with a "
    "per-channel or per-tensor weight_scale) or 'fbgemm_fp8'; float checkpoints can be "
    "quantized at load time instead (--quantize int8|fp8|int4)"
)
#: Tensor name endings a pre-quantized checkpoint may hold that jaxpar does not use.
UNUSED_SUFFIXES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale")
_CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclasses.dataclass(frozen=True)
class Prequantized:
    """A supported pre-quantized checkpoint: its method (the kernels load as fp8)."""

    method: str
    mode: str = "fp8"


def prequantized(hf: Mapping[str, Any], source: str) -> Prequantized | None:
    """The checkpoint's supported pre-quantization, None for a float checkpoint.

    Raises:
        CheckpointError: a ``quantization_config`` jaxpar does not load, naming its method
            and what is supported.
    """
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    where = f"{source}: quantization_config"
    if method not in PREQUANTIZED_METHODS:
        block = qc.get("weight_block_size") if isinstance(qc, Mapping) else None
        extra = f" (block-wise scales, weight_block_size {block})" if block else ""
        raise CheckpointError(
            f"{where}.quant_method {method!r}{extra} is not supported; jaxpar loads {SUPPORTED}"
        )
    if method == "compressed-tensors":
        _check_compressed_tensors(qc, where)
    return Prequantized(method)


def _check_compressed_tensors(qc: Mapping[str, Any], where: str) -> None:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise CheckpointError(
            f"{where}.format {fmt!r} (compressed-tensors) is not supported; jaxpar loads "
            f"{' or '.join(_CT_FORMATS)} fp8 weights"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        strategy = w.get("strategy")
        kind = (w.get("num_bits"), w.get("type"))
        if (
            kind != (8, "float")
            or strategy not in ("channel", "tensor")
            or not w.get("symmetric", True)
        ):
            detail = f"block_structure {w.get('block_structure')}, " if strategy == "block" else ""
            raise CheckpointError(
                f"{where}.config_groups.{name}.weights: {w.get('num_bits')}-bit "
                f"{w.get('type')} weights, strategy {strategy!r} ({detail}symmetric "
                f"{w.get('symmetric', True)}) are not supported; jaxpar loads 8-bit float "
                f"symmetric weights with strategy 'channel' or 'tensor'"
            )


def check_model(prequant: Prequantized | None, arch: str, is_moe: bool, source: str) -> None:
    """Refuses pre-quantized models jaxpar cannot hold quantized as stored."""
    if prequant is not None and arch == "gpt2":
        raise CheckpointError(
            f"{source}: a pre-quantized ({prequant.method}) GPT-2 checkpoint is not supported "
            "(its Conv1D weights are stored [in, out]); pre-quantized fp8 loads for the "
            "Llama family (Llama, Mistral, Qwen2, Qwen3)"
        )
    if prequant is not None and arch in ("gemma2", "gemma3"):
        raise CheckpointError(
            f"{source}: a pre-quantized ({prequant.method}) Gemma checkpoint is not supported "
            "(not checked against a reference); pre-quantized fp8 loads for the Llama family "
            "(Llama, Mistral, Qwen2, Qwen3); load a float Gemma checkpoint (optionally with "
            "--quantize)"
        )
    if prequant is not None and is_moe:
        raise CheckpointError(
            f"{source}: a pre-quantized ({prequant.method}) MoE checkpoint is not supported: "
            "its expert scales are not read; load a float checkpoint with --quantize (experts "
            "included)"
        )


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".weight_scale"


@dataclasses.dataclass(frozen=True)
class Broadcast:
    """A per-tensor scale (``[1]`` or ``[]`` in the checkpoint) read as per-channel scales
    of ``shape`` (after the stacked dims): the one number repeated."""

    name: str
    stack: tuple[int, ...]
    param_shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    keys: tuple[str, ...] = ("layer", "expert")

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.stack, *self.param_shape)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        import itertools

        names = (
            self.name.format(**dict(zip(self.keys, i, strict=False)))
            for i in itertools.product(*map(range, self.stack))
        )
        return dict.fromkeys(names, self.hf_shape)

    def layer(self, i: int) -> Broadcast:
        name = self.name.replace("{layer}", str(i))
        return dataclasses.replace(self, name=name, stack=self.stack[1:], keys=self.keys[1:])

    def read(self, index: tuple[slice, ...], reader) -> np.ndarray:
        import itertools

        full = self.shape
        bounds = [range(*s.indices(n)) for s, n in zip(index, full, strict=True)]
        n_stack = len(self.stack)
        whole = tuple(slice(None) for _ in self.hf_shape)
        blocks = []
        for i in itertools.product(*bounds[:n_stack]):
            name = self.name.format(**dict(zip(self.keys, i, strict=False)))
            value = np.asarray(reader(name, whole)).reshape(())
            blocks.append(np.full([len(b) for b in bounds[n_stack:]], value))
        return np.stack(blocks).reshape([len(b) for b in bounds])


def scale_recipe(
    kernel: Recipe | Fused, shapes: Mapping[str, tuple[int, ...]]
) -> Recipe | Fused | Broadcast | None:
    """The recipe of a kernel's ``weight_scale`` (per output channel, shaped as
    :func:`jaxpar.models._quant.scale_layout` makes it), from the checkpoint's tensor
    shapes; None when the checkpoint stores the kernel in float (no ``weight_scale``).

    Raises:
        CheckpointError: a scale shaped neither ``[out, 1]`` nor ``[1]`` (block-wise or
            grouped scales), or scales on some parts of a fused kernel only.
    """
    if isinstance(kernel, Fused):
        parts = [scale_recipe(p, shapes) for p in kernel.parts]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            names = [p.name for p in kernel.parts]
            raise CheckpointError(
                f"tensors {names} are fused into one kernel, but only some have a weight_scale"
            )
        return Fused(tuple(parts), kernel.axis)
    name = scale_name(kernel.name)
    first = kernel.tensors()
    first_name = next(iter(first))
    stored = shapes.get(scale_name(first_name))
    if stored is None:
        return None
    out_dims, in_dims = kernel.split
    out, n_in = kernel.hf_shape
    if stored in ((), (1,)):
        n_out = len(out_dims)
        contract = len(kernel.perm) - n_out
        param = (1,) * contract + tuple(out_dims)
        return Broadcast(name, kernel.stack, param, stored, kernel.keys)
    if stored != (out, 1):
        raise CheckpointError(
            f"{scale_name(first_name)}: weight_scale of shape {list(stored)} for a weight of "
            f"shape {[out, n_in]}; jaxpar loads per-channel [{out}, 1] or per-tensor [1] fp8 "
            "scales, not block-wise or grouped ones"
        )
    return Recipe(
        name,
        kernel.stack,
        (out, 1),
        (out_dims, (1,) * len(in_dims)),
        kernel.perm,
        None,
        kernel.keys,
    )


def fp8_array(file: Path, name: str) -> np.ndarray:
    """An ``F8_E4M3`` tensor of a safetensors file, memory-mapped (safetensors' numpy API
    cannot return float8): its bytes, found from the file's JSON header, viewed as
    ``float8_e4m3fn``; slicing it reads only the rows asked for."""
    import ml_dtypes

    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
    begin, end = info["data_offsets"]
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size + begin, shape=(end - begin,))
    return data.view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])
