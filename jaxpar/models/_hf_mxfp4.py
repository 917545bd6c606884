"""GPT-OSS's MXFP4 expert weights, dequantized at load time.

The published GPT-OSS checkpoints (``quantization_config.quant_method: "mxfp4"``) store each
layer's expert projections as two tensors instead of one float tensor ``W [E, A, R]`` (``A``
the contracted dimension: ``gate_up_proj [E, D, 2F]``, ``down_proj [E, F, D]``):

* ``<name>_blocks`` uint8 ``[E, R, A / 32, 16]``: rows of W^T in blocks of 32 values, two
  4-bit E2M1 codes per byte, the low nibble first;
* ``<name>_scales`` uint8 ``[E, R, A / 32]``: one power-of-two scale per block, biased by
  127 (E8M0): value = ``FP4[code] * 2 ** (scale - 127)``.

jaxpar computes with float weights: the loader presents each such pair as the float tensor
``<name>`` it encodes (:class:`Mxfp4Tensors`), and reads slices of it, decoding only the
blocks a device's slice covers. The experts then take the memory of the model dtype (bf16:
about 4x their MXFP4 bytes); native low-bit expert matmuls are not implemented. Every other
tensor of such a checkpoint (attention, router, embeddings: ``modules_to_not_convert``) is
stored in float and loads as usual. Only GPT-OSS checkpoints are accepted with this method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxpar.errors import CheckpointError
from jaxpar.models._hf_quant import PREQUANTIZED_METHODS

#: The 16 E2M1 values, by 4-bit code (the sign is the high bit).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCK = 32  # values per scale
_BLOCKS, _SCALES = "_blocks", "_scales"
SliceReader = Callable[[str, tuple[slice, ...]], np.ndarray]


def is_mxfp4(hf: Mapping[str, Any], arch: str, source: str) -> bool:
    """Whether the checkpoint's ``quantization_config`` is MXFP4 (GPT-OSS only).

    Raises:
        CheckpointError: MXFP4 on another architecture.
    """
    qc = hf.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "mxfp4":
        return False
    if arch != "gpt_oss":
        legal = ", ".join(map(repr, PREQUANTIZED_METHODS))
        raise CheckpointError(
            f"{source}: quantization_config.quant_method 'mxfp4' is supported for "
            f"GptOssForCausalLM only (dequantized at load), not for arch {arch!r}; "
            f"legal pre-quantized formats for it: {legal}"
        )
    return True


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> float32 ``[..., G * 32]``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise CheckpointError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair: blocks must be "
            f"[..., G, {BLOCK // 2}] and scales [..., G]"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = FP4_VALUES[codes.reshape(*blocks.shape[:-1], BLOCK)]
    exponents = scales.astype(np.int32)[..., None] - 127
    return np.ldexp(values, exponents).reshape(*scales.shape[:-1], -1)


class Mxfp4Tensors:
    """The float tensors a checkpoint's ``<name>_blocks``/``<name>_scales`` pairs encode.

    Args:
        shapes: Every stored tensor's shape, by name.
        dtypes: Every stored tensor's safetensors dtype, by name.
        read: Reads a slice of a stored tensor.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, str],
        read: SliceReader,
    ) -> None:
        self._read = read
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            if not name.endswith(_BLOCKS):
                continue
            base = name.removesuffix(_BLOCKS)
            scales = shapes.get(base + _SCALES)
            if scales is None:
                raise CheckpointError(f"MXFP4 tensor {name!r} has no {base + _SCALES!r}")
            if dtypes[name] != "U8" or dtypes[base + _SCALES] != "U8":
                raise CheckpointError(
                    f"MXFP4 tensors {name!r} / {base + _SCALES!r} must be uint8, found "
                    f"{dtypes[name]} / {dtypes[base + _SCALES]}"
                )
            if len(shape) != 4 or shape[:3] != scales or shape[3] != BLOCK // 2:
                raise CheckpointError(
                    f"MXFP4 tensor {name!r} {shape} with scales {scales}: expected blocks "
                    f"[E, R, G, {BLOCK // 2}] and scales [E, R, G]"
                )
            e, r, g, _ = shape
            self.shapes[base] = (e, g * BLOCK, r)  # the float W [E, A, R] it encodes
        orphans = [
            n for n in shapes if n.endswith(_SCALES) and n.removesuffix(_SCALES) not in self.shapes
        ]
        if orphans:
            raise CheckpointError(f"MXFP4 scales {orphans[0]!r} have no matching _blocks tensor")

    @property
    def stored(self) -> set[str]:
        """The stored names the encoded tensors replace."""
        return {base + sfx for base in self.shapes for sfx in (_BLOCKS, _SCALES)}

    def read(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
        """``W[slices]`` (float32) of the encoded tensor ``name``, decoding only the blocks
        the slice of its contracted dimension touches."""
        e, a, r = self.shapes[name]
        s_e, s_a, s_r = (range(*s.indices(n)) for s, n in zip(slices, (e, a, r), strict=True))
        g0, g1 = s_a.start // BLOCK, -(-s_a.stop // BLOCK)
        e_sl, r_sl, g_sl = slice(s_e.start, s_e.stop), slice(s_r.start, s_r.stop), slice(g0, g1)
        blocks = self._read(name + _BLOCKS, (e_sl, r_sl, g_sl, slice(None)))
        scales = self._read(name + _SCALES, (e_sl, r_sl, g_sl))
        w_ERA = dequantize(np.asarray(blocks), np.asarray(scales))
        off = g0 * BLOCK
        return w_ERA[:, :, s_a.start - off : s_a.stop - off].transpose(0, 2, 1)
