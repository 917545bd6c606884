"""``ModelRun``: one model as one engine runs it (architecture + execution options).

The model modules read sizes, norms and RoPE (the architecture) and kernels, layer form,
MoE exchange and quantization (the run) off one object. Rather than a rewritten copy of
the :class:`ModelConfig` (which would leave an engine holding several configs that all
claim to be the model), this view pairs the untouched config with the options and
answers each attribute from the one that owns it. Architecture fields reach the modules
by name through the view, so a field added to ``ModelConfig`` needs no change here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.models._config import ModelConfig
from jaxpar.models._kv_quant import kv_bytes_per_vector
from jaxpar.models._moe_route import capacity_rows
from jaxpar.models._options import ExecutionOptions
from jaxpar.models._quant import INT4_GROUP
from jaxpar.spec import ParallelConfig, kv_head_replicas

_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(ExecutionOptions)) - {"dtype"}
_OWN_FIELDS = ("config", "options", "padded_vocab", "kv_head_replicas")


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """A model config with the options it runs under: frozen and hashable (the model
    modules keep it as static graphdef data).

    Attributes:
        config: the architecture, as the checkpoint says.
        options: how it runs (resolved by an engine: no ``"auto"`` left; as given when
            the model is built outside an engine, where ``"auto"`` kernels are chosen at
            trace time for the sharding context's platform).
        padded_vocab: the vocabulary rows the run holds (an engine pads the vocabulary to a
            multiple of tp; see ``jaxpar.engine._vocab``); None: the config's.
        kv_head_replicas: copies of each KV head the run holds, adjacent (an engine runs
            ``tp / K`` of them when tp is a multiple of the ``K`` KV heads, so that each
            device holds the one head its query heads read; see
            :func:`jaxpar.spec.kv_head_replicas`); 1: the checkpoint's heads.

    ``vocab_size``, ``n_kv_heads``, ``q_per_kv``, ``dtype`` and ``param_dtype`` are the
    run's (the checkpoint's KV-head count is ``config.n_kv_heads``); every other
    ``ModelConfig`` attribute and every option is read through by name.
    """

    config: ModelConfig
    options: ExecutionOptions = ExecutionOptions()
    padded_vocab: int | None = None
    kv_head_replicas: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.config, ModelRun):
            raise TypeError("ModelRun(config=...) takes a ModelConfig, not a ModelRun")
        if self.kv_head_replicas < 1 or (self.kv_head_replicas > 1 and self.config.is_mla):
            raise ValueError(
                f"kv_head_replicas={self.kv_head_replicas}: at least 1, and 1 for MLA (its "
                "latent cache has no head axis)"
            )
        self.options.check(self.config)

    @staticmethod
    def split(
        model: ModelConfig | ModelRun, options: ExecutionOptions | None
    ) -> tuple[ModelConfig, ExecutionOptions | None]:
        """``model``'s architecture and the options it runs under: a :class:`ModelRun`'s
        own options stand unless ``options`` are given."""
        if isinstance(model, ModelRun):
            return model.config, options or model.options
        return model, options

    @classmethod
    def of(cls, model: ModelConfig | ModelRun, options: ExecutionOptions | None = None) -> ModelRun:
        """``model`` as a run: a :class:`ModelRun` as it is (with ``options`` in place of its
        own when given), a :class:`ModelConfig` under ``options`` (default: the defaults)."""
        if isinstance(model, ModelRun):
            return model if options is None else dataclasses.replace(model, options=options)
        return cls(model, options or ExecutionOptions())

    def with_kv_heads_for(self, parallel: ParallelConfig) -> ModelRun:
        """The same run holding the KV-head replicas ``parallel`` calls for
        (:func:`jaxpar.spec.kv_head_replicas` of the checkpoint's heads: ``tp / K`` when
        tp is a multiple of them, else 1)."""
        replicas = kv_head_replicas(parallel, self.config)
        if replicas == self.kv_head_replicas:
            return self
        return dataclasses.replace(self, kv_head_replicas=replicas)

    def with_options(self, **changes: Any) -> ModelRun:
        """The same model with some options changed."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size if self.padded_vocab is None else self.padded_vocab

    @property
    def n_kv_heads(self) -> int:
        """KV heads the run holds: the checkpoint's, each repeated ``kv_head_replicas``
        times (run head ``j`` is checkpoint head ``j // kv_head_replicas``)."""
        return self.config.n_kv_heads * self.kv_head_replicas

    @property
    def q_per_kv(self) -> int:
        """Query heads per run KV head (G in einsum strings)."""
        return self.config.n_heads // self.n_kv_heads

    @property
    def dtype(self) -> Any:
        """The compute dtype: the options' when set, else the checkpoint's."""
        return self.config.dtype if self.options.dtype is None else self.options.dtype

    @property
    def param_dtype(self) -> Any:
        """The parameter dtype: the options' ``dtype`` when set, else the checkpoint's."""
        return self.config.param_dtype if self.options.dtype is None else self.options.dtype

    @property
    def cache_bytes_per_token(self) -> int:
        """Bytes the cache keeps per token over all layers (unsharded, every run KV head,
        replicas included): keys and values of :attr:`ModelConfig.cache_kv_dims` in the
        run's dtype, or stored as the run's ``kv_cache_dtype`` with their scales."""
        c, mode = self.config, self.options.kv_cache_dtype
        widths = sum(kv_bytes_per_vector(h, self.dtype, mode) for h in c.cache_kv_dims)
        return c.n_layers * self.n_kv_heads * widths

    @property
    def int4_group(self) -> int | None:
        """Rows per int4 scale group along a contraction (the spec layer checks that a
        tp-split dim's groups divide over tp); None unless ``quantize="int4"``."""
        return INT4_GROUP if self.options.quantize == "int4" else None

    def expert_capacity(self, tokens: int, peers: int = 1) -> int:
        """Rows a device sends to each of ``peers`` expert peers, for ``tokens`` tokens.

        Dropless (``moe_capacity_factor=None``): ``tokens * min(top_k, E / peers)``, what
        one peer can receive at most (a token's top-k experts are distinct). A factor
        ``cf``: ``ceil(cf * tokens * top_k / peers)``, capped at the dropless bound.
        """
        c = self.config
        return capacity_rows(
            tokens, c.moe.top_k, c.n_experts, peers, self.options.moe_capacity_factor
        )

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the view does not define itself. Guarded so that copying
        # or unpickling (which look attributes up before the fields exist) cannot recurse.
        if name in _OWN_FIELDS or name.startswith("__"):
            raise AttributeError(name)
        if name in _OPTION_FIELDS:
            return getattr(self.options, name)
        return getattr(self.config, name)
