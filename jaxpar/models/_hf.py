"""Import of Hugging Face safetensors checkpoints (no torch).

Everything is validated from the config and the safetensors headers before any tensor data
is read; tensors are then read (whole, or only the slices each device needs) and checked
for NaN/Inf. Any problem raises :class:`CheckpointError` and nothing is returned.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models._config import ModelConfig
from jaxpar.models._decoder import abstract_model
from jaxpar.models._hf_config import config_from_hf, hf_arch
from jaxpar.models._hf_layout import (
    Fused,
    Recipe,
    Repeated,
    deepseek_recipes,
    gpt2_recipes,
    llama_recipes,
    per_layer,
)
from jaxpar.models._hf_mxfp4 import Mxfp4Tensors, is_mxfp4
from jaxpar.models._hf_quant import UNUSED_SUFFIXES, fp8_array, prequantized, scale_recipe
from jaxpar.models._options import ExecutionOptions
from jaxpar.models._quant import SCALE_SUFFIX, float_layout, quantize_array, to_stored
from jaxpar.models._run import ModelRun

#: ``fn(param_path, logical_axes) -> Sharding``.
ShardingFn = Callable[[tuple[str, ...], tuple[str | None, ...]], jax.sharding.Sharding]
# Non-parameter buffers some exporters write: rotary tables, GPT-2's causal-mask buffers.
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_IGNORED = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: Any = None,
    shardings: ShardingFn | Any | None = None,
    layer_loop: str | None = None,
    quantize: str | None = None,
    options: ExecutionOptions | None = None,
    kv_head_replicas: int = 1,
) -> tuple[ModelConfig, nnx.State]:
    """Loads a Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3/Mixtral/Qwen3-MoE/GPT-2/GPT-OSS
    checkpoint (GPT-OSS's MXFP4 experts dequantized to ``dtype``: :mod:`._hf_mxfp4`).

    Args:
        path: Directory with ``config.json`` and ``model.safetensors`` (or shards listed
            in ``model.safetensors.index.json``).
        dtype: Parameter dtype; None keeps the checkpoint's (float32 if unset). Same as
            ``options.dtype``.
        shardings: None to place every tensor on the default device; or a pytree of
            ``jax.sharding.Sharding`` shaped like the params, or a callable
            ``(param_path, logical_axes) -> Sharding``. With shardings each device's
            shard is read alone (``jax.make_array_from_callback``).
        layer_loop: ``"unrolled"`` (one array per layer) or ``"scan"`` (stacked ``[L, ...]``);
            same as ``options.layer_loop``.
        quantize: "int8", "fp8" or "int4": each kernel the quantized model stores with
            scales is quantized as soon as it is read, where it lies (one float tensor
            alive at a time, so a model that fits only quantized loads; see
            :mod:`jaxpar.models._quant`); same as ``options.quantize``. A pre-quantized
            (fp8) checkpoint loads quantized without it.
        options: the run the parameters are loaded for (:class:`ExecutionOptions`):
            its ``dtype``, ``layer_loop`` and ``quantize`` shape the parameters.
        kv_head_replicas: copies of each K/V head the run holds (``ModelRun``'s field of
            that name: :func:`jaxpar.spec.kv_head_replicas`): every ``kv_heads`` dimension
            is loaded expanded, each device reading only the checkpoint heads its slice
            covers (1: the checkpoint's heads).

    Returns:
        (config, params): the checkpoint's config (as its ``config.json`` says, whatever
        the options); params has exactly the structure of ``nnx.state(Decoder(config,
        options))``, so ``nnx.update(abstract_model(config, options), params)`` yields a
        ready model. An :class:`~jaxpar.engine.InferenceEngine` reads the layer form and
        quantization off the parameters.

    Raises:
        CheckpointError: Unsupported architecture; missing, extra or mis-shaped tensor;
            unreadable file; NaN/Inf in a tensor. The message names the culprit.
    """
    root = Path(path)
    hf = _read_json(root / "config.json")
    source = str(root / "config.json")
    mxfp4 = is_mxfp4(hf, hf_arch(hf, source), source)
    prequant = None if mxfp4 else prequantized(hf, source)
    config = config_from_hf(hf, source=source)
    options = (options or ExecutionOptions()).merged(
        dtype=dtype, layer_loop=layer_loop, quantize=quantize
    )
    quantize = options.quantize
    if prequant is not None and quantize not in (None, prequant.mode):
        raise CheckpointError(
            f"{source}: the checkpoint is pre-quantized ({prequant.method}, {prequant.mode} "
            f"weights); quantize={quantize!r} would quantize it again: omit it (or give "
            f"{prequant.mode!r})"
        )
    float_config = ModelRun(
        config,
        dataclasses.replace(options, quantize=None, quantize_embeddings=False),
        kv_head_replicas=kv_head_replicas,
    )
    target = float_config.with_options(
        quantize=quantize or (prequant and prequant.mode),
        quantize_embeddings=options.quantize_embeddings,
    )
    with _Checkpoint(root, mxfp4=mxfp4) as ckpt:
        heads = dataclasses.replace(float_config, kv_head_replicas=1)  # the checkpoint's
        recipes = _recipes(heads, hf, ckpt.shapes, root)
        wanted = dict(nnx.to_flat_state(nnx.state(abstract_model(target))))
        scales = _scale_recipes(recipes, wanted, ckpt.shapes) if prequant else {}
        _validate(
            {**recipes, **scales}, ckpt, config.embed.tied, prequant is not None, _mtp_layers(hf)
        )
        flat = nnx.to_flat_state(nnx.state(abstract_model(float_config)))
        sharding_of = _sharding_lookup(shardings)
        loaded = []
        for param_path, var in flat:
            recipe, want = recipes[param_path], var.get_value()
            recipe = _replicated(recipe, var.get_metadata()["out_sharding"], kv_head_replicas)
            assert recipe.shape == want.shape, (param_path, recipe.shape, want.shape)
            scale_path = (*param_path[:-1], f"{param_path[-1]}{SCALE_SUFFIX}")
            if scale_path in scales:  # stored fp8 with its scales: read, put in storage order
                for path, rec in ((param_path, recipe), (scale_path, scales[scale_path])):
                    stored = wanted[path]
                    order = stored.get_metadata().get("stored_order")
                    value, axes = stored.get_value(), stored.get_metadata()["out_sharding"]
                    shape, axes = float_layout(value.shape, tuple(axes), order)
                    rec = rec if path == param_path else _replicated(rec, axes, kv_head_replicas)
                    arr = _read(rec, shape, value.dtype, axes, ckpt, sharding_of, path)
                    loaded.append((path, stored.replace(to_stored(arr, order))))
                continue
            want = var.get_value()
            axes = tuple(var.get_metadata()["out_sharding"])
            arr = _read(recipe, want.shape, want.dtype, axes, ckpt, sharding_of, param_path)
            if target.quantize is not None and scale_path in wanted:
                scale = wanted[scale_path]
                arr = to_stored(arr, scale.get_metadata().get("stored_order"))
                values, scales_ = quantize_array(arr, scale.get_value().shape, target.quantize)
                del arr  # the float tensor goes before the next one is read
                loaded += [(param_path, wanted[param_path].replace(values))]
                loaded += [(scale_path, scale.replace(scales_))]
            else:
                loaded.append((param_path, var.replace(arr)))
    return config, nnx.from_flat_state(loaded)


def _replicated(recipe, axes, replicas: int):
    """``recipe`` with its ``kv_heads`` dimension repeated ``replicas`` times, if it has
    one (a run's K/V-head replicas: :class:`Repeated`)."""
    axes = tuple(axes)
    if replicas == 1 or "kv_heads" not in axes:
        return recipe
    return Repeated(recipe, axes.index("kv_heads"), replicas)


def _read(recipe, shape, dtype, axes, ckpt: _Checkpoint, sharding_of, path) -> jax.Array:
    """A tensor of ``shape`` (logical ``axes``) read by ``recipe`` in ``dtype``: whole on the
    default device, or each device's slice alone when shardings are given."""
    reader = ckpt.reader(dtype)
    if sharding_of is None:
        return jnp.asarray(recipe.read(tuple(slice(None) for _ in shape), reader))
    return jax.make_array_from_callback(
        tuple(shape),
        sharding_of(path, tuple(axes)),
        _memo(functools.partial(recipe.read, reader=reader)),
        dtype=dtype,  # a process with no device in the sharding reads no shard
    )


def _scale_recipes(recipes, wanted, shapes) -> dict[tuple[Any, ...], Any]:
    """Scale path -> recipe of its stored ``weight_scale``, for every kernel the quantized
    model scales and the checkpoint stores in fp8."""
    out = {}
    for path, recipe in recipes.items():
        scale_path = (*path[:-1], f"{path[-1]}{SCALE_SUFFIX}")
        if scale_path in wanted and (scale := scale_recipe(recipe, shapes)) is not None:
            out[scale_path] = scale
    return out


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None


class _Checkpoint:
    """Open safetensors files of a checkpoint: tensor shapes from headers, slice reads."""

    def __init__(self, root: Path, mxfp4: bool = False) -> None:
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map") or {}
            files = sorted({root / f for f in weight_map.values()})
        else:
            files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors files")
        self.handles: dict[str, Any] = {}  # tensor name -> open safe_open handle
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._open: list[Any] = []
        self._fp8: dict[str, np.ndarray] = {}
        self._mxfp4: Mxfp4Tensors | None = None
        try:
            self._scan(files)
            if mxfp4:
                self._present_mxfp4()
            if index.exists():
                for name, file in weight_map.items():
                    if name not in self.file_of:
                        raise CheckpointError(
                            f"{index} lists tensor {name!r} in {file}, not found there"
                        )
        except BaseException:
            self.__exit__()
            raise

    def _scan(self, files: list[Path]) -> None:
        """Opens every file and records its tensors' names and shapes (headers only)."""
        for file in files:
            try:
                handle = safe_open(str(file), framework="numpy")
                handle.__enter__()
                self._open.append(handle)
                names = handle.keys()  # a safe_open handle is not iterable
                for name in names:
                    if name in self.file_of:
                        raise CheckpointError(
                            f"tensor {name!r} is in both {self.file_of[name]} and {file}"
                        )
                    self.handles[name], self.file_of[name] = handle, file
                    tensor = handle.get_slice(name)
                    self.shapes[name] = tuple(tensor.get_shape())
                    self.dtypes[name] = tensor.get_dtype()
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types and OSError
                raise CheckpointError(
                    f"unreadable or corrupt safetensors file {file}: {e}"
                ) from None

    def _present_mxfp4(self) -> None:
        """Replaces each ``_blocks``/``_scales`` pair by the float tensor it encodes."""
        mx = Mxfp4Tensors(self.shapes, self.dtypes, self._stored_slice)
        for name, shape in mx.shapes.items():
            self.shapes[name], self.dtypes[name] = shape, "MXFP4"
            self.file_of[name] = self.file_of[name + "_blocks"]
        for name in mx.stored:
            del self.shapes[name]
        self._mxfp4 = mx

    def _stored_slice(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
        return self.handles[name].get_slice(name)[slices]

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._open:
            handle.__exit__(None, None, None)

    def _slice(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
        stored = self.dtypes[name]
        if stored == "MXFP4":
            return self._mxfp4.read(name, slices)
        if stored == "F8_E4M3":  # safetensors' numpy API has no float8: mapped by hand
            if name not in self._fp8:
                self._fp8[name] = fp8_array(self.file_of[name], name)
            return np.array(self._fp8[name][slices])
        if stored.startswith("F8"):
            raise CheckpointError(
                f"tensor {name!r} in {self.file_of[name]} is {stored}; jaxpar reads float8 "
                "weights as F8_E4M3 (float8_e4m3fn) only"
            )
        return self.handles[name].get_slice(name)[slices]

    def reader(self, dtype: np.dtype) -> Callable[[str, tuple[slice, ...]], np.ndarray]:
        """A slice reader that checks values are finite and casts to ``dtype``."""

        def read(name: str, slices: tuple[slice, ...]) -> np.ndarray:
            try:
                arr = self._slice(name, slices)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"cannot read tensor {name!r} from corrupt file {self.file_of[name]}: {e}"
                ) from None
            arr = np.asarray(arr)
            if not np.isfinite(arr).all():
                raise CheckpointError(f"tensor {name!r} in {self.file_of[name]} holds NaN/Inf")
            return arr.astype(dtype)

        return read


def _recipes(
    config: ModelConfig, hf: Mapping[str, Any], names: Mapping[str, Any], root: Path
) -> dict[tuple[Any, ...], Recipe | Fused]:
    arch = hf_arch(hf, str(root))
    if arch == "deepseek_v3":  # per layer already (unrolled only: its layers differ)
        return deepseek_recipes(config, _moe_layout(names))
    if arch == "gpt2":
        recipes = gpt2_recipes(config, "transformer." if "wte.weight" not in names else "")
    else:
        layout = "gpt_oss" if config.arch == "gpt_oss" else _moe_layout(names)
        recipes = llama_recipes(config, layout if config.is_moe else None)
    return recipes if config.layer_loop == "scan" else per_layer(recipes, config.n_layers)


def _moe_layout(names: Mapping[str, Any]) -> str:
    """Where the checkpoint keeps its experts (:data:`~._hf_layout.MOE_LAYOUTS`), by name."""
    if any(".block_sparse_moe." in n for n in names):
        return "legacy"  # Mixtral: experts.{j}.w1/w3/w2
    if any(_PER_EXPERT.search(n) for n in names):
        return "per_expert"  # Qwen3-MoE on the Hub: mlp.experts.{j}.gate_proj/up_proj/down_proj
    return "fused"  # transformers 5.x: mlp.experts.gate_up_proj, down_proj


def _mtp_layers(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """The name prefixes of DeepSeek-V3's multi-token-prediction layers (after the decoder
    layers): the model does not run them (speculative decoding's ``mtp`` reads them)."""
    if hf.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        return ()
    n = hf.get("num_hidden_layers", 0)
    return tuple(f"model.layers.{n + i}." for i in range(hf.get("num_nextn_predict_layers") or 0))


def _validate(
    recipes: Mapping[Any, Any],
    ckpt: _Checkpoint,
    tied: bool,
    prequantized: bool = False,
    skipped: tuple[str, ...] = (),
) -> None:
    """Names and shapes against the headers, before reading any data. A pre-quantized
    checkpoint may also hold activation and KV-cache scales jaxpar does not use
    (:data:`~._hf_quant.UNUSED_SUFFIXES`); tensors named with a ``skipped`` prefix are not
    the model's (DeepSeek's MTP layers)."""
    expected: dict[str, tuple[int, ...]] = {}
    for recipe in recipes.values():
        expected.update(recipe.tensors())
    missing = [n for n in expected if n not in ckpt.shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint lacks tensor {missing[0]!r}{more}")
    for name, shape in expected.items():
        if ckpt.shapes[name] != shape:
            raise CheckpointError(
                f"tensor {name!r} in {ckpt.file_of[name]}: expected shape "
                f"{shape}, found {ckpt.shapes[name]}"
            )
    for name in ckpt.shapes:
        ignorable = _IGNORED.search(name) or (tied and name == "lm_head.weight")
        ignorable = ignorable or (prequantized and name.endswith(UNUSED_SUFFIXES))
        ignorable = ignorable or name.startswith(skipped)
        if name not in expected and name.endswith(".weight_scale"):
            raise CheckpointError(
                f"{name!r} in {ckpt.file_of[name]}: {name.removesuffix('_scale')} is stored "
                "quantized, but jaxpar keeps it in the model dtype (only attention and "
                "dense-FFN projections load quantized)"
            )
        if name not in expected and not ignorable:
            raise CheckpointError(
                f"unexpected tensor {name!r} in {ckpt.file_of[name]}: not part of this architecture"
            )


def _sharding_lookup(shardings: ShardingFn | Any | None) -> ShardingFn | None:
    """``(path, logical_axes) -> Sharding`` from a callable or a params-shaped pytree."""
    if shardings is None or callable(shardings):
        return shardings
    by_path = dict(_flatten_shardings(shardings))

    def lookup(path: tuple[Any, ...], _axes: tuple[str | None, ...]) -> jax.sharding.Sharding:
        key = tuple(map(str, path))  # layer indices are ints in state paths
        if key not in by_path:
            raise ConfigError(f"shardings has no entry for parameter {'.'.join(key)}")
        return by_path[key]

    return lookup


def _flatten_shardings(tree: Any) -> Iterator[tuple[tuple[str, ...], jax.sharding.Sharding]]:
    def is_leaf(x: Any) -> bool:
        return isinstance(x, jax.sharding.Sharding | nnx.Variable)

    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        path = tuple(
            str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keypath
        )
        yield path, leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _memo(
    read: Callable[[tuple[slice, ...]], np.ndarray],
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """Reads each distinct slice once (replicated devices ask for the same one)."""
    cache: dict[tuple, np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = read(index)
        return cache[key]

    return callback
