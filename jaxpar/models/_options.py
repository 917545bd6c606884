"""How an engine runs a model: the execution options, apart from the architecture.

A :class:`~jaxpar.models.ModelConfig` says what a checkpoint is (its ``config.json``) and
never changes once built; :class:`ExecutionOptions` says how one engine runs it (attention
kernels, layer storage, MoE exchange and capacity, weight quantization, compute dtype).
Two engines over the same checkpoint may run it differently, so the two are kept apart,
and an engine resolves its options' ``"auto"`` values once, for the platform of its mesh's
devices (:meth:`ExecutionOptions.resolve`), not for whatever JAX's default backend is: a
CPU host that drives accelerators (or lowers for them) picks their kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.models._config import ModelConfig, float_dtype
from jaxpar.models._kernel_choice import (
    RING_MIN_TOKENS,
    attention_impls,
    paged_attention_impl,
)
from jaxpar.models._kv_quant import check_kv_cache_dtype
from jaxpar.models._quant import check_quantize

#: The legal values of each choice field. The attention cores are those of
#: :mod:`jaxpar.models._attention_ops` (``PREFILL_IMPLS``, ``DECODE_IMPLS``) and
#: :mod:`jaxpar.models._paged_attention`; the MoE exchanges those of
#: :mod:`jaxpar.models._moe_exchange`.
CHOICES: dict[str, tuple[str, ...]] = {
    "layer_loop": ("unrolled", "scan"),
    "prefill_attention": ("auto", "xla", "cudnn", "pallas_tpu"),
    "decode_attention": ("auto", "xla", "cudnn", "pallas_gpu", "pallas_tpu"),
    "paged_attention": ("auto", "xla", "cudnn", "pallas_gpu", "pallas_tpu"),
    "moe_dispatch": ("auto", "padded", "ragged"),
    "matmul": ("auto", "dot", "rows"),
    "sp_attention": ("auto", "gather", "ring"),
}
_ATTENTION = ("prefill_attention", "decode_attention", "paged_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionOptions:
    """How an engine runs a model: frozen and hashable (it lives in NNX graphdefs).

    Attributes:
        prefill_attention: the prefill attention core. "auto": the platform's fused kernel
            where one fits (GPU: cuDNN; TPU: splash) for half precision, XLA on CPU and in
            float32; "xla", "cudnn", "pallas_tpu" by name. Prefill over cached context
            (chunks, prefix hits) follows it: TPU's ragged paged-attention kernel for
            "pallas_tpu", cuDNN for "cudnn" (see ``_context_attention``).
        decode_attention: the decode core over the contiguous cache. "auto": cuDNN on GPU
            for half precision, XLA otherwise; "xla", "cudnn", "pallas_gpu", "pallas_tpu".
        paged_attention: the decode core over the paged cache (the serving core). "auto":
            ``decode_attention``'s choice when that is named, else the platform's paged
            kernel (Pallas on GPU and on TPU in bfloat16, XLA otherwise).
        layer_loop: "unrolled" (one parameter array per layer, a Python loop: no step
            copies a weight out of a stack; compile time grows with depth) or "scan"
            (stacked ``[L, ...]`` under ``lax.scan``: compile time flat in depth, but XLA
            copies each layer's weights out of the stack every step). Pipelined engines
            (``pp > 1``) always run "scan".
        moe_dispatch: how MoE rows travel between expert peers: "padded" (all-to-all of
            capacity-sized blocks, every backend), "ragged" (the routed rows alone, GPU/TPU,
            dropless), "auto" (ragged where the mesh's backend compiles it and the MoE is
            dropless).
        moe_capacity_factor: None: dropless (every routed token is computed, as in
            transformers). A factor cf: each device sends at most ceil(cf * tokens * top_k
            / ep) rows to each expert peer; assignments past that are dropped (earlier
            tokens first) and counted.
        matmul: how the projections' few-row matmuls (decode) read their kernels:
            "dot" (the backend's dot, the cast of a quantized kernel its operand: GPU, TPU)
            or "rows" (XLA:CPU: a quantized kernel's products, up to 64 rows, as fused
            multiplies and row reductions over its out-major rows, and a one-row
            half-precision dot as a two-row one; see :func:`~jaxpar.models._quant.qmatmul`).
            "auto": "rows" on CPU, else "dot"; unresolved (a model built outside an
            engine) "dot".
        quantize: weight-only quantization of the attention, dense-FFN and MoE expert
            kernels (None, "int8", "fp8", "int4"; :mod:`jaxpar.models._quant`). Embedding
            and LM head stay in the parameter dtype unless ``quantize_embeddings``; the
            MoE router always does.
        quantize_embeddings: with ``quantize``, the token embedding and the LM head too
            (one table when tied): per vocabulary row (int4: per group of the row), the
            lookup scaling the rows it gathers and the head scaling its logits. Off by
            default: the head's error goes straight into the logits.
        kv_cache_dtype: the KV cache's storage: None (the compute dtype), "int8" or "fp8"
            (e4m3), one float32 scale per token per kv head, quantized where K/V are written
            and dequantized where attention reads them (:mod:`jaxpar.models._kv_quant`).
            Kernels without scale inputs are refused.
        sp_attention: how prefill attention under ``sp`` (tokens split over devices) sees
            the keys of other token shards: "gather" (K and V all-gathered: every device
            holds the prompt's K/V and ``[T / sp, T]`` scores per head), "ring" (K/V
            blocks rotate around the sp devices, attended with online softmax in a
            load-balanced token order: :mod:`jaxpar.models._ring_attention`), or "auto":
            the ring from ``ring_min_tokens`` padded tokens, the gather below. Chosen per
            prefill program (the prompt length is known when it is traced), so it stays
            "auto" after :meth:`resolve`. Prefill over cached context and MLA gather.
        ring_min_tokens: the padded prompt length from which "auto" runs the ring.
        dtype: compute and parameter dtype of this run; None: the checkpoint's
            (``ModelConfig.dtype`` and ``param_dtype``). A checkpoint stored in bfloat16
            runs in float32 on a CPU this way (``engine_from_hf`` and the CLI choose that
            for CPU meshes) without its config saying anything but what it is.
    """

    prefill_attention: str = "auto"
    decode_attention: str = "auto"
    paged_attention: str = "auto"
    layer_loop: str = "unrolled"
    moe_dispatch: str = "auto"
    moe_capacity_factor: float | None = None
    matmul: str = "auto"
    quantize: str | None = None
    quantize_embeddings: bool = False
    kv_cache_dtype: str | None = None
    sp_attention: str = "auto"
    ring_min_tokens: int = RING_MIN_TOKENS
    dtype: Any = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            object.__setattr__(self, "dtype", float_dtype("dtype", self.dtype))
        for name, legal in CHOICES.items():
            value = getattr(self, name)
            if value not in legal:
                raise ConfigError(
                    f"ExecutionOptions.{name}={value!r} is not an implementation jaxpar has; "
                    f"legal: {', '.join(map(repr, legal))}"
                )
        check_quantize(self.quantize)
        if self.quantize_embeddings and self.quantize is None:
            raise ConfigError(
                "ExecutionOptions.quantize_embeddings=True quantizes the embedding and LM head "
                "in the weights' format: give quantize='int8', 'fp8' or 'int4' too"
            )
        check_kv_cache_dtype(self.kv_cache_dtype)
        # The contiguous decode kernels (cuDNN, Pallas) read K/V as they lie and take no
        # scales; "auto" runs XLA (or, paged on GPU, the Pallas kernel that takes them).
        if self.kv_cache_dtype is not None and self.decode_attention not in ("auto", "xla"):
            raise ConfigError(
                f"ExecutionOptions.decode_attention={self.decode_attention!r} reads no KV cache "
                f"scales (kv_cache_dtype={self.kv_cache_dtype!r}); legal: 'auto' (XLA, or the "
                "Pallas GPU paged kernel with scales on GPU) or 'xla'"
            )
        if self.kv_cache_dtype is not None and self.paged_attention not in (
            "auto",
            "xla",
            "pallas_gpu",
        ):
            raise ConfigError(
                f"ExecutionOptions.paged_attention={self.paged_attention!r} reads no KV cache "
                f"scales (kv_cache_dtype={self.kv_cache_dtype!r}); legal: 'auto', 'xla' or "
                "'pallas_gpu'"
            )
        if not isinstance(self.ring_min_tokens, int) or self.ring_min_tokens < 1:
            raise ConfigError(
                f"ExecutionOptions.ring_min_tokens={self.ring_min_tokens!r}: a prompt length "
                "in tokens, at least 1"
            )
        cf = self.moe_capacity_factor
        if cf is not None and not cf > 0:
            raise ConfigError(
                f"ExecutionOptions.moe_capacity_factor must be None (dropless) or > 0, got {cf}"
            )
        if self.moe_dispatch == "ragged" and cf is not None:
            raise ConfigError(
                "ExecutionOptions: moe_dispatch='ragged' is dropless; with moe_capacity_factor="
                f"{cf} use moe_dispatch='padded' (or 'auto')"
            )

    def check(self, model: ModelConfig) -> None:
        """Refuses options this model cannot run (before anything is built).

        Raises:
            ConfigError: MoE options on a dense model; a named fused attention kernel on a
                model that soft-caps its scores or adds attention sinks (no kernel does);
                what multi-head latent attention or dense-then-MoE layers cannot run yet.
        """
        if not model.is_moe and (
            self.moe_capacity_factor is not None or self.moe_dispatch != "auto"
        ):
            raise ConfigError(
                f"ExecutionOptions: moe_capacity_factor={self.moe_capacity_factor}, "
                f"moe_dispatch={self.moe_dispatch!r} need a mixture of experts; "
                f"arch {model.arch!r} is dense (n_experts=0): leave them at None and 'auto'"
            )
        # No fused kernel (cuDNN, splash, Pallas decode) soft-caps scores, adds a sink logit
        # or reads MLA's latent: "auto" runs XLA for such a model; a kernel named explicitly
        # would be silently wrong.
        xla_only = {
            "cannot soft-cap attention scores": model.attention.softcap is not None,
            "cannot add attention sinks to the softmax": model.attention.sinks,
            "cannot attend over MLA's latent (its own XLA core does)": model.is_mla,
        }
        for why in (why for why, applies in xla_only.items() if applies):
            for name in _ATTENTION:
                if getattr(self, name) not in ("auto", "xla"):
                    raise ConfigError(
                        f"ExecutionOptions.{name}={getattr(self, name)!r} {why} (the model's "
                        f"attention.softcap={model.attention.softcap}, "
                        f"attention.sinks={model.attention.sinks}, "
                        f"MLA={model.is_mla}); legal: 'auto' or 'xla' (both run the XLA path)"
                    )
        if model.moe.first_dense_layers and self.layer_loop == "scan":
            raise ConfigError(
                f"the model's moe.first_dense_layers={model.moe.first_dense_layers}: dense and MoE "
                "layers differ in structure and cannot stack under layer_loop='scan' (nor "
                "split into pipeline stages, which run the stacked form); use "
                "layer_loop='unrolled' and pp=1"
            )
        self._check_mla(model)

    def _check_mla(self, model: ModelConfig) -> None:
        if not model.is_mla:
            return
        if self.quantize is not None or self.kv_cache_dtype is not None:
            raise ConfigError(
                f"ExecutionOptions: quantize={self.quantize!r}, kv_cache_dtype="
                f"{self.kv_cache_dtype!r}: multi-head latent attention (mla.kv_lora_rank) runs "
                "unquantized weights and cache here; leave both None"
            )
        if self.layer_loop != "unrolled":
            raise ConfigError(
                "MLA caches keys and values of different widths, which the stacked (scan and "
                "pipeline-stage) caches do not hold yet: MLA needs layer_loop='unrolled' and pp=1"
            )

    def resolve(
        self, model: ModelConfig, platform: str, *, ragged_compiles: bool = False
    ) -> ExecutionOptions:
        """These options with every ``"auto"`` replaced by what ``platform`` runs.

        Args:
            model: the model (its dtype and soft cap choose the kernels too).
            platform: the platform of the mesh's devices (``mesh.devices.flat[0].platform``)
                or the one an engine lowers for: ``"cpu"``, ``"gpu"``/``"cuda"``, ``"tpu"``.
            ragged_compiles: whether that platform's XLA compiles ragged-all-to-all (the
                engine probes it once per device kind).

        Raises:
            ConfigError: ``moe_dispatch="ragged"`` where it does not compile.
        """
        self.check(model)
        dtype = self.dtype if self.dtype is not None else model.dtype
        prefill, decode = attention_impls(platform, dtype)
        paged = paged_attention_impl(platform, dtype)
        if model.attention.softcap is not None or model.attention.sinks or model.is_mla:
            prefill = decode = paged = "xla"  # no fused kernel soft-caps scores or adds sinks
        if self.kv_cache_dtype is not None:  # only XLA and the Pallas GPU paged kernel scale
            decode = "xla"
            paged = paged if paged == "pallas_gpu" else "xla"
        out: dict[str, Any] = {}
        if self.prefill_attention == "auto":
            out["prefill_attention"] = prefill
        if self.decode_attention == "auto":
            out["decode_attention"] = decode
        if self.paged_attention == "auto":
            named = self.decode_attention != "auto" and model.attention.softcap is None
            named = named and (self.kv_cache_dtype is None or self.decode_attention == "xla")
            out["paged_attention"] = self.decode_attention if named else paged
        if self.moe_dispatch == "ragged" and not ragged_compiles:
            raise ConfigError(
                f"moe_dispatch='ragged': XLA:{platform} does not compile ragged-all-to-all; "
                "use moe_dispatch='padded' or 'auto'"
            )
        if self.matmul == "auto":
            out["matmul"] = "rows" if platform == "cpu" else "dot"
        if self.moe_dispatch == "auto" and model.is_moe:
            ragged = self.moe_capacity_factor is None and ragged_compiles
            out["moe_dispatch"] = "ragged" if ragged else "padded"
        return dataclasses.replace(self, **out)

    def merged(self, **given: Any) -> ExecutionOptions:
        """These options with the keyword arguments that are not None set (the engine's and
        loaders' older keywords, e.g. ``quantize=``); a keyword that contradicts an option
        set here raises.

        Raises:
            ConfigError: a keyword and the option of the same name differ.
        """
        default = ExecutionOptions()
        out = {}
        for name, value in given.items():
            if value is None:
                continue
            mine = getattr(self, name)
            if name == "dtype":
                value = float_dtype("dtype", value)
            if mine != getattr(default, name) and mine != value:
                raise ConfigError(
                    f"{name}={value!r} contradicts options.{name}={mine!r}: give it once"
                )
            out[name] = value
        return dataclasses.replace(self, **out) if out else self
